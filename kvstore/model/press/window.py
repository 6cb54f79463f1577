"""Queries for the presses that read them, without running the prefill again.

A press like SnapKV scores a context's tokens by the attention of its last ``W`` tokens (the
observation window). kvpress takes those queries from the prefill itself; a stored context has no
prefill to take them from. :func:`window_queries` re-runs only the window's ``W`` tokens of one row
on top of the row's other ``c - W`` cached tokens (a forward of ``W`` tokens, counted as window
tokens computed, never as prefill), with the model's own attention wrapped by :func:`capturing`,
which records each layer's queries (after the rotary embedding) on their way into attention. The
keys and values that forward writes over the window's slots are put back as they were, so the
stored (or prefilled) values stay what every other variant reads. Both the cached path and the
no-cache reference call this same function on their buffers, so both keep the same tokens.

A row of ``c <= W`` tokens takes its last ``c - 1`` tokens as the window (its first token is the
only one scored against them).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from kvstore.model.compute.cache import BatchCache, PreallocatedCache
from kvstore.model.variants import hooks

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

CAPTURE_PREFIX = "kvstore-capture:"


def _inner_attention(name: str, module: torch.nn.Module) -> Any:
    """The attention function implementation ``name`` stands for (the module's own eager one)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(module).__module__].eager_attention_forward


@contextlib.contextmanager
def capturing(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every attention call of ``model`` records its query ``[B, heads, q,
    head_dim]`` (after the rotary embedding) under its layer index, then attends exactly as the
    implementation active on entry does (the model's own, or a decode attention's)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    current = str(getattr(model.config, "_attn_implementation", None) or "eager")
    records: dict[int, torch.Tensor] = {}
    calls = [0]

    def attention(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(module, "layer_idx", None)
        records[layer if isinstance(layer, int) else calls[0]] = query.detach().clone()
        calls[0] += 1
        return _inner_attention(current, module)(module, query, *args, **kwargs)

    mask = ALL_MASK_ATTENTION_FUNCTIONS[current] if current in ALL_MASK_ATTENTION_FUNCTIONS else None
    with hooks.switched(model, CAPTURE_PREFIX + current, attention, mask):
        yield records


@torch.inference_mode()
def window_queries(handle: ModelHandle, cache: BatchCache, row: int, window: int) -> list[torch.Tensor]:
    """Per layer, the ``[heads, w, head_dim]`` queries of row ``row``'s last ``w = min(window, c -
    1)`` context tokens (see the module docstring); ``w = 0`` (no queries) for a one-token context.
    The row's slots hold the same values afterwards."""
    a, b = cache.spans[row]
    c = b - a
    if c != cache.lengths[row]:
        raise ValueError("window queries need the row's whole context (press the dense cache)")
    w = min(window, c - 1)
    if w < 1:
        return []
    views = [(kb[row : row + 1, :, a:b], vb[row : row + 1, :, a:b]) for kb, vb in cache.bufs]
    saved = [(k[:, :, c - w :].clone(), v[:, :, c - w :].clone()) for k, v in views]
    dev = handle.device
    ids = torch.as_tensor(cache.ids[row][c - w :], dtype=torch.long, device=dev)[None]
    try:
        with capturing(handle.model) as records:
            handle.model(
                input_ids=ids,
                attention_mask=torch.ones((1, c), dtype=torch.long, device=dev),
                position_ids=torch.arange(c - w, c, device=dev)[None],
                **{handle.layout.cache_arg: PreallocatedCache(views, c - w)},
                use_cache=True,
                logits_to_keep=1,
            )
    finally:
        for (k, v), (sk, sv) in zip(views, saved):
            k[:, :, c - w :].copy_(sk)
            v[:, :, c - w :].copy_(sv)
    return [records[i][0] for i in range(len(cache.bufs))]


__all__ = ["CAPTURE_PREFIX", "capturing", "window_queries"]
