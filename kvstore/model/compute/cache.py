"""Preallocated KV caches: buffers sized for the whole decode, written in place.

``DynamicCache`` concatenates on every step, copying the whole cache once per layer per step.
:class:`PreallocatedCache` holds ``[B, kv_heads, capacity, head_dim]`` buffers per layer and
writes each step's new keys/values into the next free slots, so a step costs only its new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from kvstore.model.family.layout import KVShape, LayerKV  # noqa: F401 - their old home

Buffers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [B, kv_heads, T, head_dim]


class PreallocatedLayer(DynamicLayer):
    """A cache layer over preallocated ``[B, kv_heads, capacity, head_dim]`` buffers.

    ``update`` writes the new keys/values in place and returns views of the filled prefix."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self._kbuf, self._vbuf = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.length = length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # buffers exist from the start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self._kbuf.shape[-2]:
            raise RuntimeError(f"preallocated cache holds {self._kbuf.shape[-2]} slots; step needs {end}")
        self._kbuf[:, :, self.length : end].copy_(key_states)
        self._vbuf[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class PreallocatedCache(DynamicCache):
    """A ``DynamicCache`` whose layers are :class:`PreallocatedLayer` (built from buffers), each
    filled up to ``length`` slots (one length per layer where they differ: a pressed cache whose
    layers keep different counts)."""

    def __init__(self, buffers: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int | Sequence[int]):
        lengths = [length] * len(buffers) if isinstance(length, int) else list(length)
        Cache.__init__(self, layers=[PreallocatedLayer(k, v, n) for (k, v), n in zip(buffers, lengths)])


@dataclass(frozen=True)
class HeadCounts:
    """Where a pressed cache's KV heads keep different counts: per layer, ``slots[l]`` context slots
    (``P_l``, the most any row's head keeps in that layer) and ``counts[l]`` ``[B, kv_heads]`` int64
    (on the host): head ``h`` of row ``r`` holds its kept tokens in slots ``P_l - counts[l][r, h] ..
    P_l``, left-padded with zeros (masked per head by :mod:`kvstore.model.press.heads`)."""

    slots: tuple[int, ...]
    counts: tuple[torch.Tensor, ...]

    def masks(self, device: torch.device) -> list[torch.Tensor]:
        """Per layer ``[B, kv_heads, P_l]`` bool: the slots each row's head keeps a token in."""
        return [
            torch.arange(P, device=device)[None, None, :] >= (P - n.to(device))[..., None]
            for P, n in zip(self.slots, self.counts)
        ]

    def row_pairs(self, row: int) -> int:
        """(token, head, layer) triples row ``row`` keeps."""
        return int(sum(int(n[row].sum()) for n in self.counts))


@dataclass(frozen=True)
class BatchCache:
    """A batch's contexts in its KV buffers, as the transform, answer and score stages read them:
    row ``r``'s context (token ids ``ids[r]``) sits in slots ``spans[r]`` (all before
    ``first_free``), holding ``kept_tokens[r] = end - start`` of its ``lengths[r]`` context tokens (fewer
    after a press; each kept token keeps its position, so what follows continues at position
    ``lengths[r]``). Slots from ``first_free`` on are free for the question and the answer.

    With ``heads`` (a press whose layers or heads keep different counts), each layer has its own
    context slots ``heads.slots[l]`` and each head its own count (:class:`HeadCounts`); layer 0's
    geometry is the batch's reference (``first_free = heads.slots[0]``, ``spans`` cover its longest
    head) and ``kept_tokens[r]`` is the row's mean over layers and heads, rounded."""

    bufs: Buffers
    spans: tuple[tuple[int, int], ...]
    lengths: tuple[int, ...]
    first_free: int
    ids: tuple[tuple[int, ...], ...]
    heads: HeadCounts | None = None

    @property
    def kept_tokens(self) -> tuple[int, ...]:
        if self.heads is None:
            return tuple(b - a for a, b in self.spans)
        per_row = sum(k.shape[1] for k, _ in self.bufs)
        return tuple(round(self.heads.row_pairs(r) / per_row) for r in range(len(self.spans)))

    @property
    def slots(self) -> int:
        return int(self.bufs[0][0].shape[2])

    @property
    def context_slots(self) -> tuple[int, ...]:
        """Per layer, the slots before the free ones (``first_free``, or each layer's own)."""
        return self.heads.slots if self.heads is not None else (self.first_free,) * len(self.bufs)

    def nbytes(self) -> int:
        """Bytes of keys and values the contexts occupy (kept tokens only, pads not counted)."""
        if self.heads is None:
            per_token = sum(k.shape[1] * k.shape[3] * k.element_size() + v.shape[1] * v.shape[3] * v.element_size()
                            for k, v in self.bufs)  # fmt: skip
            return per_token * sum(self.kept_tokens)
        return sum(
            int(n.sum()) * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())
            for (k, v), n in zip(self.bufs, self.heads.counts)
        )


def new_buffers(shapes: Sequence[KVShape], batch: int, slots: int, dtype: torch.dtype, device: torch.device) -> Buffers:
    """Uninitialized per-layer KV buffers ``[batch, kv_heads, slots, head_dim]``."""
    return [
        (
            torch.empty((batch, h, slots, dk), dtype=dtype, device=device),
            torch.empty((batch, h, slots, dv), dtype=dtype, device=device),
        )
        for h, dk, dv in shapes
    ]


__all__ = [
    "BatchCache",
    "Buffers",
    "HeadCounts",
    "PreallocatedCache",
    "PreallocatedLayer",
    "new_buffers",
]
