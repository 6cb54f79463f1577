"""Pressing a batch's contexts: score every row's tokens, keep what the budget allows, gather the kept
tokens into new buffers (or read them from stored pressed entries).

:func:`press_cache` takes a :class:`~kvstore.model.compute.cache.BatchCache` whose rows hold whole
contexts and returns another whose buffers hold only the kept tokens (:mod:`kvstore.model.press.select`
says which), per layer and KV head, in position order, left-padded with zeros. :func:`press_batch`
does the same for a batch whose rows come from either source: the dense cache (pressed now) or a
stored pressed entry of the same press (:mod:`kvstore.model.press.stored`, copied straight into
place), with rows pressed now round-tripped through a lossy codec where the request has one.

When every head of every layer of a row keeps the same count (the ``head`` budget), one mask per
row serves every head and the result has the usual layout (the contexts in slots ``P - kept ..
P``). Otherwise (AdaKV, PyramidKV, KVzip's global cut) each layer gets its own context slots
``P_l`` (the most any row's head keeps in it) and each head its own count
(:class:`~kvstore.model.compute.cache.HeadCounts`): memory and decode steps shrink with what is
kept, and :mod:`kvstore.model.press.heads` masks each head's pads during the question and decode
steps. A kept token keeps the keys and values it was cached with (its rotary position included)
and its position: what follows continues at ``c``. The input buffers are never written, so every
variant of a sweep presses the same dense cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvstore.model.compute.cache import BatchCache, HeadCounts
from kvstore.model.io.chains import Chain
from kvstore.model.press.select import Observations, PressMemo, kept_masks, row_scores
from kvstore.model.press.spec import Press
from kvstore.model.press.stored import KeptLayers, round_trip
from kvstore.store.codecs import Codec
from kvstore.store.owned import DerivedView

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


class KeptRow(Protocol):
    """One row's kept tokens: per layer, each KV head's count, and :meth:`fill` copying them."""

    def counts(self, layer: int) -> torch.Tensor:
        """``[kv_heads]`` int64 on the host."""
        ...

    def fill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the layer's kept keys and values into ``keys``/``values`` ``[kv_heads, P, d]``:
        each head's right-aligned (in position order), zeros before."""
        ...


@dataclass(frozen=True)
class DenseRow:
    """A row pressed now: its dense ``layers`` (per layer ``(keys, values)`` ``[H, c, d]``) and per
    layer the ``[H, c]`` bool mask of what it keeps (None: every token)."""

    layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    masks: Sequence[torch.Tensor] | None

    def counts(self, layer: int) -> torch.Tensor:
        k = self.layers[layer][0]
        if self.masks is None:
            return torch.full((k.shape[0],), k.shape[1], dtype=torch.long)
        return self.masks[layer].sum(dim=-1).cpu()

    def fill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        k, v = self.layers[layer]
        _gather_row(k, v, None if self.masks is None else self.masks[layer], keys, values)

    def kept_tensors(self) -> KeptLayers:
        """Per layer, per head ``(keys [n, d], values [n, d], positions [n])`` of the kept tokens, on
        the host (what encodes them reads them there). Gathered a layer at a time: one ``nonzero``,
        one gather and one copy to the host per layer, never per head (on an accelerator each of
        those waits for the device)."""
        out = []
        for i, (k, v) in enumerate(self.layers):
            heads, c = k.shape[0], k.shape[1]
            if self.masks is None:
                hs, pos = torch.arange(heads).repeat_interleave(c), torch.arange(c).repeat(heads)
                counts = [c] * heads
            else:
                hs, pos = self.masks[i].nonzero(as_tuple=True)  # row-major: by head, positions ascending
                counts = self.masks[i].sum(dim=-1).tolist()
            hs, pos = hs.to(k.device), pos.to(k.device)
            keys, values, pos = k[hs, pos].cpu(), v[hs, pos].cpu(), pos.cpu()
            out.append(list(zip(keys.split(counts), values.split(counts), pos.split(counts))))
        return out


@dataclass(frozen=True)
class StoredRow:
    """A row read from a pressed entry (a verified :class:`~kvstore.store.derived.DerivedView`,
    open while the batch is gathered)."""

    view: DerivedView

    def counts(self, layer: int) -> torch.Tensor:
        return torch.tensor(self.view.header.layers[layer].counts or (), dtype=torch.long)

    def fill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        counts = self.view.header.layers[layer].counts or ()
        P = keys.shape[1]
        for h, n in enumerate(counts):
            keys[h, : P - n].zero_()  # masked pads must be finite: 0 * NaN would still poison
            values[h, : P - n].zero_()
            if n:
                k, v = self.view.kv(layer, h)
                k.copy_into(keys[h : h + 1, P - n :])
                v.copy_into(values[h : h + 1, P - n :])


@dataclass(frozen=True)
class Geometry:
    """The shape of a batch's pressed cache apart from what its rows keep: each row's context
    length and ids, the free slots after the contexts (question and answer), and the per-layer KV
    shapes, dtype and device of its buffers."""

    lengths: tuple[int, ...]
    ids: tuple[tuple[int, ...], ...]
    tail: int
    shapes: tuple[tuple[int, int, int], ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, cache: BatchCache) -> Geometry:
        shapes = tuple((int(k.shape[1]), int(k.shape[3]), int(v.shape[3])) for k, v in cache.bufs)
        first = cache.bufs[0][0]
        return cls(cache.lengths, cache.ids, cache.slots - cache.first_free, shapes, first.dtype, first.device)


