"""Rows of a batch in preallocated buffers, run with position masks: how windowed, state-space and
hybrid models continue from stored caches (dense models keep :mod:`kvstore.model.pipelines.sample`'s path).

A :class:`RowCache` is one context's cache after its first ``end`` positions: per layer the keys
and values a later token can still see (every position for full attention, the last ``W - 1`` for
a sliding window, the current attention chunk for chunked attention) and the recurrent states.

:class:`Slots` holds ``B`` rows. Per mask group (``attn``, ``sliding:W``, ``chunked:C``: see
:class:`kvstore.model.family.layout.CacheLayout`) each row's stored keys/values sit right-aligned in a
prefix of ``P_g`` slots (the most any row keeps in that group); after it comes a tail, shared by
all groups, where new tokens go. Each :meth:`Slots.run` appends a segment of ``S`` slots with
every row's tokens right-aligned in it, so a row with fewer tokens leaves holes before them, as a
left-padded batch would. Slot -> position tables (``-1``: nothing) say what each slot holds and
every forward gets masks built from them (:mod:`kvstore.model.compute.masks`), with explicit positions.

Recurrent states must never see a pad: HF's padding mask zeroes a pad's input but its step still
decays the state (``dt > 0``) and feeds zeros into the convolution window. So in a model with
states, rows run together only when they append the same number of tokens and are all fresh
(no state yet) or all continuing (rows are grouped: one forward per distinct length), and a
Mamba-1 mixer (:attr:`CacheLayout.single_step`) continues a stored state one token per forward.
A group that is not the whole batch runs on a sub-cache gathered from the batch's buffers and
states and written back after. Pure attention models run all rows in one forward (pads are
masked queries that see only their own slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

from kvstore import dtypes
from kvstore.facts import HYBRID, MASK_KEYS, STATE_MASK_KEYS
from kvstore.model.compute.cache import PreallocatedLayer
from kvstore.model.compute.masks import position_mask
from kvstore.model.family.layout import CacheLayout

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RowCache:
    """A context's cache after its first ``end`` positions. ``kv[i]``: layer ``i``'s keys and
    values ``[kv_heads, n, head_dim]`` of positions ``[end - n, end)`` (``n`` per
    :meth:`LayerLayout.keep`), or None; ``states[i]``: its state tensors by name (no batch
    dimension), or None."""

    end: int
    kv: tuple[KV | None, ...]
    states: tuple[dict[str, torch.Tensor] | None, ...]


class PreallocatedHybridLayer(LinearAttentionAndFullAttentionLayer):
    """A layer with a recurrent state *and* keys/values (FalconH1): the state as transformers
    keeps it, the keys/values in preallocated buffers (:class:`PreallocatedLayer`)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: PreallocatedLayer | None = None

    def attach(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> PreallocatedHybridLayer:
        self.kv = PreallocatedLayer(keys, values, length)
        self.keys, self.values, self.is_initialized = self.kv.keys, self.kv.values, True
        return self

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        assert self.kv is not None
        self.keys, self.values = self.kv.update(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.kv.length if self.kv is not None else 0


class _SlotCache(DynamicCache):
    def __init__(self, layers: list) -> None:
        Cache.__init__(self, layers=layers)


def _fill_state(layer: LinearAttentionLayer, state: dict[str, torch.Tensor]) -> None:
    # the public API: update_conv_state on a fresh layer takes its prefill branch (copies the
    # tensor, marks a previous state); update_recurrent_state keeps the tensor's own dtype
    layer.update_conv_state(state["conv"], conv_kernel_size=state["conv"].shape[-1])
    if "recurrent" in state:
        layer.update_recurrent_state(state["recurrent"])


def _layer_state(layer: LinearAttentionLayer) -> dict[str, torch.Tensor]:
    conv, recurrent = layer.conv_states[0], layer.recurrent_states.get(0)
    assert conv is not None
    return {"conv": conv} if recurrent is None else {"conv": conv, "recurrent": recurrent}


class Slots:
    """``B`` rows of a batch (see the module docstring). ``rows[r]``: row ``r``'s stored cache, or
    None to start from nothing; ``tail``: slots for the tokens :meth:`run` will append."""

    def __init__(self, handle: Any, layout: CacheLayout, rows: Sequence[RowCache | None], tail: int):
        self.model, self.layout = handle.model, layout
        self.pad_id = handle.pad_id
        dev, dtype = handle.device, handle.dtype
        self.dtype = dtype
        B = self.B = len(rows)
        ends = [r.end if r is not None else 0 for r in rows]
        self.P = {g: max(lay.keep(0, e) for e in ends) for g, lay in layout.groups.items()}
        self.prefix_pos = {g: torch.full((B, p), -1, dtype=torch.long, device=dev) for g, p in self.P.items()}
        self.tail_pos = torch.full((B, tail), -1, dtype=torch.long, device=dev)
        self.tail_ids = torch.full((B, tail), self.pad_id, dtype=torch.long, device=dev)
        self.t = 0
        self.next_pos = list(ends)
        self.fresh = [r is None for r in rows]
        self.kv: list[KV | None] = []
        self.states: list[LinearAttentionLayer | None] = []
        self.hybrid: dict[int, PreallocatedHybridLayer] = {}  # the hybrid layers of states, by layer index
        for i, lay in enumerate(layout.layers):
            if lay.has_kv:
                assert lay.group is not None
                P = self.P[lay.group]
                kb = torch.zeros((B, lay.kv_heads, P + tail, lay.head_dim), dtype=dtype, device=dev)  # pads finite
                vb = torch.zeros_like(kb)
                for r, row in enumerate(rows):
                    kv = row.kv[i] if row is not None else None
                    if kv is not None and kv[0].shape[1]:
                        n = kv[0].shape[1]
                        kb[r, :, P - n : P].copy_(kv[0])
                        vb[r, :, P - n : P].copy_(kv[1])
                self.kv.append((kb, vb))
            else:
                self.kv.append(None)
            if lay.has_state:
                state = {}
                for name, shape, dname in lay.state:
                    t = torch.zeros((B, *shape), dtype=dtypes.to_torch(dname), device=dev)
                    for r, row in enumerate(rows):
                        st = row.states[i] if row is not None else None
                        if st is not None:
                            t[r].copy_(st[name])
                    state[name] = t
                hybrid = PreallocatedHybridLayer() if lay.kind == HYBRID else None
                layer = hybrid if hybrid is not None else LinearAttentionLayer()
                if hybrid is not None:
                    self.hybrid[i] = hybrid
                _fill_state(layer, state)
                self.states.append(layer)
            else:
                self.states.append(None)
        for g, p in self.P.items():
            lay = layout.groups[g]
            for r, e in enumerate(ends):
                n = lay.keep(0, e)
                self.prefix_pos[g][r, p - n :] = torch.arange(e - n, e, device=dev)

    # -- running ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append ``tokens[j]`` (at least one) to row ``rows[j]``, in one new segment of the tail.
        Returns the logits of each row's last token, ``[len(rows), vocab]``."""
        S = max(len(t) for t in tokens)
        if min(len(t) for t in tokens) < 1:
            raise ValueError("every row needs at least one token")
        if self.t + S > self.tail_pos.shape[1]:
            raise RuntimeError(f"slots hold {self.tail_pos.shape[1]} new tokens; this run needs {self.t + S}")
        groups: dict[tuple[int, bool], list[int]] = {}
        for r, toks in zip(rows, tokens):
            n, a = len(toks), self.t + S - len(toks)
            self.tail_pos[r, a : a + n] = torch.arange(self.next_pos[r], self.next_pos[r] + n)
            self.tail_ids[r, a : a + n] = torch.as_tensor(list(toks), dtype=torch.long)
            key = (n, self.fresh[r]) if self.layout.has_state else (S, False)
            groups.setdefault(key, []).append(r)
        logits: dict[int, torch.Tensor] = {}
        for (n, fresh), members in groups.items():
            members.sort()
            a = self.t + S - n
            steps = [(a + j, 1) for j in range(n)] if self.layout.single_step and not fresh else [(a, n)]
            for slot, s in steps:
                out = self._forward(members, slot, s, fresh and slot == a)
            for j, r in enumerate(members):
                logits[r] = out[j]
            for r in members:
                self.fresh[r] = False
        for r, toks in zip(rows, tokens):
            self.next_pos[r] += len(toks)
        self.t += S
        return torch.stack([logits[r] for r in rows])

    def _forward(self, members: list[int], slot: int, s: int, fresh: bool) -> torch.Tensor:
        """One forward of rows ``members`` over tail slots ``[slot, slot + s)``."""
        layout, end = self.layout, slot + s
        whole = members == list(range(self.B))
        contiguous = members == list(range(members[0], members[-1] + 1))
        sel: slice | torch.Tensor = (
            slice(members[0], members[-1] + 1) if contiguous else torch.tensor(members, device=self.tail_pos.device)
        )
        layers: list[Any] = []
        scatter: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []
        states_back: list[tuple[int, LinearAttentionLayer]] = []
        for i, lay in enumerate(layout.layers):
            kv_layer = None
            if lay.has_kv:
                assert lay.group is not None
                P = self.P[lay.group]
                kb, vb = self.kv[i]  # type: ignore[misc]
                if contiguous:
                    ks, vs = kb[sel], vb[sel]
                else:  # gathered copies (only what this forward reads), written back below
                    ks, vs = kb[:, :, : P + end][sel], vb[:, :, : P + end][sel]
                    scatter.append((i, ks, vs, P))
                kv_layer = (ks, vs, P + slot)
            if not lay.has_state:
                assert kv_layer is not None
                layers.append(PreallocatedLayer(*kv_layer))
                continue
            persistent = self.states[i]
            assert persistent is not None
            if whole and not fresh:
                layer = self.hybrid[i].attach(*kv_layer) if kv_layer is not None else persistent
            else:  # fresh rows start with no state at all: transformers' own prefill path
                hybrid = PreallocatedHybridLayer() if kv_layer is not None else None  # its state and its keys/values
                layer = hybrid if hybrid is not None else LinearAttentionLayer()
                if not fresh:
                    _fill_state(layer, {k: v[sel] for k, v in _layer_state(persistent).items()})
                states_back.append((i, layer))
                if hybrid is not None and kv_layer is not None:
                    hybrid.attach(*kv_layer)
            layers.append(layer)
        ids = self.tail_ids[sel, slot:end]
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, "logits_to_keep": 1}
        kwargs[layout.cache_arg] = _SlotCache(layers)
        if layout.has_kv:
            q_pos = self.tail_pos[sel, slot:end]
            masks = {}
            for g in layout.groups:
                kv_pos = torch.cat([self.prefix_pos[g][sel], self.tail_pos[sel, :end]], dim=1)
                masks[g] = position_mask(kv_pos, q_pos, self.P[g] + slot, g, self.dtype, layout.attn)
            if layout.mask_dict:
                arg: Any = {MASK_KEYS[g.partition(":")[0]]: m for g, m in masks.items()}
                arg |= dict.fromkeys(STATE_MASK_KEYS)  # recurrent layers never see a pad
            else:
                (arg,) = masks.values()
            kwargs["attention_mask"] = arg
            kwargs["position_ids"] = q_pos.clamp(min=0)  # pads: any position, they are masked
        out = self.model(**kwargs)
        for i, ks, vs, P in scatter:
            kb, vb = self.kv[i]  # type: ignore[misc]
            kb[sel, :, P + slot : P + end] = ks[:, :, P + slot : P + end]
            vb[sel, :, P + slot : P + end] = vs[:, :, P + slot : P + end]
        for i, layer in states_back:
            target = _layer_state(self.states[i])  # type: ignore[arg-type]
            for name, t in _layer_state(layer).items():
                target[name][sel] = t
        return out.logits[:, -1]

    # -- reading back ---------------------------------------------------------------------------
    def appended_kv(self, r: int) -> tuple[KV | None, ...]:
        """Per layer, the keys/values of every token appended to row ``r`` (in position order)."""
        idx = (self.tail_pos[r] >= 0).nonzero().squeeze(1)
        out: list[KV | None] = []
        for lay, kv in zip(self.layout.layers, self.kv):
            if kv is None:
                out.append(None)
                continue
            assert lay.group is not None
            at = idx + self.P[lay.group]
            out.append((kv[0][r, :, at], kv[1][r, :, at]))
        return tuple(out)

    def row_states(self, r: int) -> tuple[dict[str, torch.Tensor] | None, ...]:
        """Per layer, copies of row ``r``'s state tensors (None for layers without a state)."""
        return tuple(
            None if layer is None else {k: v[r].clone() for k, v in _layer_state(layer).items()}
            for layer in self.states
        )


__all__ = ["PreallocatedHybridLayer", "RowCache", "Slots"]
