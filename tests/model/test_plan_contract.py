"""The batch plan is the stages' contract: the load reads the chunks the plan expects of the contexts it
needs densely, and reports where it found less; complete computes exactly the rest; a batch whose
every variant reads a stored pressed entry loads and computes no dense cache; an out-of-memory half is
the same plan for fewer rows."""

from __future__ import annotations

import torch

from helpers.rows import random_ids
from helpers.tiny import make_tiny_model
from kvstore.model.adapter import Adapter
from kvstore.model.plan.batch import RowSet, plan_batch
from kvstore.model.stages.complete import complete
from kvstore.model.stages.load import load
from kvstore.model.variants.variant import parse_variant
from kvstore.store.keyspace import entry_key
from kvstore.store.kvstore import KVStore


def _adapter():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=5)
    return Adapter(model, tok)


def test_the_load_reads_the_planned_chunks_and_reports_a_shortfall():
    adapter = _adapter()
    contexts = random_ids(adapter.tokenizer, [70, 45], rng=3)
    with KVStore("memory://", chunk_tokens=16) as store:
        adapter.build(contexts[:1], store)
        chains = tuple(adapter.chain(c, store) for c in contexts)
        rows = RowSet(chains, ((1, 2), (3,)), 2)
        plan = plan_batch([0, 1], rows, store, None)
        assert plan.stored == {chains[0].key: 5, chains[1].key: 0}
        assert plan.load_tokens(chains[0].key) == 70 and plan.compute_tokens(chains[1].key) == 45
        adapter.build(contexts[1:], store)  # stored after the plan: the plan did not expect it, the load reads nothing
        store.backend.delete(entry_key(chains[0].keys[3]))  # gone after the plan: the load finds less
        got = load(adapter.handle, plan, store)
        assert got.tokens == {chains[0].key: 48, chains[1].key: 0}
        assert plan.load_tokens(chains[0].key) - got.tokens[chains[0].key] == 70 - 48  # the shortfall
        done = complete(adapter.handle, plan, got, store, None)
        assert done.computed == (70 - 48) + 45  # exactly what the load did not find


def test_a_batch_read_from_pressed_entries_loads_and_computes_no_dense_cache():
    adapter = _adapter()
    contexts = random_ids(adapter.tokenizer, [60, 44], rng=4)
    with KVStore("memory://", chunk_tokens=16) as store:
        adapter.build(contexts, store, presses=["knorm:0.5"])
        chains = tuple(adapter.chain(c, store) for c in contexts)
        rows = RowSet(chains, ((1,), (2,)), 3)
        pressed = plan_batch([0, 1], rows, store, None, variants=[parse_variant("knorm:0.5")])
        assert pressed.dense == frozenset() and set(pressed.entries("knorm:0.5")) == {c.key for c in chains}
        got = load(adapter.handle, pressed, store)
        assert got.bufs == [] and complete(adapter.handle, pressed, got, store, None).cache is None
        both = plan_batch([0, 1], rows, store, None, variants=[parse_variant("knorm:0.5"), parse_variant("dense")])
        assert both.dense == {c.key for c in chains}  # the dense variant needs them
        other = plan_batch([0, 1], rows, store, None, variants=[parse_variant("knorm:0.25")])
        assert other.dense == {c.key for c in chains} and not other.entries("knorm:0.25")


def test_an_out_of_memory_half_is_the_same_plan_for_fewer_rows():
    adapter = _adapter()
    contexts = random_ids(adapter.tokenizer, [30, 50, 20], rng=5)
    with KVStore("memory://", chunk_tokens=16) as store:
        adapter.build(contexts, store)
        chains = tuple(adapter.chain(c, store) for c in contexts)
        plan = plan_batch([2, 0, 1], RowSet(chains, ((1,), (2, 3), (4,)), 5), store, None)
        half = plan.part([1, 2])
        assert half.rows == (0, 1) and half.contexts == (chains[0], chains[1])
        assert half.slots == 50 + 2 + 5 and set(half.stored) == {chains[0].key, chains[1].key}
        assert half.dense == {chains[0].key, chains[1].key}
