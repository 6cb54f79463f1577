"""One table of model-family facts (kvstore.facts): the model layer, the size estimator and the
entry format name a layer's cache the same way, with the names written on disk."""

from __future__ import annotations

import pytest

from kvstore import facts as lk
from kvstore.model.family import families
from kvstore.size.shapes import shape_from_config
from kvstore.store.header import LayerSpec


def test_table_is_consistent():
    assert set(lk.LAYER_TYPES.values()) <= lk.KINDS | {lk.NONE}
    assert lk.SERVED_LAYER_TYPES <= set(lk.LAYER_TYPES)
    assert lk.NONE not in {lk.LAYER_TYPES[t] for t in lk.SERVED_LAYER_TYPES}
    assert lk.KV_KINDS | lk.STATE_KINDS == lk.KINDS
    assert lk.FULL_KV_KINDS | lk.WINDOWED_KINDS == lk.KV_KINDS
    assert lk.STATE_FORMULA_TYPES <= lk.RECURRENT_MODEL_TYPES  # the estimator knows no other recurrent set


@pytest.mark.parametrize(
    ("config", "kinds"),
    [
        ({"model_type": "llama", "num_hidden_layers": 2}, ("attn", "attn")),
        ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8}, ("sliding", "sliding")),
        ({"model_type": "mamba", "num_hidden_layers": 2}, ("state", "state")),
        ({"model_type": "jamba", "num_hidden_layers": 2}, ("hybrid", "hybrid")),
        (
            {
                "model_type": "gemma3_text",
                "num_hidden_layers": 2,
                "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            ("sliding", "attn"),
        ),  # fmt: skip
    ],
)
def test_families_speak_the_on_disk_names(config, kinds):
    family = families.describe(config)
    assert family.kinds == kinds
    for kind in set(kinds):  # every kind a family names is one an entry header may hold
        window = 4 if kind in lk.WINDOWED_KINDS else None
        state = (("conv", (2,), "float32"),) if kind in lk.STATE_KINDS else ()
        assert LayerSpec(kind, 1, 1, 1, window, state).record()["kind"] == kind


def test_unserved_layer_types_are_refused_but_sized():
    config = {
        "model_type": "x", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
        "layer_types": ["indexed_attention", "full_attention"],
    }  # fmt: skip
    assert families.describe(config).kinds[0] == "unknown:indexed_attention"
    assert families.refusal(config) is not None
    assert shape_from_config(config).windows is None  # both layers cache every token
