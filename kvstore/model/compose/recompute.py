"""What a composition policy recomputes over a row's composed keys and values.

``none`` keeps them as placed; ``last:N`` runs the composed context's last ``N`` tokens again on
top of the rest (so they attend to every passage before them, as the full prefill's do);
``blend:R`` picks the share ``R`` of passage tokens whose keys and values at an early layer move
most when recomputed over everything before them, and runs those tokens through every layer
(CacheBlend), their new keys and values replacing the placed ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstore.model.compose.rows import ComposedRow
from kvstore.model.compose.spec import Compose
from kvstore.model.compute.cache import LayerKV
from kvstore.model.compute.forward import extend, prefill

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def recompute(handle: ModelHandle, row: ComposedRow, layers: LayerKV, policy: Compose) -> tuple[LayerKV, int]:
    """``(the row's keys and values after the policy's recompute, tokens recomputed)``."""
    if policy.kind == "none":
        return layers, 0
    if policy.kind == "last":
        return last_tokens(handle, row, layers, policy.tokens)
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


__all__ = ["last_tokens", "recompute"]
