"""zstd frames decoded on the device (``kvstore.model.io.device_zstd``): a lossless chunk
crosses compressed, its frames decode in one batched call and its byte planes are put back
together on the device. No GPU here: the stand-in decoder (CPU zstd) runs the same bookkeeping
through ``force_staging``. Loads answer as direct loads bit for bit; a frame that does not decode
(under an intact checksum) and a flipped byte (caught by the checksum before anything is sent)
are misses that never reach the model."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.entries import split
from helpers.tiny import make_tiny_model
from kvstore.errors import CorruptEntryWarning
from kvstore.model.adapter import Adapter
from kvstore.model.io import device_zstd, staging
from kvstore.store.frame import seal
from kvstore.store.kvstore import KVStore

CHUNK = 16


def _rows(tok, seed: int = 3):
    rng = random.Random(seed)
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    contexts = [[rng.choice(vocab) for _ in range(n)] for n in (70, 45)]
    questions = [[rng.choice(vocab) for _ in range(n)] for n in (3, 2)]
    return contexts, questions


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def tiny(request):
    model, tok = make_tiny_model("llama", dtype=request.param, seed=6)
    return Adapter(model, tok)


def _sample(adapter, contexts, questions, store, **kw):
    kw = dict(store=store, stop_at_eos=False, batch_size=2, return_details=True, return_scores=True) | kw
    return adapter.greedy_sample(contexts, questions, 4, **kw)


@pytest.fixture
def on_device(monkeypatch):
    """Loads staged (``force_staging``) with the stand-in decoder; counts the chunks that crossed
    compressed and the frames decoded."""
    seen = {"chunks": 0, "frames": 0}
    real = device_zstd.decode_into

    class Counting(device_zstd.CpuZstdDecoder):
        def decode(self, frames, sizes):
            seen["frames"] += len(frames)
            return super().decode(frames, sizes)

    def decode_into(chunk, device_bytes, decoder):
        seen["chunks"] += 1
        return real(chunk, device_bytes, decoder)

    monkeypatch.setattr(device_zstd, "decoder_for", lambda device, stream: Counting())
    monkeypatch.setattr(device_zstd, "decode_into", decode_into)
    return seen


def _codecs(adapter) -> list[str]:
    # zstd-split:1:16 (the default) compresses 16-bit floats only: a float32 cache has no frames
    return ["zstd-split:1:16", "zstd:1"] if adapter.handle.dtype == torch.bfloat16 else ["zstd-split:1", "zstd:1"]


def test_chunks_decoded_on_the_device_answer_as_direct_loads(tiny, monkeypatch, on_device):
    contexts, questions = _rows(tiny.tokenizer)
    for spec in _codecs(tiny):
        with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
            tiny.generate_kv_cache(contexts, store)
            monkeypatch.setattr(tiny.handle, "force_staging", False)
            direct = _sample(tiny, contexts, questions, store)
            monkeypatch.setattr(tiny.handle, "force_staging", True)
            before = dict(on_device)
            got = _sample(tiny, contexts, questions, store)
        n_chunks = sum(-(-len(c) // CHUNK) for c in contexts)
        assert on_device["chunks"] - before["chunks"] == n_chunks, f"{spec}: not every chunk crossed compressed"
        assert on_device["frames"] > before["frames"]
        assert all(got.cache_hit)
        assert torch.equal(got.tokens, direct.tokens), spec
        for x, y in zip(got.scores, direct.scores):
            assert torch.equal(x, y), spec


def _broken_frame(blob: bytes) -> bytes:
    """``blob`` (a zstd-split or zstd chunk) with its largest zstd frame's blocks zeroed (the
    frame's header kept) and the checksum made to match: a frame that does not decode."""
    header, payload = split(blob)
    params = header["codec"]
    rows = params.get("parts") or params.get("frames")
    pos, spans = 0, []
    for stored, raw in rows:
        spans.append((pos, stored, raw))
        pos += stored
    if "parts" in params:  # zstd-split: part 0 is the payload's own header, compressed
        spans = spans[1:]
    start, stored, _ = max((s for s in spans if s[1] != s[2]), key=lambda s: s[1])  # a KV plane, not token ids
    bad = bytearray(payload)
    bad[start + 12 : start + stored] = bytes(stored - 12)
    return seal(header, bytes(bad))


@pytest.mark.parametrize("damage", ["frame", "flipped"])
def test_a_frame_that_does_not_decode_on_the_device_is_a_miss(tiny, monkeypatch, on_device, damage):
    contexts, questions = _rows(tiny.tokenizer)
    spec = _codecs(tiny)[0]
    written = []
    real_decode_into = device_zstd.decode_into

    def watching(chunk, device_bytes, decoder):
        try:
            real_decode_into(chunk, device_bytes, decoder)
        except Exception:
            written.append(False)
            raise
        written.append(True)

    monkeypatch.setattr(device_zstd, "decode_into", watching)
    with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
        tiny.generate_kv_cache(contexts, store)
        key = tiny.chain(contexts[0], store).keys[2]
        name = b"e/" + key.encode()
        blob = store.backend.get(name)
        if damage == "frame":
            store.backend.put(name, _broken_frame(blob))
        else:
            bad = bytearray(blob)
            bad[len(bad) - 40] ^= 0x04  # in the last part's bytes, before the trailer
            store.backend.put(name, bytes(bad))
        monkeypatch.setattr(tiny.handle, "force_staging", True)
        with pytest.warns(CorruptEntryWarning, match=key[:16]):
            got = _sample(tiny, contexts, questions, store, use_cache=True)
        store.backend.delete(name)  # the same load with that chunk missing: what the answer must be
        missing = _sample(tiny, contexts, questions, store, use_cache=True)
    if damage == "frame":
        assert False in written, "the broken frame was not decoded on the device"
    assert got.cached_tokens[0] == 2 * CHUNK and not got.cache_hit[0] and got.cache_hit[1]
    assert torch.equal(got.tokens, missing.tokens)
    for x, y in zip(got.scores, missing.scores):
        assert torch.equal(x, y)


def test_no_decoder_without_cuda_and_no_cuda_package_imported():
    """On a CPU the frames decode on the CPU (no decoder), and loading kvstore's load path imports
    no nvCOMP."""
    import sys

    import kvstore.model.stages.load  # noqa: F401

    assert device_zstd.decoder_for(torch.device("cpu"), None) is None
    assert not any(name.startswith("nvidia") for name in sys.modules)
    assert staging.Staging(torch.device("cpu")).decoder is None
