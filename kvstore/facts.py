"""The one table of layer kinds: what a layer's cache holds, under the names written on disk.

Every entry header names each layer's ``kind`` (:mod:`kvstore.store.entry`); the model layer
(:mod:`kvstore.model.family.families`, :mod:`kvstore.model.family.layout`) and the size estimator
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
# makes a model refused (:func:`kvstore.model.family.families.refusal`), though its size can be estimated
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
# Mamba-1 mixers (Mamba, Jamba) start every multi-token scan from a zero state: after a stored
# state they must be fed one token at a time (measured: a multi-token question gets 0/3 rows right)
SINGLE_STEP_TYPES = frozenset({"mamba", "falcon_mamba", "jamba"})
# the recurrent model types kvstore.size has a state-size formula for
STATE_FORMULA_TYPES = frozenset({"mamba", "jamba", "mamba2", "bamba", "falcon_h1", "lfm2", "qwen3_next"})
# a linear-attention cache layer's tensors as named in an entry: conv_states[0], recurrent_states[0]
STATE_NAMES = ("conv", "recurrent")

# windowed, state-space and hybrid families measured exact against per-row generate
# (tests/model/test_families.py); the others are refused until they are: a model may build its masks
# its own way, use the cache length, or its mixer may treat a stored state differently
VERIFIED_WINDOWED_TYPES = frozenset(
    {"mistral", "mixtral", "qwen2", "qwen3", "starcoder2", "cohere2", "gemma2", "gemma3_text", "gpt_oss", "llama4_text"}
)
VERIFIED_STATE_TYPES = frozenset({"mamba", "mamba2", "bamba", "lfm2", "qwen3_next", "jamba", "falcon_h1"})
# recurrent model types refused, and why (one phrase each)
STATE_REFUSALS = {
    "zamba2": "its Mamba-2 layers clamp dt to time_step_min when reading a prompt but not one token at a time, so "
    "a question continued from a stored state differs from the model's own run",
    "nemotron_h": "its Mamba-2 layers limit dt (time_step_limit) when reading a prompt but not one token at a time, "
    "so a question continued from a stored state differs from the model's own run",
}
# windowed and hybrid layers get 4-D masks built from positions; these attention implementations take them
POSITION_MASK_ATTN = frozenset({"sdpa", "eager"})
# transformers' mask names for each kind of attention layer, and for recurrent layers
MASK_KEYS = {ATTN: "full_attention", SLIDING: "sliding_attention", CHUNKED: "chunked_attention"}
STATE_MASK_KEYS = ("linear_attention", "conv")

# rotary layouts: model types whose every layer applies rotate_half to the first R channels (the
# pre-rotation codecs undo it), and the RoPE types whose frequencies are fixed at load time
ROTATE_HALF_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gpt_neox", "olmo", "olmo2", "granite", "phi3", "starcoder2"}
)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

__all__ = [
    "ATTN",
    "CHUNKED",
    "MASK_KEYS",
    "POSITION_MASK_ATTN",
    "ROTATE_HALF_TYPES",
    "SINGLE_STEP_TYPES",
    "STATE_FORMULA_TYPES",
    "STATE_MASK_KEYS",
    "STATE_NAMES",
    "STATE_REFUSALS",
    "STATIC_ROPE_TYPES",
    "VERIFIED_STATE_TYPES",
    "VERIFIED_WINDOWED_TYPES",
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
