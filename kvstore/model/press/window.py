"""Scoring forwards: queries for the presses that read them, without running the prefill again.

A press like SnapKV scores a context's tokens by the attention of its last ``W`` tokens (the
observation window); ExpectedAttention by statistics of every context token's queries; KVzip by
the attention of a replay of the context. kvpress takes those queries from the prefill itself (or
runs the replay on the prefill's cache); a stored context has no prefill to take them from.
:func:`run_on_row` runs the tokens a press needs on top of one row's cached tokens (a copy of the
row's first ``start`` slots, so the stored or prefilled values stay what every other variant
reads), with the model's own attention wrapped by :func:`capturing`, which hands each layer's
queries (after the rotary embedding) and the keys and values they attend over to a callback on
their way into attention. These tokens are counted as scoring tokens (window, context or replay),
never as prefill. Both the cached path and the no-cache reference call this same function on
their buffers, so both keep the same tokens.

A row of ``c <= W`` tokens takes its last ``c - 1`` tokens as the window (its first token is the
only one scored against them).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.model.compute.cache import PreallocatedCache
from kvstore.model.press.scorers import OnLayer
from kvstore.model.variants import hooks

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

CAPTURE_PREFIX = "kvstore-capture:"


def inner_attention(name: str, module: torch.nn.Module) -> Any:
    """The attention function implementation ``name`` stands for (the module's own eager one)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(module).__module__].eager_attention_forward


@contextlib.contextmanager
def capturing(model: torch.nn.Module, on_layer: OnLayer) -> Iterator[None]:
    """Within the block, every attention call of ``model`` first calls ``on_layer(layer, queries
    [B, heads, q, d], keys [B, kv_heads, S, d], values, module)`` (queries after the rotary
    embedding), then attends exactly as the implementation active on entry does (the model's own,
    or a decode attention's)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    current = str(getattr(model.config, "_attn_implementation", None) or "eager")
    calls = [0]

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        layer = getattr(module, "layer_idx", None)
        on_layer(layer if isinstance(layer, int) else calls[0], query, key, value, module)
        calls[0] += 1
        return inner_attention(current, module)(module, query, key, value, *args, **kwargs)

    mask = ALL_MASK_ATTENTION_FUNCTIONS[current] if current in ALL_MASK_ATTENTION_FUNCTIONS else None
    with hooks.switched(model, CAPTURE_PREFIX + current, attention, mask):
        yield


def record_queries(into: dict[int, torch.Tensor]) -> OnLayer:
    """An ``on_layer`` for :func:`capturing` that keeps each layer's queries ``[B, heads, q, d]`` (a copy)."""

    def on_layer(layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, module) -> None:
        into[layer] = queries.detach().clone()

    return on_layer


@torch.inference_mode()
def run_on_row(
    handle: ModelHandle, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], ids: Sequence[int], start: int,
    on_layer: OnLayer,
) -> int:  # fmt: skip
    """Run ``ids`` at positions ``start..`` on top of the first ``start`` tokens of one row's cached
    context (``layers``: per layer ``(keys, values)`` ``[kv_heads, c, head_dim]``, never written),
    every layer's queries and attended keys and values handed to ``on_layer``; returns the tokens
    run."""
    if not ids:
        return 0
    n = len(ids)
    dev = handle.device
    bufs = []
    for k, v in layers:
        kb = k.new_empty((1, k.shape[0], start + n, k.shape[-1]))
        vb = v.new_empty((1, v.shape[0], start + n, v.shape[-1]))
        kb[0, :, :start].copy_(k[:, :start])
        vb[0, :, :start].copy_(v[:, :start])
        bufs.append((kb, vb))

    def first_row(layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, module) -> None:
        on_layer(layer, queries[0], keys[0], values[0], module)

    with capturing(handle.model, first_row):
        handle.model(
            input_ids=torch.as_tensor(list(ids), dtype=torch.long, device=dev)[None],
            attention_mask=torch.ones((1, start + n), dtype=torch.long, device=dev),
            position_ids=torch.arange(start, start + n, device=dev)[None],
            **{handle.layout.cache_arg: PreallocatedCache(bufs, start)},
            use_cache=True,
            logits_to_keep=1,
        )
    return n


__all__ = ["CAPTURE_PREFIX", "capturing", "inner_attention", "record_queries", "run_on_row"]
