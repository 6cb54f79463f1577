"""Stop strings, a token budget per batch, and out-of-memory batches run again as halves: none of
them changes a row's tokens (beyond cutting them at the stop)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from helpers.cli import read_predictions, run_main, write_dataset
from helpers.rows import random_rows
from helpers.tiny import make_tiny_model
from kvstore.model.adapter import Adapter
from kvstore.model.compute.forward import is_out_of_memory
from kvstore.model.paths.dense import DensePath
from kvstore.model.pipelines import sample as sampling
from kvstore.store.kvstore import KVStore

N_NEW = 8


@pytest.fixture(scope="module")
def llama():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=4)
    return Adapter(model, tok)


def _sample(adapter, contexts, questions, **kw):
    return adapter.greedy_sample(contexts, questions, N_NEW, stop_at_eos=False, return_details=True, **kw)


@pytest.mark.parametrize("use_cache", [True, False])
def test_stop_strings_cut_each_row_where_its_text_first_contains_one(llama, tmp_path, use_cache):
    contexts, questions = random_rows(llama.tokenizer, 7, 0)
    full = _sample(llama, contexts, questions, use_cache=False)
    texts = [llama.tokenizer.decode(row[2:3].tolist()) for row in full.tokens]
    stops = [t for t in texts if t.strip()][:2]  # pieces some rows produce at their third token
    assert stops
    with KVStore(str(tmp_path / "s")) as store:
        got = _sample(llama, contexts, questions, use_cache=use_cache, store=store, stop_strings=stops, batch_size=3)
    cut_somewhere = 0
    for r, row in enumerate(full.tokens.tolist()):
        end = next(
            (j + 1 for j in range(N_NEW) if any(s in llama.tokenizer.decode(row[: j + 1]) for s in stops)), N_NEW
        )
        cut_somewhere += end < N_NEW
        assert got.lengths[r] == end
        assert got.tokens[r, :end].tolist() == row[:end]
        assert (got.tokens[r, end:] == llama.pad_id).all()
    assert cut_somewhere >= 1


def test_out_of_memory_runs_the_batch_again_as_halves(llama, tmp_path, monkeypatch):
    contexts, questions = random_rows(llama.tokenizer, 8, 1)
    with KVStore(str(tmp_path / "a")) as store:
        want = _sample(llama, contexts, questions, store=store, batch_size=8)
    real, sizes = DensePath.prepare, []

    def tight(self, handle, plan, work, loaded):
        sizes.append(len(plan.rows))
        if len(plan.rows) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(self, handle, plan, work, loaded)

    monkeypatch.setattr(DensePath, "prepare", tight)
    with KVStore(str(tmp_path / "b")) as store:
        got = _sample(llama, contexts, questions, store=store, batch_size=8)
    assert sizes == [8, 4, 2, 2, 4, 2, 2]  # halved until it fits, every row once
    assert torch.equal(got.tokens, want.tokens) and got.cache_hit == want.cache_hit

    def broken(self, handle, plan, work, loaded):
        raise RuntimeError("something else")

    monkeypatch.setattr(DensePath, "prepare", broken)
    with KVStore(str(tmp_path / "c")) as store, pytest.raises(RuntimeError, match="something else"):
        _sample(llama, contexts, questions, store=store)


def test_cpu_allocator_failure_counts_as_out_of_memory():
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate "
            "8 bytes."
        )
    )
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_max_batch_tokens_bounds_each_batch(llama, tmp_path, monkeypatch):
    contexts, questions = random_rows(llama.tokenizer, 8, 2)
    want = _sample(llama, contexts, questions, use_cache=False, batch_size=8)
    real, batches = DensePath.reference, []

    def spy(self, handle, plan, work):
        longest = max(c.n_tokens + len(q) for c, q in zip(plan.contexts, plan.fed))
        batches.append(len(plan.rows) * (longest + work.decoding.new_tokens))
        return real(self, handle, plan, work)

    monkeypatch.setattr(DensePath, "reference", spy)
    got = _sample(llama, contexts, questions, use_cache=False, batch_size=8, max_batch_tokens=80)
    assert len(batches) > 1 and max(batches) <= 80
    assert torch.equal(got.tokens, want.tokens)


def test_cli_stop(tiny_llama_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "d.jsonl", range(3))
    base = ["--model", tiny_llama_dir, "--store", tmp_path / "s", "--quiet", "--format", "json", "-n", "12"]

    def sample(*extra):
        out = tmp_path / f"o{len(list(tmp_path.glob('o*')))}.jsonl"
        code, _, err = run_main(capsys, "sample", data, *base, "-o", out, *extra)
        assert code == 0, err
        return read_predictions(out)

    plain = sample()
    stop = next(r["raw_output"][2:4] for r in plain.values() if len(r["raw_output"].strip()) > 4)
    cut = sample("--stop", stop, "--max-batch-tokens", "200")
    for key, row in plain.items():
        assert row["raw_output"].startswith(cut[key]["raw_output"])
        if stop in row["raw_output"]:
            assert stop in cut[key]["raw_output"] and len(cut[key]["raw_output"]) < len(row["raw_output"]) + 1
    assert any(stop in r["raw_output"] and len(cut[k]["raw_output"]) < len(r["raw_output"]) for k, r in plain.items())
    assert json.loads(json.dumps(cut))  # rows stay JSON


def test_next_batch_loads_on_a_worker_while_this_one_decodes(llama, tmp_path, monkeypatch):
    """With a store and several batches, the batches after the first are planned once the batch
    before is complete and loaded by the loader thread, and their loads handed to the path; the
    tokens are those of one batch."""
    contexts, questions = random_rows(llama.tokenizer, 7, 5)
    with KVStore(str(tmp_path / "s")) as store:
        llama.generate_kv_cache(contexts, store)
        want = _sample(llama, contexts, questions, store=store, batch_size=8)
        loads, handed = [], []
        real_load, real_prepare = sampling.load, DensePath.prepare

        def load(handle, plan, *args):
            loads.append((threading.current_thread().name, len(plan.rows)))
            return real_load(handle, plan, *args)

        def prepare(self, handle, plan, work, loaded):
            handed.append(loaded is not None and len(loaded.bufs[0][0]) == len(plan.rows))
            return real_prepare(self, handle, plan, work, loaded)

        monkeypatch.setattr(sampling, "load", load)
        monkeypatch.setattr(DensePath, "prepare", prepare)
        got = _sample(llama, contexts, questions, store=store, batch_size=3)
    assert [n for _, n in loads] == [3, 1] and all(name.startswith("kvstore-load") for name, _ in loads)
    assert handed == [False, True, True]  # the first batch loads itself
    assert torch.equal(got.tokens, want.tokens) and all(got.cache_hit)


def test_out_of_memory_with_batches_loaded_ahead(llama, tmp_path, monkeypatch):
    """Two batches, each loaded ahead on the worker, each too big: each runs again as halves that
    load themselves, and every row gets its tokens."""
    contexts, questions = random_rows(llama.tokenizer, 8, 6)
    with KVStore(str(tmp_path / "s")) as store:
        llama.generate_kv_cache(contexts, store)
        want = _sample(llama, contexts, questions, store=store, batch_size=8)
        real, calls = DensePath.prepare, []

        def tight(self, handle, plan, work, loaded):
            calls.append((len(plan.rows), loaded is not None))
            if len(plan.rows) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return real(self, handle, plan, work, loaded)

        monkeypatch.setattr(DensePath, "prepare", tight)
        got = _sample(llama, contexts, questions, store=store, batch_size=4)
    assert calls == [(4, False), (2, False), (2, False), (4, True), (2, False), (2, False)]
    assert torch.equal(got.tokens, want.tokens) and all(got.cache_hit)
