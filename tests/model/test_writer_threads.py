"""The writer's encoding threads and staged chunks (issue 39, item 3): several chunks encode at once
while the writes keep their order and bytes; chunks from an accelerator go through reused host
buffers. No GPU here: ``force_staging`` runs the staging bookkeeping on CPU."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from helpers.entries import make_entry
from helpers.tiny import make_tiny_model
from kvstore.model.adapter import Adapter
from kvstore.model.io import offload
from kvstore.model.io import writer as writer_module
from kvstore.model.io.writer import Writer
from kvstore.store.access import kind_of_blob
from kvstore.store.kvstore import KVStore

CHUNK = 16


@pytest.mark.parametrize("spec", ["raw", "zstd-split:1:16", "zstd:1"])
@pytest.mark.parametrize("threads", [1, 4])
def test_encoding_threads_keep_the_order_and_the_bytes(monkeypatch, spec, threads):
    """Chunks put in order are written in that order, with the bytes a sequential encode gives, even
    when the earliest ones encode slowest; with several threads, encodings overlap."""
    entries = [make_entry(i, n_tokens=8 + i, dtype=torch.bfloat16, created=1700000000.0 + i) for i in range(10)]
    with KVStore("memory://", codec=spec) as store:
        expected = [store.encode(e) for e in entries]
        written: list[tuple[str, bytes]] = []
        real_put, real_encode = store.put, store.encode
        busy, most = [0], [0]
        lock = threading.Lock()

        def slow_encode(entry, codec=None):
            with lock:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            time.sleep(0.02 * (len(entries) - entries.index(entry)))  # the first slowest
            try:
                return real_encode(entry, codec)
            finally:
                with lock:
                    busy[0] -= 1

        def spy_put(blob, **kw):
            written.append((kind_of_blob(blob)[2], bytes(blob)))
            return real_put(blob, **kw)

        monkeypatch.setattr(store, "encode", slow_encode)
        monkeypatch.setattr(store, "put", spy_put)
        writer = Writer(store, threads=threads)
        for e in entries:
            writer.put(e)
        writer.close()
        assert [k for k, _ in written] == [e.key for e in entries], "writes left the put order"
        assert [b for _, b in written] == expected, "an entry encoded on a worker differs from a sequential encode"
        assert writer.stats.chunks_written == len(entries)
        assert (most[0] > 1) == (threads > 1), f"{most[0]} encodings at once with {threads} threads"


def test_a_failing_encoding_stops_later_writes_and_is_raised(monkeypatch):
    entries = [make_entry(i) for i in range(6)]
    with KVStore("memory://") as store:
        real_encode = store.encode

        def failing(entry, codec=None):
            if entry.key == entries[2].key:
                raise RuntimeError("encoder broke")
            return real_encode(entry, codec)

        monkeypatch.setattr(store, "encode", failing)
        writer = Writer(store, threads=3)
        for e in entries:
            try:
                writer.put(e)
            except RuntimeError:
                break
        with pytest.raises(RuntimeError, match="encoder broke"):
            writer.close()
        assert [store.contains(e.key) for e in entries[:3]] == [True, True, False]
        assert not any(store.contains(e.key) for e in entries[3:]), "a chunk after the failed one was written"


def _contexts(tok):
    rng = random.Random(3)
    vocab = list(range(10, tok.vocab_size))
    return [[rng.choice(vocab) for _ in range(n)] for n in (70, 45, 33, 90)]


def test_staged_chunks_store_what_direct_ones_store_through_reused_buffers(monkeypatch):
    """With ``force_staging`` every computed chunk goes through the writer's host buffers: the store
    holds the same chunks and tensors as a build without staging, the buffers are reused (fewer
    allocations than chunks) and all come back once the writer is done."""
    model, tok = make_tiny_model("llama", dtype=torch.bfloat16, seed=4)
    adapter = Adapter(model, tok)
    contexts = _contexts(tok)
    with KVStore("memory://", codec="zstd-split:1:16", chunk_tokens=CHUNK) as direct:
        adapter.generate_kv_cache(contexts, direct)
        want = {k: direct.get(k) for k in direct.keys()}
    made: list[offload.HostBuffers] = []
    staged: list[str] = []
    real_init, real_stage = offload.HostBuffers.__init__, offload.HostBuffers.stage

    def spy_init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    def spy_stage(self, entry):
        staged.append(entry.key)
        out = real_stage(self, entry)
        assert all(kv is None or kv[0].data_ptr() >= out.buffer.data_ptr() for kv in out.entry.layers)
        return out

    monkeypatch.setattr(offload.HostBuffers, "__init__", spy_init)
    monkeypatch.setattr(offload.HostBuffers, "stage", spy_stage)
    monkeypatch.setattr(adapter.handle, "force_staging", True)
    # a writer budget under one chunk: each chunk is staged once the one before is written (and its
    # buffer given back), so reuse does not hang on how fast the writer thread runs on a loaded machine
    monkeypatch.setattr(writer_module, "WRITER_BYTES", 1)
    with KVStore("memory://", codec="zstd-split:1:16", chunk_tokens=CHUNK) as store:
        adapter.generate_kv_cache(contexts, store)
        got = {k: store.get(k) for k in store.keys()}
    assert got.keys() == want.keys()
    for k, e in got.items():
        if e is None:  # a context record
            continue
        w = want[k]
        assert torch.equal(e.token_ids, w.token_ids)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(e.layers, w.layers))
    n_chunks = sum(-(-len(c) // CHUNK) for c in contexts)
    assert len(made) == 1 and len(staged) == n_chunks
    host = made[0]
    assert 1 <= host.allocations < n_chunks, f"{host.allocations} buffers allocated for {n_chunks} chunks"
    assert len(host.free) == host.allocations, "a staged buffer was not given back"


def test_host_buffers_take_the_smallest_free_fit_and_keep_a_bounded_pool():
    host = offload.HostBuffers(cuda=False, keep=1000)
    a, b = host.take(100), host.take(600)
    assert host.allocations == 2 and a.numel() == 128 and b.numel() == 640
    host.give(b)
    host.give(a)
    assert host.take(50).data_ptr() == a.data_ptr() and host.allocations == 2
    host.give(a)
    host.give(host.take(900))  # 128 + 640 + 960 > 1000: the largest free ones are dropped
    assert sum(x.numel() for x in host.free) <= 1000 and host.allocations == 3
