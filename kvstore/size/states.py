"""The recurrent state a state-space or hybrid layer keeps per example, from a model's config.

A Mamba-style layer keeps a convolution window and an SSM state whatever the context's length;
kvstore stores them at every chunk end. Formulas per model type (transformers 5.23), each checked
against the model's own cache in ``tests/model/test_families.py``. Like :mod:`kvstore.size.shapes`, this
imports no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from kvstore import dtypes
from kvstore.facts import LAYER_TYPES, STATE_FORMULA_TYPES, STATE_KINDS


def _lookup(cfg: Any, *names: str) -> Any:
    for name in names:
        value = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
        if value is not None:
            return value
    return None


# how a state tensor's dtype follows the model's: "model" (the convolution window), "float32"
# (Mamba-2 style scans keep float32 in float64 and bfloat16 models), "float32+" (Mamba-1 scans: at
# least float32). Measured on transformers 5.23 (tests/model/test_families.py checks them against the models).
STATE_DTYPES = ("model", "float32", "float32+")


def state_dtype(rule: str, model_dtype: str) -> str:
    """The dtype of a state tensor with dtype ``rule`` in a model running in ``model_dtype``."""
    if rule == "model":
        return model_dtype
    if rule == "float32+":
        return model_dtype if dtypes.bits(model_dtype) > 32 else "float32"
    return rule


def _mamba2_state(d_inner: int, groups: int, d_state: int, heads: int, head_dim: int, kernel: int) -> list:
    return [((d_inner + 2 * groups * d_state) * kernel, "model"), (heads * head_dim * d_state, "float32")]


def layer_state(cfg: Any, model_type: str) -> list[tuple[int, str]] | None:
    """Per example, the state tensors of one recurrent layer (elements, dtype rule), from the
    config, or None when kvstore has no formula for this model type."""
    get = functools.partial(_lookup, cfg)
    hidden = get("hidden_size", "d_model")
    if model_type in ("mamba", "jamba"):
        if model_type == "jamba":
            d_inner, d_state, kernel = get("mamba_expand") * hidden, get("mamba_d_state"), get("mamba_d_conv")
        else:
            d_inner = get("intermediate_size") or get("expand") * hidden
            d_state, kernel = get("state_size"), get("conv_kernel")
        return [(d_inner * kernel, "model"), (d_inner * d_state, "float32+")]
    if model_type == "mamba2":
        heads, head_dim = get("num_heads"), get("head_dim")
        return _mamba2_state(heads * head_dim, get("n_groups"), get("state_size"), heads, head_dim, get("conv_kernel"))
    if model_type in ("bamba", "falcon_h1"):
        heads, head_dim = get("mamba_n_heads"), get("mamba_d_head")
        d_inner = get("mamba_d_ssm") or heads * head_dim
        return _mamba2_state(d_inner, get("mamba_n_groups"), get("mamba_d_state"), heads, head_dim, get("mamba_d_conv"))
    if model_type == "lfm2":
        return [(hidden * get("conv_L_cache"), "model")]
    if model_type == "qwen3_next":
        k_heads, v_heads = get("linear_num_key_heads"), get("linear_num_value_heads")
        k_dim, v_dim = get("linear_key_head_dim"), get("linear_value_head_dim")
        conv = (2 * k_heads * k_dim + v_heads * v_dim) * get("linear_conv_kernel_dim")
        return [(conv, "model"), (v_heads * k_dim * v_dim, "float32")]
    return None


def model_state(cfg: Any, model_type: str, layer_types: Sequence[str] | None) -> tuple[tuple[int, str], ...]:
    """Per example, every state tensor of the model's recurrent layers as ``(elements, dtype
    rule)``; empty for a model without them or without a formula here."""
    if model_type not in STATE_FORMULA_TYPES or not layer_types:
        return ()
    per_layer = layer_state(cfg, model_type) or []
    return tuple(t for kind in layer_types if LAYER_TYPES.get(kind) in STATE_KINDS for t in per_layer)


__all__ = ["STATE_DTYPES", "layer_state", "model_state", "state_dtype"]
