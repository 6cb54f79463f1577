"""The grouped-KV hook: kvstore's CPU forwards with a mask attend to grouped KV heads in place
(no repeat_kv copy of the cache), with the same logits; other threads and plain calls are unchanged."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.integrations import sdpa_attention

from helpers.tiny import make_tiny_model
from kvstore.model.adapter import Adapter
from kvstore.model.compute.attention import grouped_kv


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = sdpa_attention.repeat_kv

    def repeat_kv(hidden, n_rep):
        if n_rep > 1:
            calls.append(threading.get_ident())
        return real(hidden, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", repeat_kv)
    return calls


def _masked_forward(model):
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    return model(input_ids=ids, attention_mask=mask).logits


def test_masked_steps_skip_repeat_kv_with_the_same_logits(counted):
    model, tok = make_tiny_model("llama", dtype=torch.float32, seed=2)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped
    with torch.inference_mode():
        plain = _masked_forward(model)
        assert counted, "transformers repeats the KV heads when given a mask"
        counted.clear()
        with grouped_kv():
            grouped = _masked_forward(model)
        assert not counted
        after = _masked_forward(model)
    assert counted, "the hook is off again after the block"
    assert torch.equal(plain, grouped) and torch.equal(plain, after)


def test_greedy_sample_and_build_use_it(counted, tmp_path):
    from kvstore.store.kvstore import KVStore

    model, tok = make_tiny_model("llama", dtype=torch.float32, seed=2)
    adapter = Adapter(model, tok)
    contexts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    with KVStore(str(tmp_path / "s")) as store:
        adapter.generate_kv_cache(contexts, store)
        adapter.greedy_sample(contexts, [[4, 5], [6]], 3, store=store)
    assert not counted


def test_other_threads_are_unaffected(counted):
    model, _ = make_tiny_model("llama", dtype=torch.float32, seed=2)
    seen = []

    def other():
        with torch.inference_mode():
            _masked_forward(model)
        seen.append(threading.get_ident())

    with grouped_kv():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen and seen[0] in counted
