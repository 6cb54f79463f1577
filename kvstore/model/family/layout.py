"""What each layer of a model keeps for later tokens, and how kvstore hands it back to the model.

A :class:`CacheLayout` has one :class:`LayerLayout` per layer, in the entry format's terms
(``kvstore.store.entry``):

* ``attn``: keys and values of every token (full attention);
* ``sliding`` (window ``W``: a query sees itself and the ``W - 1`` positions before it): of a chunk
  ending at position ``e``, only its last ``min(n, W - 1)`` tokens, the ones a later token can
  still see. Chained chunks then hold every position a continuation at any chunk boundary needs:
  a query at ``p >= e`` sees ``p - W + 1 .. p``, and each chunk keeps its own share of the
  ``W - 1`` positions before its end;
* ``chunked`` (attention chunk ``C``: a query sees the positions of its own chunk of ``C``): of a
  chunk ending at ``e``, its last ``min(n, e mod C)`` tokens (positions ``C * (e // C) ..``);
* ``state``: a recurrent state at the chunk's end (``conv`` and ``recurrent`` tensors, each in its
  own dtype: Mamba-2 style states stay float32 in float64 and bfloat16 models);
* ``hybrid``: both keys/values of every token and a state (FalconH1: attention and Mamba-2 side
  by side in one layer).

:func:`cache_layout` reads the kinds from the config (:mod:`kvstore.model.family.families`) and the
shapes and dtypes from one probe forward. Dense models (every layer ``attn``) take kvstore's
original path (2-D masks) and need no probe. The others are decoded with 4-D masks built from
positions (:mod:`kvstore.model.compute.masks`); ``mask_dict`` says whether the model gets one mask per
layer type (``{"full_attention": ..., "sliding_attention": ...}``) or one tensor.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import ModelError
from kvstore.facts import (
    ATTN,
    CHUNKED,
    FULL_KV_KINDS,
    KV_KINDS,
    MASK_KEYS,
    SINGLE_STEP_TYPES,
    SLIDING,
    STATE_KINDS,
    STATE_NAMES,
    WINDOWED_KINDS,
)
from kvstore.model.family import families
from kvstore.store.header import LayerSpec

KVShape = tuple[int, int, int]  # (kv_heads, key head_dim, value head_dim) of one layer
LayerKV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values) [kv_heads, n, head_dim]


@dataclass(frozen=True)
class LayerLayout:
    """One layer: its entry ``kind``, ``window`` (sliding window or attention chunk size),
    ``kv_heads`` / ``head_dim`` of its keys and values, and its per-row ``state`` tensors as
    ``(name, shape, dtype name)``."""

    kind: str = ATTN
    window: int | None = None
    kv_heads: int = 0
    head_dim: int = 0
    state: tuple[tuple[str, tuple[int, ...], str], ...] = ()

    @property
    def has_kv(self) -> bool:
        return self.kind in KV_KINDS

    @property
    def has_state(self) -> bool:
        return self.kind in STATE_KINDS

    @property
    def group(self) -> str | None:
        """The position mask this layer reads (``attn``, ``sliding:W``, ``chunked:C``), or None."""
        if not self.has_kv:
            return None
        return ATTN if self.kind in FULL_KV_KINDS else f"{self.kind}:{self.window}"

    def keep(self, start: int, end: int) -> int:
        """How many of the last tokens of positions ``[start, end)`` this layer keeps keys and
        values for (what a token at ``end`` or later can still attend to)."""
        n = end - start
        if self.kind in FULL_KV_KINDS:
            return n
        if self.kind == SLIDING:
            assert self.window is not None
            return min(n, self.window - 1)
        if self.kind == CHUNKED:
            assert self.window is not None
            return min(n, end % self.window)
        return 0

    def spec(self, start: int, end: int) -> LayerSpec:
        """The header record of a chunk covering ``[start, end)`` of this layer."""
        window = self.window if self.kind in WINDOWED_KINDS else None
        return LayerSpec(self.kind, self.keep(start, end), self.kv_heads, self.head_dim, window, self.state)


@dataclass(frozen=True)
class CacheLayout:
    """How a model's cache is stored and handed back (see the module docstring).

    ``dense``: every layer ``attn`` (kvstore's original path); ``mask_dict``: the model takes
    ``{layer_type: mask}``; ``cache_arg``: the forward's cache keyword
    (:func:`cache_keyword`); ``single_step``: after a stored state the mixer must see one token per
    forward; ``attn``: the attention implementation (masks are bool for sdpa, additive for eager)."""

    layers: tuple[LayerLayout, ...]
    dense: bool = True
    mask_dict: bool = False
    cache_arg: str = "past_key_values"
    single_step: bool = False
    attn: str = "sdpa"

    @property
    def has_state(self) -> bool:
        return any(layer.has_state for layer in self.layers)

    @property
    def has_kv(self) -> bool:
        return any(layer.has_kv for layer in self.layers)

    @property
    def groups(self) -> dict[str, LayerLayout]:
        """Each position-mask group (``attn``, ``sliding:W``...) and a layer of it, in layer order."""
        out: dict[str, LayerLayout] = {}
        for layer in self.layers:
            if layer.group is not None:
                out.setdefault(layer.group, layer)
        return out

    def specs(self, start: int, end: int) -> tuple[LayerSpec, ...]:
        """Every layer's header record for a chunk covering positions ``[start, end)``."""
        return tuple(layer.spec(start, end) for layer in self.layers)


def _takes_mask_dict(model: Any) -> bool:
    """Whether the model's decoder accepts ``{layer_type: 4-D mask}`` (transformers' own check
    in every model whose layers mix attention kinds)."""
    for module in (model, *model.children()):  # the decoder is the causal LM's first child
        try:
            source = inspect.getsource(inspect.unwrap(type(module).forward))
        except (OSError, TypeError):
            continue
        if "isinstance(causal_mask_mapping := attention_mask, dict)" in source:
            return True
    return False


def _window(cfg: Any, kind: str) -> int | None:
    name = {SLIDING: "sliding_window", CHUNKED: "attention_chunk_size"}.get(kind)
    if name is None:
        return None
    window = getattr(cfg, name, None)
    if not isinstance(window, int) or window < 1:
        raise ModelError(f"{cfg.model_type}: {kind} layers but no {name} in its config; kvstore cannot lay them out")
    return window


def cache_keyword(model: Any) -> str:
    """The keyword ``model.forward`` takes its cache under: ``cache`` from transformers 5.24 (which
    warns on ``past_key_values``, and whose Mamba ignores a cache given under an older name),
    ``cache_params`` for Mamba and Mamba-2 before it, else ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "cache_params" in params and "past_key_values" not in params:
        return "cache_params"
    return "past_key_values"


@torch.inference_mode()
def cache_layout(model: Any, pad_id: int = 0) -> CacheLayout:
    """The :class:`CacheLayout` of a loaded model. Dense models are read from the config alone;
    the others run one one-token forward to read each layer's key/value and state shapes.
    Raises ModelError when the model's cache does not look like its config says."""
    config = model.config
    family = families.describe(config)
    cfg = families.text_config(config)
    kinds = list(family.kinds)
    attn = str(getattr(config, "_attn_implementation", None) or "eager")
    if set(kinds) <= {ATTN}:
        return CacheLayout(tuple(LayerLayout(ATTN) for _ in kinds), attn=attn, cache_arg=cache_keyword(model))
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([[pad_id]], device=device), use_cache=True)
    cache = next((c for c in (getattr(out, n, None) for n in ("cache", "past_key_values", "cache_params")) if c), None)
    cache_layers = list(getattr(cache, "layers", None) or [])
    what = family.model_type or type(model).__name__
    if len(cache_layers) != len(kinds):
        raise ModelError(f"{what}: its cache has {len(cache_layers)} layers for {len(kinds)} configured layer types")
    layers = []
    for i, (kind, layer) in enumerate(zip(kinds, cache_layers)):
        keys = getattr(layer, "keys", None)
        kv_heads = head_dim = 0
        if kind in KV_KINDS:
            values = getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise ModelError(f"{what}: layer {i} is configured as {kind} attention but caches no keys and values")
            if keys.shape[-1] != values.shape[-1]:
                raise ModelError(f"{what}: layer {i} caches keys and values of different widths; not covered")
            kv_heads, head_dim = int(keys.shape[1]), int(keys.shape[-1])
        state: list[tuple[str, tuple[int, ...], str]] = []
        if kind in STATE_KINDS:
            if getattr(layer, "number_of_states", 1) != 1:
                raise ModelError(f"{what}: layer {i} keeps several recurrent states; not covered")
            for name, tensors in zip(STATE_NAMES, (layer.conv_states, layer.recurrent_states)):
                t = tensors.get(0) if isinstance(tensors, dict) else None
                if t is not None:
                    state.append((name, tuple(int(d) for d in t.shape[1:]), dtypes.name(t.dtype)))
            if not any(name == "conv" for name, _, _ in state):  # restoring a state starts from its conv state
                raise ModelError(f"{what}: layer {i} is configured as a {kind} layer but keeps no convolution state")
        layers.append(LayerLayout(kind, _window(cfg, kind), kv_heads, head_dim, tuple(sorted(state))))
    groups = {layer.group for layer in layers if layer.group is not None}
    has_state = any(layer.has_state for layer in layers)
    mask_dict = len(groups) > 1 or (has_state and bool(groups))
    if len({MASK_KEYS[g.partition(":")[0]] for g in groups}) < len(groups):
        raise ModelError(f"{what}: layers of one attention type use different windows; not covered")
    if mask_dict and not _takes_mask_dict(model):
        raise ModelError(
            f"{what}: its layers need different attention masks but its forward takes only one; kvstore cannot "
            "mask them exactly, so it refuses it"
        )
    return CacheLayout(
        tuple(layers), dense=False, mask_dict=mask_dict, cache_arg=cache_keyword(model),
        single_step=family.model_type in SINGLE_STEP_TYPES, attn=attn,
    )  # fmt: skip


__all__ = ["CacheLayout", "KVShape", "LayerKV", "LayerLayout", "cache_keyword", "cache_layout"]
