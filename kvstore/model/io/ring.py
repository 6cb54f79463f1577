"""The staging ring: pinned host buffers allocated once per model handle and reused by every load
into accelerator memory, each with a device twin of the same size and an event that says when the
copies reading it are done (:mod:`kvstore.model.io.staging` fills and sends them)."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from kvstore.model.io.pinned import ALIGN, host_bytes

RING_SLOTS = 3  # one decoding, one crossing PCIe, one spare (a chunk that decodes faster than it copies)


class RingOwner(Protocol):
    """What keeps a ring: a model handle's declared ``staging_ring``."""

    staging_ring: Ring | None


class Slot:
    """One buffer of a :class:`Ring`: ``host`` (uint8, pinned on CUDA), its ``device`` twin of the
    same size, and ``done``: the event recorded after the last copies that read them (None before
    the first use; on CPU copies are synchronous and there is no event)."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor):
        self.host, self.device = host, device
        self.done: Any = None
        self.uses = 0

    @property
    def capacity(self) -> int:
        return self.host.numel()


class Ring:
    """``slots`` staging buffers for loads into ``device``, allocated on first use and reused:
    a slot grows (is allocated again) only for a chunk larger than every slot so far. ``stream``:
    the side stream the copies run on (CUDA). Loads take the ring one at a time (``lock``): a load
    running ahead on a worker and a batch's own retry may overlap."""

    def __init__(self, device: torch.device, *, force: bool = False, slots: int = RING_SLOTS):
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.active = self.cuda or force
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots: list[Slot | None] = [None] * max(1, slots)
        self.next = 0
        self.lock = threading.Lock()
        self.allocations = 0  # buffers allocated so far, host and device twins counted once (tests)

    @classmethod
    def of(cls, owner: RingOwner, device: torch.device, *, force: bool = False) -> Ring:
        """The ring ``owner`` (a model handle: its ``staging_ring``) keeps for ``device``, made on first use."""
        ring = owner.staging_ring
        if ring is None or ring.device != device or ring.active != (ring.cuda or force):
            ring = owner.staging_ring = cls(device, force=force)
        return ring

    def acquire(self, nbytes: int) -> Slot:
        """The next slot, once the copies of its previous use are done, holding at least ``nbytes``
        (call with ``lock`` held)."""
        i = self.next
        self.next = (i + 1) % len(self.slots)
        slot = self.slots[i]
        if slot is not None and slot.done is not None:
            slot.done.synchronize()  # its bytes crossed; the host may write them again
        if slot is None or slot.capacity < nbytes:
            size = max([nbytes] + [s.capacity for s in self.slots if s is not None])
            slot = self.slots[i] = self._allocate(-(-size // ALIGN) * ALIGN)
        slot.uses += 1
        return slot

    def _allocate(self, nbytes: int) -> Slot:
        host = host_bytes(nbytes, self.cuda)
        with self.on_stream():
            device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.allocations += 1
        return Slot(host, device)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def send(self, slot: Slot, used: int, places: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Queue the copy of ``slot``'s first ``used`` bytes to the device and, for each ``(offset,
        dest)`` of ``places``, the copy of the bytes at ``offset`` (``dest``'s shape and dtype) into
        ``dest``; the slot's event is recorded after them even when queuing fails part-way (an
        out-of-memory error), so the slot is never written while a copy may still read it."""
        try:
            with self.on_stream():
                slot.device[:used].copy_(slot.host[:used], non_blocking=self.cuda)
                for offset, dest in places:
                    dest.copy_(_view(slot.device, offset, dest.shape, dest.dtype), non_blocking=self.cuda)
        finally:
            if self.stream is not None:
                slot.done = torch.cuda.Event()
                slot.done.record(self.stream)

    def release(self, slot: Slot) -> None:
        """Mark ``slot`` free once what was queued so far on the side stream is done (a chunk not
        sent whose device-decoded records may have queued copies out of it)."""
        if self.stream is not None:
            slot.done = torch.cuda.Event()
            slot.done.record(self.stream)


def _view(buf: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``buf`` (uint8) at ``offset`` seen as a contiguous ``shape``/``dtype`` tensor."""
    n = math.prod(shape) * dtype.itemsize
    return buf[offset : offset + n].view(dtype).view(tuple(shape))


__all__ = ["RING_SLOTS", "Ring", "RingOwner", "Slot"]
