"""Pressing a batch's contexts: score every row's tokens, keep what the budget allows, gather the kept
tokens into new buffers.

:func:`press_cache` takes a :class:`~kvstore.model.compute.cache.BatchCache` whose rows hold whole
contexts and returns another whose buffers hold only the kept tokens (:mod:`kvstore.model.press.select`
says which), per layer and KV head, in position order, left-padded with zeros. When every head of
every layer of a row keeps the same count (the ``head`` budget), one mask per row serves every head
and the result has the usual layout (the contexts in slots ``P - kept .. P``). Otherwise (AdaKV,
PyramidKV, KVzip's global cut) each layer gets its own context slots ``P_l`` (the most any row's
head keeps in it) and each head its own count (:class:`~kvstore.model.compute.cache.HeadCounts`):
memory and decode steps shrink with what is kept, and :mod:`kvstore.model.press.heads` masks each
head's pads during the question and decode steps. A kept token keeps the keys and values it was
cached with (its rotary position included) and its position: what follows continues at ``c``.
The input buffers are never written, so every variant of a sweep presses the same dense cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import BatchCache, HeadCounts
from kvstore.model.press.select import Observations, PressMemo, kept_masks, row_scores
from kvstore.model.press.spec import Press

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

# per row: per layer [kv_heads, c] bool of the kept tokens, or None (the row keeps every token)
Picks = Sequence[Sequence[torch.Tensor] | None]


@torch.inference_mode()
def press_cache(
    handle: ModelHandle, cache: BatchCache, press: Press, memo: PressMemo, observe: Observations | None = None
) -> BatchCache:
    """``cache`` with only the tokens ``press`` keeps (see the module docstring); ``cache`` itself
    when it keeps every token (a ratio of 0). ``observe(row)`` gives the queries of a
    question-aware press."""
    picks: list[list[torch.Tensor] | None] = []
    for r, (a, b) in enumerate(cache.spans):
        c = b - a
        if press.ratio == 0 or c == 0:
            picks.append(None)
            continue
        masks = kept_masks(press, row_scores(handle, cache, press, r, memo, observe), c)
        picks.append(None if all(bool(m.all()) for m in masks) else masks)
    if all(p is None for p in picks):
        return cache
    return gather_kept(cache, picks)


def gather_kept(cache: BatchCache, picks: Picks) -> BatchCache:
    """New buffers holding, per row, layer and head, the tokens ``picks[r][layer][head]`` marks
    (None: all of them) left-padded to the layer's longest; the free slots after the contexts as
    many as ``cache`` had."""
    n_layers = len(cache.bufs)
    B = len(cache.spans)
    heads = [int(k.shape[1]) for k, _ in cache.bufs]
    counts = [torch.empty((B, h), dtype=torch.long) for h in heads]
    for r, ((a, b), p) in enumerate(zip(cache.spans, picks)):
        for i in range(n_layers):
            counts[i][r] = (b - a) if p is None else p[i].sum(dim=-1).cpu()
    ragged = any(bool((n != n[:, :1]).any()) for n in counts) or any(
        not torch.equal(n[:, 0], counts[0][:, 0]) for n in counts
    )
    tail = cache.slots - cache.first_free
    slots = tuple(int(n.max()) for n in counts)
    bufs = []
    for i, (kb, vb) in enumerate(cache.bufs):
        P = slots[i]
        nk = kb.new_empty((B, heads[i], P + tail, kb.shape[-1]))
        nv = vb.new_empty((B, heads[i], P + tail, vb.shape[-1]))
        for r, ((a, b), p) in enumerate(zip(cache.spans, picks)):
            _gather_row(kb[r, :, a:b], vb[r, :, a:b], None if p is None else p[i], nk[r, :, :P], nv[r, :, :P])
        bufs.append((nk, nv))
    if not ragged:
        kept = [int(counts[0][r, 0]) for r in range(B)]
        return BatchCache(bufs, tuple((slots[0] - n, slots[0]) for n in kept), cache.lengths, slots[0], cache.ids)
    longest = counts[0].max(dim=1).values.tolist()
    spans = tuple((slots[0] - int(n), slots[0]) for n in longest)
    return BatchCache(bufs, spans, cache.lengths, slots[0], cache.ids, HeadCounts(slots, tuple(counts)))


def _gather_row(
    keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, out_k: torch.Tensor, out_v: torch.Tensor
) -> None:
    """One row and layer: ``keys``/``values`` ``[H, c, d]``; the tokens ``mask`` ``[H, c]`` keeps
    (None: all) into ``out_k``/``out_v`` ``[H, P, d]``, each head's right-aligned, zeros before."""
    H, c, _ = keys.shape
    P = out_k.shape[1]
    if mask is None:
        out_k[:, : P - c].zero_()  # masked pads must be finite: 0 * NaN would still poison
        out_v[:, : P - c].zero_()
        out_k[:, P - c :].copy_(keys)
        out_v[:, P - c :].copy_(values)
        return
    n = mask.sum(dim=-1)  # [H]
    # a stable sort puts the dropped positions first and the kept ones last, each in position order
    order = torch.sort(mask.to(torch.int8), dim=-1, stable=True).indices
    if c >= P:
        idx = order[:, c - P :]
    else:
        idx = torch.cat([order.new_zeros((H, P - c)), order], dim=-1)
    valid = torch.arange(P, device=mask.device)[None, :] >= (P - n)[:, None]  # [H, P]
    idx = idx.to(keys.device)
    valid = valid.to(keys.device)
    out_k.copy_(torch.gather(keys, 1, idx[..., None].expand(-1, -1, keys.shape[-1])))
    out_v.copy_(torch.gather(values, 1, idx[..., None].expand(-1, -1, values.shape[-1])))
    out_k.masked_fill_(~valid[..., None], 0)
    out_v.masked_fill_(~valid[..., None], 0)


__all__ = ["Picks", "gather_kept", "press_cache"]
