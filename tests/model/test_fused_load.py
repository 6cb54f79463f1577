"""Loads verify each chunk's checksum while copying it (``kvstore.store.fused``): a flipped byte
anywhere in a chunk's stored bytes (its first block, its middle, its last block) makes that chunk
a miss on the direct CPU path and through the staging ring (``force_staging``), for ``raw`` and
the lossless codecs, with answers those of no store at all; an intact store answers as it did
when every checksum was verified before the copy, bit for bit, and no chunk is read twice."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.tiny import make_tiny_model
from kvstore.errors import CorruptEntryWarning
from kvstore.model.adapter import Adapter
from kvstore.model.io import staging
from kvstore.model.stages import load as load_stage
from kvstore.store import fused
from kvstore.store import kvstore as kvstore_module
from kvstore.store.kvstore import KVStore

CHUNK = 16
CODECS = ["raw", "zstd-split:1:16", "zstd-split:1", "zstd:1"]


@pytest.fixture(scope="module")
def tiny():
    model, tok = make_tiny_model("llama", dtype=torch.float32, seed=6)
    return Adapter(model, tok)


def _rows(tok, seed: int = 3):
    rng = random.Random(seed)
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    contexts = [[rng.choice(vocab) for _ in range(n)] for n in (70, 45)]
    questions = [[rng.choice(vocab) for _ in range(n)] for n in (3, 2)]
    return contexts, questions


def _sample(adapter, contexts, questions, store, **kw):
    kw = dict(store=store, stop_at_eos=False, batch_size=2, return_details=True, return_scores=True) | kw
    return adapter.greedy_sample(contexts, questions, 4, **kw)


def _kv_spans(store: KVStore, keys: list[str]) -> list[tuple[int, int]]:
    """The spans of the last chunk of ``keys``' frame that its key and value records read, in order."""
    with store.open_chain(keys, lazy=True, defer=True) as views:
        view = views[-1]
        base, end = fused.address(view.unverified), len(view.unverified) - 8
        spans = [fused.record_spans(r, base, end) for kv in view.layers if kv is not None for r in kv]
    assert all(s is not None for s in spans), "the records' bytes are the frame's"
    return sorted(s for ss in spans if ss is not None for s in ss)


