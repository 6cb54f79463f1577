"""Cache paths: one strategy per way a cache is stored, chosen once from the model's layout, and
the features each offers (the orchestration asks the path instead of branching on the model)."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny import make_family_model, make_tiny_model
from kvstore.errors import ModelError
from kvstore.model.adapter import Adapter
from kvstore.model.paths.base import FEATURES, CachePath
from kvstore.model.paths.choice import path_of
from kvstore.model.paths.dense import DENSE_PATH
from kvstore.model.paths.families import FAMILIES_PATH
from kvstore.store.kvstore import KVStore


def test_the_path_is_chosen_from_the_layout():
    assert path_of(Adapter(*make_tiny_model("llama")).handle) is DENSE_PATH
    for family in ("mistral", "mamba"):
        assert path_of(Adapter(*make_family_model(family, attn_implementation=None)).handle) is FAMILIES_PATH


def test_features_are_data():
    assert DENSE_PATH.features == frozenset(FEATURES)
    assert not FAMILIES_PATH.features
    with pytest.raises(ValueError, match="unknown cache-path feature"):
        DENSE_PATH.supports("telepathy")


def test_paths_implement_one_interface():
    assert isinstance(DENSE_PATH, CachePath) and isinstance(FAMILIES_PATH, CachePath)
    with pytest.raises(TypeError):
        type("Partial", (CachePath,), {})()  # every method of the interface must be there


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
