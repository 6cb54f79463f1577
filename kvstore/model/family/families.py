"""Which cache family a model belongs to, and whether kvstore can reuse its caches exactly.

kvstore stores a context's cache and continues from it in a batched, left-padded layout with
explicit positions. That is exact only when attention sees positions the way kvstore lays them out.
:func:`describe` reads a model's config into a :class:`Family`: per layer, what its cache holds
(``attn``: full attention KV, a ``sliding`` or ``chunked`` window, a recurrent ``state``, or a
``hybrid`` of attention and state: the names written on disk, from :mod:`kvstore.facts`),
plus the features that change how attention sees positions.
:func:`refusal` names, in one line, why a model cannot be served exactly; the Adapter refuses such
models at build and sample time rather than answer wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.facts import (
    ATTN,
    CHUNKED,
    HYBRID,
    HYBRID_MODEL_TYPES,
    KINDS,
    LAYER_TYPES,
    POSITION_MASK_ATTN,
    SERVED_LAYER_TYPES,
    SLIDING,
    STATE,
    STATE_KINDS,
    STATE_MODEL_TYPES,
    STATE_REFUSALS,
    VERIFIED_STATE_TYPES,
    VERIFIED_WINDOWED_TYPES,
    WINDOWED_KINDS,
)


@dataclass(frozen=True)
class Family:
    """What a model's cache looks like. ``kinds``: one per layer (``attn``, ``sliding``,
    ``chunked``, ``state``, ``hybrid``); ``window``: the sliding window (tokens a query sees,
    itself included) or attention chunk size, when a layer uses one; ``problems``: features that
    make kvstore's layout inexact, each a short phrase."""

    model_type: str
    kinds: tuple[str, ...]
    window: int | None = None
    problems: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        kinds = set(self.kinds)
        if kinds <= {ATTN}:
            return "dense attention"
        if kinds <= {ATTN, SLIDING, CHUNKED}:
            return "sliding-window attention" if SLIDING in kinds else "chunked attention"
        if kinds <= {STATE}:
            return "state-space"
        return "hybrid attention + state-space"


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def text_config(config: Any) -> Any:
    """The decoder's config of a composite (vision-language) config, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def describe(config: Any) -> Family:
    """The :class:`Family` of a model from its (transformers) config."""
    cfg = text_config(config)
    model_type = str(_get(cfg, "model_type", "") or "")
    n_layers = int(_get(cfg, "num_hidden_layers", 0) or _get(cfg, "n_layer", 0) or 0)
    layer_types = _get(cfg, "layer_types")
    sliding = _get(cfg, "sliding_window")
    if _get(cfg, "use_sliding_window") is False:  # Qwen2 family: configured but off
        sliding = None
    chunk = _get(cfg, "attention_chunk_size")
    problems: list[str] = []
    if layer_types:
        kinds = tuple(LAYER_TYPES[str(t)] if str(t) in SERVED_LAYER_TYPES else f"unknown:{t}" for t in layer_types)
    elif model_type in STATE_MODEL_TYPES:
        kinds = (STATE,) * n_layers
    elif sliding:
        kinds = (SLIDING,) * n_layers
    elif chunk:
        kinds = (CHUNKED,) * n_layers
    else:
        kinds = (ATTN,) * n_layers
    if model_type in HYBRID_MODEL_TYPES and set(kinds) <= {ATTN}:
        kinds = (HYBRID,) * n_layers  # a hybrid whose config names no layer types
    window = int(sliding) if sliding and SLIDING in kinds else (int(chunk) if chunk and CHUNKED in kinds else None)
    rope = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") if isinstance(rope, Mapping) else None
    if rope_type in ("dynamic", "longrope"):
        problems.append(f"{rope_type} RoPE picks its frequencies from the longest position of each forward pass")
    attn_config = _get(cfg, "attn_config")
    if model_type == "mpt" and _get(attn_config, "alibi", True):
        problems.append("MPT's ALiBi biases count cache slots, not positions")
    if _get(cfg, "use_bidirectional_attention") or _get(cfg, "is_causal") is False:
        problems.append("bidirectional attention has no prefix property")
    if _get(cfg, "num_kv_shared_layers") or any(k.startswith("unknown:") for k in kinds):
        problems.append("layers that share or lack a KV cache")
    if _get(cfg, "is_encoder_decoder"):
        problems.append(
            "an encoder-decoder model encodes the question together with the context bidirectionally (no prefix to "
            "reuse)"
        )
    if _get(cfg, "attn_temperature_tuning"):
        problems.append("attention temperature tuning scales queries by the cache length")
    return Family(model_type=model_type, kinds=kinds, window=window, problems=tuple(problems))


def refusal(config: Any, supported: frozenset[str] = KINDS) -> str | None:
    """Why kvstore cannot reuse this model's caches exactly (one line), or None when it can."""
    family = describe(config)
    what = family.model_type or "this model"
    if family.problems:
        return f"{what}: {family.problems[0]}, so cached answers would differ from the model's own; kvstore refuses it"
    kinds = set(family.kinds)
    unsupported = sorted(kinds - supported)
    if unsupported:
        detail = f" (window {family.window})" if family.window and WINDOWED_KINDS & set(unsupported) else ""
        return (
            f"{what} is a {family.name} model{detail}; kvstore does not store and reuse "
            f"{'/'.join(unsupported)} layers exactly, so it refuses it rather than answer wrongly"
        )
    cfg = text_config(config)
    # the model's own type: a vision-language wrapper around a verified decoder is not verified itself
    top = str(_get(config, "model_type", "") or "")
    if kinds & STATE_KINDS:
        if family.model_type in STATE_REFUSALS:
            return f"{what}: {STATE_REFUSALS[family.model_type]}; kvstore refuses it rather than answer wrongly"
        limit = _get(cfg, "time_step_limit")
        if limit is not None and tuple(float(x) for x in limit) != (0.0, float("inf")):
            return (
                f"{what}: its Mamba-2 layers limit dt to {tuple(limit)} when reading a prompt but not one token at a "
                "time, so a question continued from a stored state differs from the model's own run; kvstore refuses it"
            )
        if top not in VERIFIED_STATE_TYPES:
            return (
                f"{top or what} is a {family.name} model whose stored states kvstore has not verified exact; it "
                "refuses it rather than answer wrongly"
            )
    elif kinds & WINDOWED_KINDS and top not in VERIFIED_WINDOWED_TYPES:
        return (
            f"{top or what} is a {family.name} model kvstore has not verified exact with its position masks; it "
            "refuses it rather than answer wrongly"
        )
    attn = str(_get(config, "_attn_implementation", None) or "eager")
    if kinds - {ATTN, STATE} or (ATTN in kinds and STATE in kinds):
        if attn not in POSITION_MASK_ATTN:
            return (
                f"{what}: kvstore masks its {family.name} layers by position, which {attn} attention does not take; "
                "load it with sdpa or eager attention"
            )
    return None


__all__ = [
    "Family",
    "describe",
    "refusal",
    "text_config",
]
