"""Loads for accelerators, checked on CPU: dequantization on the destination's device equals the
host's bit for bit, staged loads (one host region and one copy per layer, or device decoding)
fill the batch buffers exactly as direct loads do, also when a chunk turns out corrupt, and
decompression on several threads equals decompression on one.

No GPU here: ``Staging(cpu, force=True)`` runs the staged bookkeeping with ordinary host tensors, and
``stage=`` runs the readers' device branch (fresh tensors on the destination's device instead of
the host's per-thread scratch) on CPU. ``test_cuda_staged_load_matches_cpu`` runs where CUDA is."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch

from helpers.entries import bits, decode_host_and_staged, split, with_frame
from helpers.tiny import make_tiny_model
from kvstore.errors import CorruptEntryWarning
from kvstore.model.adapter import Adapter
from kvstore.model.compute.cache import new_buffers
from kvstore.model.io import staging
from kvstore.model.stages.load import load_prefix
from kvstore.store.codecs import get_codec
from kvstore.store.codecs import records as records_mod
from kvstore.store.kvstore import KVStore

CHUNK = 16
CODECS = ("raw", "zstd:1", "zstd-shuffle:1", "int8", "int4", "int8:32+zstd:1", "fp8", "ecq", "int4h", "kvh:8/4:t=8")


def _ids(tok, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    return [rng.choice(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def llama():
    model, tok = make_tiny_model("llama", dtype=torch.float32, seed=5)
    return Adapter(model, tok)


@pytest.fixture
def forced(llama, monkeypatch):
    """Loads of the ``llama`` fixture staged on CPU, as on an accelerator."""
    monkeypatch.setattr(llama.handle, "force_staging", True)


def _reader(spec: str, role: str, x: torch.Tensor, start: int, lazy: bool):
    """A reader of ``x`` ([heads, n, dim]) stored under ``spec`` as a chunk at ``start``."""
    codec = get_codec(spec)
    payload, params, raw = codec.encode([("t", x, role)], {}, start)
    decoded = codec.packing.unpack(payload, params, raw, threads=1, lazy=lazy)
    return codec.quantizer.reader(role, "t", decoded.tensors, tuple(x.shape), x.dtype), payload


@pytest.mark.parametrize("spec", ["int8:32/8", "int4:32/8", "int8+zstd:1", "int4+zstd-shuffle:1"])
@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("start", [0, 48])  # a context's first chunk keeps sink tokens; later ones do not
def test_device_dequantization_equals_host_bit_for_bit(spec, role, dtype, start):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 70, 16, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)  # 70: a partial key group
    for lazy in (False, True):
        reader, _ = _reader(spec, role, x, start, lazy)
        assert getattr(reader, "device_decode", False)
        host, dev, st, uploaded = decode_host_and_staged(reader, dtype)
        assert torch.equal(bits(dev), bits(host)), "device branch differs from the host's dequantization"
        assert st.counts["device_decoded"] == 1 and st.counts["records"] == 0
        codes = [s for s, d in uploaded if d == torch.uint8]
        assert len(codes) == 1 and codes[0][1] == 70 - (4 if start == 0 else 0), "codes go up as uint8"
        assert not any(s == (3, 70, 16) and d.is_floating_point for s, d in uploaded), "no float values go up"
        assert torch.isnan(dev[1, :, :7]).all() and torch.isnan(dev[1, :, 77:]).all() and torch.isnan(dev[0]).all()


def _contexts(adapter):
    tok = adapter.tokenizer
    return [_ids(tok, 60, 1), _ids(tok, 37, 2)], [_ids(tok, 3, 3), _ids(tok, 2, 4)]


def _load(adapter, store, plan, slots, row, slot0, st=None):
    bufs = new_buffers(adapter.kv_shapes(), 2, slots, adapter.dtype, torch.device("cpu"))
    for kb, vb in bufs:
        kb.fill_(float("nan"))
        vb.fill_(float("nan"))
    got = load_prefix(adapter.handle, store, plan, bufs, row, slot0, staging=st)
    if st is not None:
        st.finish()
    return got, bufs


@pytest.mark.parametrize("spec", CODECS)
def test_staged_load_fills_the_buffers_as_a_direct_load(llama, forced, spec):
    adapter = llama
    n_layers = len(adapter.kv_shapes())
    contexts, _ = _contexts(adapter)
    with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
        adapter.generate_kv_cache(contexts, store)
        for ctx in contexts:
            plan = adapter.chain(ctx, store)
            direct_n, direct = _load(adapter, store, plan, 80, 1, 80 - len(ctx))
            st = staging.Staging(torch.device("cpu"), force=True)
            own = []  # host tensors allocated for one upload or record (not ring slots)
            st.host_like = lambda shape, dtype, own=own, real=st.host_like: own.append(shape) or real(shape, dtype)  # type: ignore[method-assign]
            staged_n, staged = _load(adapter, store, plan, 80, 1, 80 - len(ctx), st)
            assert staged_n == direct_n == len(ctx)
            for (kd, vd), (ks, vs) in zip(direct, staged):
                assert torch.equal(bits(kd), bits(ks)) and torch.equal(bits(vd), bits(vs))
            chunks = len(plan.keys)
            assert not own, "an upload or record allocated a host tensor of its own instead of using a ring slot"
            if spec.startswith(("int", "ecq", "kvh")):  # dequantized where the buffers are, record by record
                assert st.counts == {"chunks": 0, "device_chunks": chunks, "device_decoded": 2 * n_layers * chunks,
                                     "records": 0, "uploads": st.counts["uploads"], "compressed_chunks": 0}  # fmt: skip
                assert st.counts["uploads"] >= 3 * 2 * n_layers * chunks  # codes, scales, zeros (+ sink)
            else:  # one ring slot and one copy per chunk, whatever the number of layers
                assert st.counts == {"chunks": chunks, "device_chunks": 0, "device_decoded": 0, "records": 0,
                                     "uploads": 0, "compressed_chunks": 0}  # fmt: skip


def test_staged_answers_equal_direct_answers(llama, monkeypatch):
    adapter = llama
    contexts, questions = _contexts(adapter)
    for spec in ("zstd-shuffle:1", "int4"):
        with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
            adapter.generate_kv_cache(contexts, store)
            kw = dict(store=store, stop_at_eos=False, batch_size=2, return_details=True, return_scores=True)
            direct = adapter.greedy_sample(contexts, questions, 5, **kw)
            with monkeypatch.context() as m:
                m.setattr(adapter.handle, "force_staging", True)
                staged = adapter.greedy_sample(contexts, questions, 5, **kw)
        assert all(staged.cache_hit) and torch.equal(staged.tokens, direct.tokens)
        for a, b in zip(staged.scores, direct.scores):
            assert torch.equal(a, b)


def test_a_corrupt_chunk_ends_a_staged_load_where_it_ends_a_direct_one(llama, forced):
    """Chunk 1's values of one layer do not decompress (checksum intact): both loads stop after
    chunk 0; chunk 0 is sent, nothing of chunk 1 (or later) is, and the slots chunk 0 fills equal
    the direct load's while chunk 1's stay as they were (NaN here: the complete stage recomputes
    them)."""
    import zstandard

    adapter = llama
    ctx = _contexts(adapter)[0][0]
    with KVStore("memory://", codec="zstd:1", chunk_tokens=CHUNK) as store:
        adapter.generate_kv_cache([ctx], store)
        plan = adapter.chain(ctx, store)
        key = plan.keys[1]
        header, payload = split(store.backend.get(b"e/" + key.encode()))
        index = len(header["codec"]["frames"]) - 2  # a key or value tensor near the end (the last: token ids)
        size = header["codec"]["frames"][index][1]
        garbage = zstandard.ZstdCompressor(write_content_size=True).compress(b"\1" * size)
        store.backend.put(b"e/" + key.encode(), with_frame(header, payload, index, garbage[:-4] + bytes(4)))
        with pytest.warns(CorruptEntryWarning):
            direct_n, direct = _load(adapter, store, plan, 64, 0, 2)
        st = staging.Staging(torch.device("cpu"), force=True)
        with pytest.warns(CorruptEntryWarning):
            staged_n, staged = _load(adapter, store, plan, 64, 0, 2, st)
    assert staged_n == direct_n == CHUNK
    assert st.counts["chunks"] == 1
    for (kd, vd), (ks, vs) in zip(direct, staged):
        assert torch.equal(bits(kd[0, :, 2 : 2 + CHUNK]), bits(ks[0, :, 2 : 2 + CHUNK]))
        assert torch.equal(bits(vd[0, :, 2 : 2 + CHUNK]), bits(vs[0, :, 2 : 2 + CHUNK]))
        assert not torch.isnan(ks[0, :, 2 : 2 + CHUNK]).any()
        assert torch.isnan(ks[0, :, 2 + CHUNK :]).all() and torch.isnan(vs[0, :, 2 + CHUNK :]).all()


@pytest.mark.parametrize("spec", ["zstd-shuffle:1", "zstd:3", "int8+zstd:1"])
@pytest.mark.parametrize("force", [False, True])
def test_parallel_decompression_equals_serial(llama, monkeypatch, spec, force):
    """Lazy zstd frames decompress inside the copy tasks; on 4 threads (direct, or into staged
    slots) the buffers hold exactly what one thread gives."""
    adapter = llama
    ctx = _contexts(adapter)[0][0]
    threads: set[str] = set()
    real = records_mod.TensorRecord.copy_into

    def spy(self, dest):
        threads.add(threading.current_thread().name)
        time.sleep(0.002)  # long enough for the pool's other workers to take the next tasks
        real(self, dest)

    with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
        adapter.generate_kv_cache([ctx], store)
        plan = adapter.chain(ctx, store)
        store.codec = dataclasses.replace(store.codec, threads=1)
        serial_n, serial = _load(adapter, store, plan, 64, 0, 4)
        monkeypatch.setattr(records_mod.TensorRecord, "copy_into", spy)
        store.codec = dataclasses.replace(store.codec, threads=4)
        st = staging.Staging(torch.device("cpu"), force=force)
        par_n, par = _load(adapter, store, plan, 64, 0, 4, st)
    assert par_n == serial_n == len(ctx)
    assert len({t for t in threads if t.startswith("kvstore-load")}) > 1, "decoding did not spread over threads"
    for (ka, va), (kb, vb) in zip(serial, par):
        assert torch.equal(bits(ka), bits(kb)) and torch.equal(bits(va), bits(vb))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", CODECS)
def test_cuda_staged_load_matches_cpu(spec):
    """On a GPU: loads through pinned regions are bit-exact; device dequantization agrees with the
    host's up to float32 rounding (a fused multiply-add on the device may round once less)."""
    model, tok = make_tiny_model("llama", dtype=torch.float32, seed=5)
    cpu = Adapter(model, tok)
    ctx = _ids(tok, 60, 1)
    with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
        cpu.generate_kv_cache([ctx], store)
        plan = cpu.chain(ctx, store)
        want_n, want = _load(cpu, store, plan, 64, 0, 4)
        dev = torch.device("cuda")
        bufs = new_buffers(cpu.kv_shapes(), 2, 64, torch.float32, dev)
        st = staging.Staging(dev)
        got_n = load_prefix(cpu.handle, store, plan, bufs, 0, 4, staging=st)
        st.finish()
    assert got_n == want_n == len(ctx)
    for (kw, vw), (kg, vg) in zip(want, bufs):
        for w, g in ((kw, kg), (vw, vg)):
            w, g = w[0, :, 4 : 4 + len(ctx)], g[0, :, 4 : 4 + len(ctx)].cpu()
            if spec.startswith(("int", "ecq")):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(bits(g), bits(w))


@pytest.mark.parametrize("spec", ["int4", "int8+zstd:1"])
def test_a_lossy_miss_answers_from_what_a_staged_load_gives_back(llama, forced, monkeypatch, spec):
    """A miss under a lossy codec answers from the decoded codes (``store_and_reload``); it decodes
    them through staging as loads do (on the device), so the next run's hit answers the same."""
    adapter = llama
    contexts, questions = _contexts(adapter)
    device_decoded: list[bool] = []
    real = staging.Staging.copy_into

    def spy(self, record, dest):
        device_decoded.append(getattr(record, "device_decode", False))
        real(self, record, dest)

    monkeypatch.setattr(staging.Staging, "copy_into", spy)
    with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
        kw = dict(store=store, stop_at_eos=False, batch_size=2, return_details=True, return_scores=True)
        miss = adapter.greedy_sample(contexts, questions, 5, **kw)
        assert not any(miss.cache_hit) and device_decoded and all(device_decoded)
        hit = adapter.greedy_sample(contexts, questions, 5, **kw)
    assert all(hit.cache_hit) and torch.equal(hit.tokens, miss.tokens)
    for a, b in zip(hit.scores, miss.scores):
        assert torch.equal(a, b)
