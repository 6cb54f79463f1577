"""What a composition policy recomputes over a row's composed keys and values.

``none`` keeps them as placed; ``last:N`` runs the composed context's last ``N`` tokens again on
top of the rest (so they attend to every passage before them, as the full prefill's do);
``blend:R`` picks the share ``R`` of passage tokens whose keys and values at an early layer move
most when recomputed over everything before them, and runs those tokens through every layer
(CacheBlend), their new keys and values replacing the placed ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from kvstore.facts import ATTN
from kvstore.model.compose.rows import ComposedRow
from kvstore.model.compose.spec import BLEND_LAYER, Compose
from kvstore.model.compute.cache import LayerKV, PreallocatedCache, new_buffers
from kvstore.model.compute.forward import extend, prefill
from kvstore.model.compute.masks import position_mask

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def recompute(handle: ModelHandle, row: ComposedRow, layers: LayerKV, policy: Compose) -> tuple[LayerKV, int]:
    """``(the row's keys and values after the policy's recompute, tokens recomputed)``."""
    if policy.kind == "none":
        return layers, 0
    if policy.kind == "last":
        return last_tokens(handle, row, layers, policy.tokens)
    if policy.kind == "blend":
        return blend(handle, row, layers, policy.ratio)
    raise ValueError(f"compose policy {policy.name} does not recompute over stored passages")


def last_tokens(handle: ModelHandle, row: ComposedRow, layers: LayerKV, n: int) -> tuple[LayerKV, int]:
    """The composed context's last ``n`` tokens computed again over the rest (all of it when
    ``n`` covers the context: the full prefill)."""
    ids = row.ids
    total = len(ids)
    if n >= total:
        return prefill(handle, [ids])[0], total
    keep = total - n
    prefix = tuple((k[:, :keep], v[:, :keep]) for k, v in layers)
    rest = extend(handle, [prefix], [ids[keep:]])[0]
    return tuple((torch.cat([k, rk], dim=1), torch.cat([v, rv], dim=1)) for (k, v), (rk, rv) in zip(prefix, rest)), n


class _Stop(Exception):
    """Ends a forward once the layer whose keys and values are wanted has run."""


def early_kv(handle: ModelHandle, ids: Sequence[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s keys and values ``[kv_heads, n, head_dim]`` of ``ids`` computed from position
    0 (a full forward's, exactly), running only layers ``0..layer`` (the rest is never run)."""
    blocks = handle.model.get_decoder().layers
    cache = DynamicCache()

    def stop(*_args: object) -> None:
        raise _Stop

    hook = blocks[layer].register_forward_hook(stop)
    try:
        handle.model(
            input_ids=torch.tensor([list(ids)], device=handle.device),
            position_ids=torch.arange(len(ids), device=handle.device)[None],
            **{handle.layout.cache_arg: cache}, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
    except _Stop:
        pass
    finally:
        hook.remove()
    got: Any = cache.layers[layer]
    return got.keys[0], got.values[0]


def selected(handle: ModelHandle, row: ComposedRow, layers: LayerKV, ratio: float) -> torch.Tensor:
    """The positions (int64, ascending) of the share ``ratio`` of passage tokens whose keys and
    values at layer :data:`BLEND_LAYER` differ most (squared distance) from the full forward's."""
    head, total = len(row.head), len(row.ids)
    n = math.ceil(ratio * (total - head))
    if n == 0:
        return torch.empty(0, dtype=torch.long)
    at = min(BLEND_LAYER, len(layers) - 1)
    k, v = early_kv(handle, row.ids, at)
    pk, pv = layers[at]
    gap = ((k - pk).float().pow(2).sum(dim=(0, 2)) + (v - pv).float().pow(2).sum(dim=(0, 2)))[head:]
    return (gap.topk(n).indices + head).sort().values.cpu()


@torch.inference_mode()
def blend(handle: ModelHandle, row: ComposedRow, layers: LayerKV, ratio: float) -> tuple[LayerKV, int]:
    """CacheBlend: the :func:`selected` tokens run through every layer at their positions over the
    composed cache (their placed copies masked out, each other causally), their new keys and
    values replacing the placed ones."""
    pick = selected(handle, row, layers, ratio)
    s, total = int(pick.numel()), len(row.ids)
    if s == 0:
        return layers, 0
    dev = handle.device
    bufs = new_buffers(handle.kv_shapes(), 1, total + s, handle.dtype, dev)
    for (kb, vb), (k, v) in zip(bufs, layers):
        kb[0, :, :total].copy_(k)
        vb[0, :, :total].copy_(v)
    kv_pos = torch.arange(total + s)
    kv_pos[pick] = -1  # the placed copies of the recomputed tokens: not attended
    kv_pos[total:] = pick
    mask = position_mask(
        kv_pos[None].to(dev), pick[None].to(dev), total, ATTN, handle.dtype, handle.attn_implementation
    )
    ids = torch.tensor(row.ids)[pick][None].to(dev)
    handle.model(
        input_ids=ids, attention_mask=mask, position_ids=pick[None].to(dev),
        **{handle.layout.cache_arg: PreallocatedCache(bufs, total)}, use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    where = pick.to(dev)
    out = []
    for (kb, vb), (k, v) in zip(bufs, layers):
        k2, v2 = k.clone(), v.clone()
        k2[:, where] = kb[0, :, total:]
        v2[:, where] = vb[0, :, total:]
        out.append((k2, v2))
    return tuple(out), s


__all__ = ["blend", "early_kv", "last_tokens", "recompute", "selected"]
