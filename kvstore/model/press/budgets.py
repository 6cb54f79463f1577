"""The built-in budgets' ``keep`` functions: given a row's scores per layer (``[kv_heads, c]``,
higher is kept), the tokens each layer and KV head keeps, as bool masks of the same shapes. Each
is a :class:`~kvstore.model.press.registry.BudgetRule`'s ``keep`` (the registry names them by
``module:function``; :func:`~kvstore.model.press.registry.register_budget` adds others), called by
:func:`kvstore.model.press.select.kept_masks` for a ratio above 0 and a context of tokens:

* ``head``: every head keeps ``n = int(c(1 - ratio))`` (at least 1) of its best tokens;
* ``adakv``: each head first keeps its ``int(n alpha_safeguard)`` best (at least 1 when alpha > 0),
  then the layer keeps its ``H n`` best pairs over all heads (kvpress's AdaKVPress);
* ``pyramid``: every head of layer ``l`` keeps ``n_l`` (PyramidKV's linear schedule, as kvpress's
  ``PyramidKVPress.get_layer_budget``; its fallback ``round(c(1 - ratio))`` where the schedule does
  not fit the context);
* ``global``: the row drops its ``int(L H c ratio)`` lowest-scored pairs over every layer and head;
* ``layer``: each layer drops its ``int(H c ratio)`` lowest over its heads.

Ties are broken by the lower index: the lower position within a head, the lower head within a
layer, the lower layer (a stable sort; kvpress uses ``torch.topk``, which breaks ties in no fixed
order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.press.spec import Press

Masks = list[torch.Tensor]


def top_mask(scores: torch.Tensor, n: int) -> torch.Tensor:
    """A bool mask of the ``n`` highest of the last dimension's ``scores`` (ties: lower index)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :n]
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, True)


def pyramid_budget(press: Press, c: int, layer: int, n_layers: int) -> int:
    """Tokens every head of ``layer`` keeps under the ``pyramid`` budget (see the module docstring)."""
    window = int(press.param("window")) if press.has_param("window") else 64
    beta = int(press.param("beta"))
    most = window + c * (1 - press.ratio)
    low = (most - window) / beta
    high = (most - window) * 2 - low
    if high >= c - window:
        high = c - window
        low = (most - window) * 2 - high
    if not (c >= high >= low >= window):
        return max(1, round(c * (1 - press.ratio)))
    steps = (high - low) / (n_layers - 1) if n_layers > 1 else 0.0
    return max(1, min(c, round(high - layer * steps)))


def keep_head(press: Press, scores: Sequence[torch.Tensor], c: int) -> Masks:
    n = press.n_kept(c)
    return [top_mask(s, n) for s in scores]


def keep_pyramid(press: Press, scores: Sequence[torch.Tensor], c: int) -> Masks:
    return [top_mask(s, pyramid_budget(press, c, i, len(scores))) for i, s in enumerate(scores)]


def keep_layer(press: Press, scores: Sequence[torch.Tensor], c: int) -> Masks:
    out = []
    for s in scores:
        H = s.shape[0]
        out.append(top_mask(s.reshape(-1), H * c - int(H * c * press.ratio)).view(H, c))
    return out


def keep_adakv(press: Press, scores: Sequence[torch.Tensor], c: int) -> Masks:
    n = press.n_kept(c)
    alpha = float(press.param("alpha_safeguard"))
    safe = int(n * alpha)
    if alpha > 0:
        safe = max(1, safe) if n > 0 else 0
    out = []
    for s in scores:
        H = s.shape[0]
        forced = s.clone()
        if safe:
            forced[top_mask(s, safe)] = torch.inf
        out.append(top_mask(forced.reshape(-1), H * n).view(H, c))
    return out


def keep_global(press: Press, scores: Sequence[torch.Tensor], c: int) -> Masks:
    flat = torch.cat([s.reshape(-1) for s in scores])
    keep = top_mask(flat, flat.numel() - int(flat.numel() * press.ratio))
    out, at = [], 0
    for s in scores:
        out.append(keep[at : at + s.numel()].view(s.shape))
        at += s.numel()
    return out


__all__ = ["keep_adakv", "keep_global", "keep_head", "keep_layer", "keep_pyramid", "pyramid_budget", "top_mask"]
