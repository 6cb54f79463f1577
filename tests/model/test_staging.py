"""Loads through host staging (pinned buffers and asynchronous copies on CUDA) give the tokens of
direct loads. No GPU here: ``force_staging`` (``Staging(cpu, force=True)``) runs the same bookkeeping
with ordinary host tensors;
``tests/model/test_adapter.py::test_cuda_matches_cpu`` covers the CUDA path where a GPU is."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.entries import split, with_frame
from helpers.tiny import make_tiny_model
from kvstore.errors import CorruptEntryWarning
from kvstore.model.adapter import Adapter
from kvstore.model.io import staging
from kvstore.store.kvstore import KVStore


def test_staged_loads_answer_as_direct_loads(monkeypatch):
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=6)
    adapter = Adapter(model, tok)
    rng = random.Random(3)
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    contexts = [[rng.choice(vocab) for _ in range(n)] for n in (9, 33, 70, 33)]
    questions = [[rng.choice(vocab) for _ in range(n)] for n in (2, 4, 1, 3)]
    with KVStore("memory://", chunk_tokens=16) as store:
        adapter.generate_kv_cache(contexts, store)
        kw = dict(store=store, stop_at_eos=False, batch_size=4, return_details=True, return_scores=True)
        direct = adapter.greedy_sample(contexts, questions, 6, **kw)
        staged_records = []
        real, real_send = staging.Staging.copy_into, staging.Ring.send

        def counting(self, record, dest):
            staged_records.append(self.active)
            real(self, record, dest)

        def counting_send(self, slot, used, places):  # lossless records go through the ring's slots
            staged_records.append(self.active)
            real_send(self, slot, used, places)

        monkeypatch.setattr(adapter.handle, "force_staging", True)
        monkeypatch.setattr(staging.Staging, "copy_into", counting)
        monkeypatch.setattr(staging.Ring, "send", counting_send)
        staged = adapter.greedy_sample(contexts, questions, 6, **kw)
    assert staged_records and all(staged_records), "the staged path did not run"
    assert all(staged.cache_hit)
    assert torch.equal(staged.tokens, direct.tokens)
    for a, b in zip(staged.scores, direct.scores):
        assert torch.equal(a, b)


CHUNK = 16


def _rows(tok, seed: int = 3):
    rng = random.Random(seed)
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    contexts = [[rng.choice(vocab) for _ in range(n)] for n in (70, 45)]
    questions = [[rng.choice(vocab) for _ in range(n)] for n in (3, 2)]
    return contexts, questions


@pytest.fixture(scope="module")
def tiny():
    model, tok = make_tiny_model("llama", dtype=torch.float32, seed=6)
    return Adapter(model, tok)


def _sample(adapter, contexts, questions, store, **kw):
    kw = dict(store=store, stop_at_eos=False, batch_size=2, return_details=True, return_scores=True) | kw
    return adapter.greedy_sample(contexts, questions, 4, **kw)


def _same(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens)
    for x, y in zip(a.scores, b.scores):
        assert torch.equal(x, y)


@pytest.mark.parametrize(("spec", "piece"), [("raw", None), ("raw", 192), ("zstd-split:1", None), ("zstd:1", None)])
def test_the_ring_is_allocated_once_and_reused_by_every_load(tiny, monkeypatch, spec, piece):
    """Loads take their slots from the handle's ring: the second and third loads allocate nothing
    (same buffers, same addresses), chunks rotate through the slots in chain order, and the
    answers are the direct load's bit for bit. ``piece``: a raw chunk's bytes copied in pieces of
    this many bytes (cut across records, on several threads) instead of the default."""
    if piece is not None:
        monkeypatch.setattr(staging, "PIECE", piece)
        monkeypatch.setattr(staging, "ALIGN", 64)
    contexts, questions = _rows(tiny.tokenizer)
    with KVStore("memory://", codec=spec, chunk_tokens=CHUNK) as store:
        tiny.generate_kv_cache(contexts, store)
        direct = _sample(tiny, contexts, questions, store)
        monkeypatch.setattr(tiny.handle, "force_staging", True)
        sent: list[tuple[int, int]] = []  # (slot's host address, bytes sent)
        real_send = staging.Ring.send

        def spy(self, slot, used, places):
            sent.append((slot.host.data_ptr(), used))
            real_send(self, slot, used, places)

        monkeypatch.setattr(staging.Ring, "send", spy)
        one_by_one: list[int] = []
        real_decode = staging._decode
        monkeypatch.setattr(staging, "_decode", lambda *a: (one_by_one.append(1), real_decode(*a)))
        first = _sample(tiny, contexts, questions, store)
        assert bool(one_by_one) == (spec != "raw"), (
            "raw chunks are copied as runs of bytes, the others record by record"
        )
        ring = staging.Ring.of(tiny.handle, torch.device("cpu"), force=True)
        buffers = [(s.host.data_ptr(), s.device.data_ptr()) for s in ring.slots if s is not None]
        allocations = ring.allocations
        n_chunks = sum(-(-len(c) // CHUNK) for c in contexts)
        assert len(sent) == n_chunks and allocations == min(n_chunks, staging.RING_SLOTS)
        for _ in range(2):
            again = _sample(tiny, contexts, questions, store)
            _same(again, direct)
        assert ring.allocations == allocations, "a later load allocated staging buffers again"
        assert [(s.host.data_ptr(), s.device.data_ptr()) for s in ring.slots if s is not None] == buffers
        assert len(sent) == 3 * n_chunks and {p for p, _ in sent} == {h for h, _ in buffers}
        assert not ring.lock.locked()
    assert all(first.cache_hit)
    _same(first, direct)


def test_a_slot_is_written_again_only_after_its_copies_are_done(tiny, monkeypatch):
    """On CUDA a slot's event says its bytes have crossed; here a stand-in event logs when it is
    waited for: every reuse of a slot waits for its previous send's event before any record
    decodes into it, and chunks are sent in chain order."""
    contexts, questions = _rows(tiny.tokenizer)
    log: list[tuple[str, int]] = []

    class Event:
        def __init__(self, ptr):
            self.ptr = ptr

        def synchronize(self):
            log.append(("waited", self.ptr))

    real_send, real_decode = staging.Ring.send, staging._decode

    def send(self, slot, used, places):
        log.append(("sent", slot.host.data_ptr()))
        real_send(self, slot, used, places)
        slot.done = Event(slot.host.data_ptr())

    def decode(record, host, offset, like):
        log.append(("decoded", host.data_ptr()))
        real_decode(record, host, offset, like)

    with KVStore("memory://", codec="raw", chunk_tokens=CHUNK) as store:
        tiny.generate_kv_cache(contexts, store)
        direct = _sample(tiny, contexts, questions, store)
        monkeypatch.setattr(tiny.handle, "force_staging", True)
        monkeypatch.setattr(staging.Ring, "send", send)
        monkeypatch.setattr(staging, "_decode", decode)
        _same(_sample(tiny, contexts, questions, store), direct)
    state: dict[int, str] = {}  # per slot: "free", "written" (decoded into), "sent"
    for what, ptr in log:
        if what == "decoded":
            assert state.get(ptr, "free") in ("free", "written"), "a slot was written before its copies were done"
            state[ptr] = "written"
        elif what == "sent":
            state[ptr] = "sent"
        else:
            assert state[ptr] == "sent"
            state[ptr] = "free"
    assert sum(1 for w, _ in log if w == "waited") >= 1, "no slot was reused"


@pytest.mark.parametrize("damage", ["checksum", "frame"])
def test_a_chunk_failing_mid_load_makes_its_row_compute_the_rest(tiny, monkeypatch, damage):
    """Chunk 2 of the first context fails (its checksum, or a frame that does not decompress under
    an intact checksum): the staged load sends chunks 0-1 only, the row computes the rest, and the
    answers are those of no store at all, bit for bit."""
    import zstandard

    contexts, questions = _rows(tiny.tokenizer)
    reference = _sample(tiny, contexts, questions, None, use_cache=False)
    with KVStore("memory://", codec="zstd:1", chunk_tokens=CHUNK) as store:
        tiny.generate_kv_cache(contexts, store)
        key = tiny.chain(contexts[0], store).keys[2]
        blob = store.backend.get(b"e/" + key.encode())
        if damage == "checksum":
            bad = bytearray(blob)
            bad[len(bad) // 2] ^= 0xFF
            store.backend.put(b"e/" + key.encode(), bytes(bad))
        else:
            header, payload = split(blob)
            index = len(header["codec"]["frames"]) - 2
            size = header["codec"]["frames"][index][1]
            garbage = zstandard.ZstdCompressor(write_content_size=True).compress(b"\1" * size)
            store.backend.put(b"e/" + key.encode(), with_frame(header, payload, index, garbage[:-4] + bytes(4)))
        monkeypatch.setattr(tiny.handle, "force_staging", True)
        with pytest.warns(CorruptEntryWarning):
            got = _sample(tiny, contexts, questions, store, use_cache=True)
    assert got.cached_tokens[0] == 2 * CHUNK and not got.cache_hit[0] and got.cache_hit[1]
    assert torch.equal(got.tokens, reference.tokens)
    for x, y in zip(got.scores, reference.scores):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)  # prefix + rest vs one forward (float32)


def test_out_of_memory_while_chunks_are_in_flight_halves_the_batch(tiny, monkeypatch):
    """The batch's load runs out of memory after a chunk was sent: the load still orders what it
    queued (``finish`` runs before the error leaves it), releases the ring, and the batch halves;
    the halves answer as direct loads of one row do, from the same staging buffers."""
    contexts, questions = _rows(tiny.tokenizer)
    with KVStore("memory://", codec="zstd-split:1", chunk_tokens=CHUNK) as store:
        tiny.generate_kv_cache(contexts, store)
        direct = _sample(tiny, contexts, questions, store)
        halves = _sample(tiny, contexts, questions, store, batch_size=1)  # the logits depend on the batch's padding
        monkeypatch.setattr(tiny.handle, "force_staging", True)
        _same(_sample(tiny, contexts, questions, store), direct)  # the ring is allocated
        ring = staging.Ring.of(tiny.handle, torch.device("cpu"), force=True)
        buffers, allocations = [s.host.data_ptr() for s in ring.slots if s is not None], ring.allocations
        log: list[str] = []
        real_send, real_finish = staging.Ring.send, staging.Staging.finish

        def send(self, slot, used, places):
            log.append("sent")
            if log.count("sent") == 2 and "oom" not in log:
                log.append("oom")
                real_send(self, slot, used, places[:1])  # part of the chunk queued, then the failure
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            real_send(self, slot, used, places)

        def finish(self):
            log.append("finish")
            real_finish(self)

        monkeypatch.setattr(staging.Ring, "send", send)
        monkeypatch.setattr(staging.Staging, "finish", finish)
        got = _sample(tiny, contexts, questions, store)
    assert "oom" in log and log[log.index("oom") + 1] == "finish", "the failed load did not order its copies"
    assert log.count("finish") == 3, "one failed load, then one per half"
    assert not ring.lock.locked() and ring.allocations == allocations
    assert [s.host.data_ptr() for s in ring.slots if s is not None] == buffers
    assert all(got.cache_hit)
    _same(got, halves)
