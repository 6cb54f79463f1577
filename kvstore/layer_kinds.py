"""The one table of layer kinds: what a layer's cache holds, under the names written on disk.

Every entry header names each layer's ``kind`` (:mod:`kvstore.store.entry`); the model layer
(:mod:`kvstore.model.families`, :mod:`kvstore.model.layout`) and the size estimator
(:mod:`kvstore.size`) use the same names, read from transformers' ``layer_types`` through
:data:`LAYER_TYPES`:

* ``attn``: keys and values of every token (``full_attention``);
* ``sliding`` / ``chunked``: keys and values of the last tokens a window or attention chunk sees;
* ``state``: a recurrent state (Mamba, linear attention, short convolutions), no keys and values;
* ``hybrid``: both (a layer that mixes attention and a state);
* ``none`` (never stored): the layer caches nothing.

Plain data, no imports: the bottom of the library.
"""

from __future__ import annotations

ATTN = "attn"
SLIDING = "sliding"
CHUNKED = "chunked"
STATE = "state"
HYBRID = "hybrid"
NONE = "none"

KINDS = frozenset({ATTN, SLIDING, CHUNKED, STATE, HYBRID})  # the kinds an entry may hold
KV_KINDS = frozenset({ATTN, SLIDING, CHUNKED, HYBRID})  # keep keys and values
STATE_KINDS = frozenset({STATE, HYBRID})  # keep a recurrent state
WINDOWED_KINDS = frozenset({SLIDING, CHUNKED})  # keep only the last tokens a window sees
FULL_KV_KINDS = frozenset({ATTN, HYBRID})  # keep keys and values of every token

# transformers' layer_types -> kind
LAYER_TYPES = {
    "full_attention": ATTN,
    "attention": ATTN,
    "global_attention": ATTN,
    "indexed_attention": ATTN,
    "sliding_attention": SLIDING,
    "local_attention": SLIDING,
    "hybrid_sliding": SLIDING,
    "reference_sliding_attention": SLIDING,
    "chunked_attention": CHUNKED,
    "linear_attention": STATE,
    "mamba": STATE,
    "conv": STATE,
    "hybrid": HYBRID,
    "dummy": NONE,
    "moe": NONE,
    "mlp": NONE,
}
# the layer types kvstore's layout reproduces exactly (tests/model/test_families.py); any other type
# makes a model refused (:func:`kvstore.model.families.refusal`), though its size can be estimated
SERVED_LAYER_TYPES = frozenset(
    {
        "full_attention",
        "attention",
        "global_attention",
        "sliding_attention",
        "local_attention",
        "chunked_attention",
        "linear_attention",
        "mamba",
        "conv",
        "hybrid",
    }
)

# model types whose every layer keeps only a recurrent state (their configs list no layer_types)
STATE_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})
# model types that mix attention and state layers
HYBRID_MODEL_TYPES = frozenset(
    {"jamba", "bamba", "falcon_h1", "zamba", "zamba2", "lfm2", "qwen3_next", "nemotron_h", "granitemoehybrid"}
)
RECURRENT_MODEL_TYPES = STATE_MODEL_TYPES | HYBRID_MODEL_TYPES

__all__ = [
    "ATTN",
    "CHUNKED",
    "FULL_KV_KINDS",
    "HYBRID",
    "HYBRID_MODEL_TYPES",
    "KINDS",
    "KV_KINDS",
    "LAYER_TYPES",
    "NONE",
    "RECURRENT_MODEL_TYPES",
    "SERVED_LAYER_TYPES",
    "SLIDING",
    "STATE",
    "STATE_KINDS",
    "STATE_MODEL_TYPES",
    "WINDOWED_KINDS",
]