@dataclass(frozen=True)
class Sources:
    """Where each row's kept tokens come from for one press: the batch's ``dense`` contexts (rows
    pressed now; None when every row has an entry), the ``entries`` (row -> a stored pressed entry),
    and with a lossy ``codec`` each row's ``chains`` (rows pressed now go through the codec, as a
    stored entry would)."""

    dense: BatchCache | None
    entries: Mapping[int, DerivedView] = field(default_factory=dict)
    codec: Codec | None = None
    chains: Sequence[Chain] = ()


@torch.inference_mode()
def press_cache(
    handle: ModelHandle, cache: BatchCache, press: Press, memo: PressMemo, observe: Observations | None = None
) -> BatchCache:
    """``cache`` with only the tokens ``press`` keeps (see the module docstring); ``cache`` itself
    when it keeps every token (a ratio of 0). ``observe(row)`` gives the queries of a
    question-aware press."""
    return press_batch(handle, Geometry.of(cache), press, memo, Sources(cache), observe)


@torch.inference_mode()
def press_batch(
    handle: ModelHandle, geometry: Geometry, press: Press, memo: PressMemo, sources: Sources,
    observe: Observations | None = None,
) -> BatchCache:  # fmt: skip
    """A batch's cache under ``press``, each row from its entry or pressed from the dense cache
    (see the module docstring); the dense cache itself when no row drops a token (a ratio of 0
    always: the dense answer, bit for bit)."""
    if press.ratio == 0 and sources.dense is not None:
        return sources.dense
    rows: list[KeptRow] = []
    for r in range(len(geometry.lengths)):
        if r in sources.entries:
            rows.append(StoredRow(sources.entries[r]))
            continue
        dense = sources.dense
        assert dense is not None, "a row without a pressed entry is pressed from the dense cache"
        row = pressed_row(handle, dense, r, press, memo, observe)
        if sources.codec is not None and not sources.codec.lossless:
            rows.append(StoredRow(round_trip(handle, sources.chains[r], press, row.kept_tensors(), sources.codec)))
        else:
            rows.append(row)
    if (
        sources.dense is not None
        and not sources.entries
        and all(isinstance(x, DenseRow) and x.masks is None for x in rows)
    ):
        return sources.dense
    return gather_rows(geometry, rows)


def pressed_row(
    handle: ModelHandle, dense: BatchCache, r: int, press: Press, memo: PressMemo, observe: Observations | None = None
) -> DenseRow:
    """Row ``r`` of ``dense`` under ``press``: its context scored (``memo`` shares the scores
    between the presses of one scorer), then masked by the budget (no masks when every token is
    kept). What ``sample`` answers from and what ``build`` stores are this one row."""
    a, b = dense.spans[r]
    layers = [(kb[r, :, a:b], vb[r, :, a:b]) for kb, vb in dense.bufs]
    masks = None
    if press.ratio > 0 and b > a:
        masks = kept_masks(press, row_scores(handle, dense, press, r, memo, observe), b - a)
        if all(bool(m.all()) for m in masks):
            masks = None
    return DenseRow(layers, masks)


def gather_rows(geometry: Geometry, rows: Sequence[KeptRow]) -> BatchCache:
    """New buffers holding each row's kept tokens, per layer and head left-padded to the layer's
    longest; the free slots after the contexts as many as the geometry has."""
    B = len(rows)
    counts = [torch.stack([row.counts(i) for row in rows]) for i in range(len(geometry.shapes))]  # [B, H] each
    ragged = any(bool((n != n[:, :1]).any()) for n in counts) or any(
        not torch.equal(n[:, 0], counts[0][:, 0]) for n in counts
    )
    slots = tuple(int(n.max()) for n in counts)
    bufs = []
    for i, (heads, dk, dv) in enumerate(geometry.shapes):
        P = slots[i]
        nk = torch.empty((B, heads, P + geometry.tail, dk), dtype=geometry.dtype, device=geometry.device)
        nv = torch.empty((B, heads, P + geometry.tail, dv), dtype=geometry.dtype, device=geometry.device)
        for r, row in enumerate(rows):
            row.fill(i, nk[r, :, :P], nv[r, :, :P])
        bufs.append((nk, nv))
    if not ragged:
        kept = [int(counts[0][r, 0]) for r in range(B)]
        return BatchCache(bufs, tuple((slots[0] - n, slots[0]) for n in kept), geometry.lengths, slots[0], geometry.ids)
    longest = counts[0].max(dim=1).values.tolist()
    spans = tuple((slots[0] - int(n), slots[0]) for n in longest)
    return BatchCache(bufs, spans, geometry.lengths, slots[0], geometry.ids, HeadCounts(slots, tuple(counts)))


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
    valid = (torch.arange(P, device=mask.device)[None, :] >= (P - n)[:, None]).to(keys.device)  # [H, P]
    idx = idx.to(keys.device)
    out_k.copy_(torch.gather(keys, 1, idx[..., None].expand(-1, -1, keys.shape[-1])))
    out_v.copy_(torch.gather(values, 1, idx[..., None].expand(-1, -1, values.shape[-1])))
    out_k.masked_fill_(~valid[..., None], 0)
    out_v.masked_fill_(~valid[..., None], 0)


__all__ = [
    "DenseRow",
    "Geometry",
    "KeptRow",
    "Sources",
    "StoredRow",
    "gather_rows",
    "press_batch",
    "press_cache",
    "pressed_row",
]
