"""Cache paths: one strategy per way a cache is stored, chosen once from the model's layout, and
the features each offers (the orchestration asks the path instead of branching on the model)."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny import make_family_model, make_tiny_model
from kvstore.errors import ModelError
from kvstore.model.adapter import Adapter
from kvstore.model.paths import base as paths
from kvstore.store.kvstore import KVStore


def test_the_path_is_chosen_from_the_layout():
    assert Adapter(*make_tiny_model("llama")).path is paths.DENSE
    for family in ("mistral", "mamba"):
        assert Adapter(*make_family_model(family, attn_implementation=None)).path is paths.FAMILIES


def test_features_are_data():
    assert paths.DENSE.features == frozenset(paths.FEATURES)
    assert not paths.FAMILIES.features
    with pytest.raises(ValueError, match="unknown cache-path feature"):
        paths.DENSE.supports("telepathy")


def test_a_family_model_is_refused_what_its_path_lacks(tmp_path):
    adapter = Adapter(*make_family_model("mistral", dtype=torch.float64))
    with KVStore(str(tmp_path / "s"), codec="int8") as store, pytest.raises(ModelError, match="lossy codec"):
        adapter.build([[5, 6, 7, 8]], store)
    with pytest.raises(ModelError, match="full-attention keys"):
        adapter.prefill([[5, 6, 7]])
    with pytest.raises(ModelError):
        adapter.sample([[5, 6, 7]], [[8]], num_new_tokens=2, decode_attention="topk:2")
    with pytest.raises(ModelError, match="use_cache=False"):
        adapter.score([[5, 6, 7]], [[8]])