@pytest.fixture
def counted(monkeypatch):
    """How many times a whole chunk was verified apart from its copy, and how many digests fed by
    copies were checked."""
    counts = {"verify": 0, "fused": 0}
    real_verify, real_check = kvstore_module.verify_checksum, fused.ChunkWork.check

    def verify(buf):
        counts["verify"] += 1
        return real_verify(buf)

    def check(self):
        counts["fused"] += 1
        return real_check(self)

    for module in (kvstore_module, load_stage, staging):
        monkeypatch.setattr(module, "verify_checksum", verify)
    monkeypatch.setattr(fused.ChunkWork, "check", check)
    return counts


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("spec", CODECS)
def test_a_flipped_byte_in_a_chunk_never_reaches_the_model(tiny, monkeypatch, counted, spec, where, staged):
    monkeypatch.setattr(fused, "BLOCK", 256)  # several blocks per chunk (a real chunk: 256 KiB each)
    contexts, questions = _rows(tiny.tokenizer)
    reference = _sample(tiny, contexts, questions, None, use_cache=False)
    with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
        tiny.generate_kv_cache(contexts, store)
        keys = list(tiny.chain(contexts[0], store).keys[:3])
        key, spans = keys[-1], _kv_spans(store, keys)
        at = {"first": spans[0][0], "middle": spans[len(spans) // 2][0] + 1, "last": spans[-1][1] - 1}[where]
        name = b"e/" + key.encode()
        bad = bytearray(store.backend.get(name))
        bad[at] ^= 0x10
        store.backend.put(name, bytes(bad))
        monkeypatch.setattr(tiny.handle, "force_staging", staged)
        with pytest.warns(CorruptEntryWarning, match=key[:16]):
            got = _sample(tiny, contexts, questions, store, use_cache=True)
    assert counted["fused"] > 0, "no chunk was verified while it was copied"
    assert got.cached_tokens[0] == 2 * CHUNK and not got.cache_hit[0] and got.cache_hit[1]
    assert torch.equal(got.tokens, reference.tokens)
    for x, y in zip(got.scores, reference.scores):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)  # prefix + rest vs one forward (float32)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("spec", CODECS)
def test_verified_while_copied_answers_as_verified_first(tiny, monkeypatch, counted, spec, staged):
    monkeypatch.setattr(fused, "BLOCK", 256)
    contexts, questions = _rows(tiny.tokenizer)
    with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
        tiny.generate_kv_cache(contexts, store)
        monkeypatch.setattr(tiny.handle, "force_staging", staged)
        got = _sample(tiny, contexts, questions, store)
        n_chunks = sum(-(-len(c) // CHUNK) for c in contexts)
        assert counted == {"verify": 0, "fused": n_chunks}, "a chunk was read twice, or not verified"
        monkeypatch.setattr(KVStore, "_single_copy", lambda self: False)  # the old order: verify, then copy
        before = _sample(tiny, contexts, questions, store)
    assert counted["verify"] > 0
    assert all(got.cache_hit) and all(before.cache_hit)
    assert torch.equal(got.tokens, before.tokens)
    for x, y in zip(got.scores, before.scores):
        assert torch.equal(x, y)


def _work(frame: bytes, spans) -> fused.ChunkWork:
    work = fused.ChunkWork(frame)
    for lo, hi in spans:
        work.jobs.append((lambda: None, lo, hi, 0, 0, 0))
    assert work.seal()
    return work


def test_a_chunk_hashed_out_of_order_or_short_fails():
    """A chunk's jobs are hashed in the frame's order whichever thread runs them, the bytes between
    them included, and a frame not read whole is refused."""
    import xxhash

    body = bytes(range(256)) * 40
    frame = body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
    spans = [(10, 500), (600, 4000), (4000, 9000)]
    work = _work(frame, spans)
    work.run_job(2)
    work.run_job(1)
    assert work.pos == 0, "a job was hashed before its turn"
    work.run_job(0)
    work.check()
    in_turn = _work(frame, spans)
    in_turn.run_in_turn()
    in_turn.check()
    short = _work(frame, spans)
    short.run_job(0)
    short.run_job(1)
    with pytest.raises(Exception, match="not read whole"):
        short.check()
    flipped = bytearray(frame)
    flipped[550] ^= 1  # a byte between jobs (a header) counts too
    wrong = _work(bytes(flipped), spans)
    wrong.run_in_turn()
    with pytest.raises(Exception, match="checksum mismatch"):
        wrong.check()
    overlapping = fused.ChunkWork(frame)
    overlapping.jobs += [(lambda: None, 0, 20, 0, 0, 0), (lambda: None, 10, 30, 0, 0, 0)]
    assert not overlapping.seal()
    outside = fused.ChunkWork(frame)
    outside.copy(0, len(body) - 4, 8)  # past the checksummed bytes
    assert not outside.seal()


def test_a_run_of_copies_is_cut_into_blocks_that_cover_it():
    """A run of raw bytes is one job until sealed, then blocks of ``BLOCK`` bytes (the last one
    shorter) that copy it whole, bit for bit, in any order of the threads that run them."""
    import xxhash

    n = 3 * fused.BLOCK + 100
    body = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    frame = body.numpy().tobytes()
    frame += xxhash.xxh3_64_intdigest(frame).to_bytes(8, "little")
    for order in ("in turn", "reversed"):
        dest = torch.zeros(n, dtype=torch.uint8)
        work = fused.ChunkWork(frame)
        work.copy(dest.data_ptr(), 32, n)
        assert len(work.jobs) == 1
        assert work.seal()
        assert [(j[1], j[2], j[5]) for j in work.jobs] == [
            (32, 32 + fused.BLOCK, fused.BLOCK),
            (32 + fused.BLOCK, 32 + 2 * fused.BLOCK, fused.BLOCK),
            (32 + 2 * fused.BLOCK, 32 + 3 * fused.BLOCK, fused.BLOCK),
            (32 + 3 * fused.BLOCK, 32 + n, 100),
        ]
        if order == "in turn":
            work.run_in_turn()
        else:
            for k in reversed(range(len(work.jobs))):
                work.run_job(k)
        work.check()
        assert torch.equal(dest, body[32 : 32 + n])
