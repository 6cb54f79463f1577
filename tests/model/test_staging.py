"""Loads through host staging (pinned buffers and asynchronous copies on CUDA) give the tokens of
direct loads. No GPU here: ``force_staging`` (``Staging(cpu, force=True)``) runs the same bookkeeping
with ordinary host tensors;
``tests/model/test_adapter.py::test_cuda_matches_cpu`` covers the CUDA path where a GPU is."""

from __future__ import annotations

import random

import torch

from helpers.tiny import make_tiny_model
from kvstore.model.adapter import Adapter
from kvstore.model.compute import staging
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
        real, real_region = staging.Staging.copy_into, staging.Region.copy_into

        def counting(self, record, dest):
            staged_records.append(self.active)
            real(self, record, dest)

        def counting_region(self, record, start, end):  # lossless records go through regions
            staged_records.append(self.staging.active)
            real_region(self, record, start, end)

        monkeypatch.setattr(adapter.handle, "force_staging", True)
        monkeypatch.setattr(staging.Staging, "copy_into", counting)
        monkeypatch.setattr(staging.Region, "copy_into", counting_region)
        staged = adapter.greedy_sample(contexts, questions, 6, **kw)
    assert staged_records and all(staged_records), "the staged path did not run"
    assert all(staged.cache_hit)
    assert torch.equal(staged.tokens, direct.tokens)
    for a, b in zip(staged.scores, direct.scores):
        assert torch.equal(a, b)
