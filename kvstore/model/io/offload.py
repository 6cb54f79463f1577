"""Computed chunks leaving the accelerator for the writer: pinned host buffers, reused.

A chunk computed on a CUDA device used to reach the host inside its encoding, on the writer's
thread: ``t.to("cpu")`` from pageable memory (measured 1.3 GB/s device-to-host on an H100 host
against 14.8 GB/s pinned, issue 39), and a synchronous copy on the default stream,
which waits for everything queued on it, the next context's prefill included.
:meth:`HostBuffers.stage` instead copies every key and value tensor of the chunk into **one**
pinned host buffer (64-byte aligned places, one asynchronous copy per tensor on the compute
stream) and records an event after the copies; the prefill goes on, and the writer waits on the
event (:meth:`Staged.ready`) before it encodes. Buffers come from a free list and go back to it once
the chunk is encoded (:meth:`HostBuffers.give`): a build allocates pinned memory only until it has
as many buffers as chunks in flight (bounded by the writer's byte budget), not per chunk.

On CPU nothing is staged (the tensors are on the host already) unless ``force`` is set (tests): then
the same bookkeeping runs with ordinary host buffers and synchronous copies. The bytes are the
computed ones, so encoded entries are byte-identical either way.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from kvstore.model.io.pinned import aligned, host_bytes
from kvstore.store.entry import Entry


@dataclasses.dataclass
class Staged:
    """``entry`` with its keys and values in ``buffer`` (a host buffer of :class:`HostBuffers`);
    ``event``: recorded after the copies (None when they were synchronous)."""

    entry: Entry
    buffer: torch.Tensor
    event: Any = None

    def ready(self) -> Entry:
        """The entry, once its bytes have reached the host."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.entry


class HostBuffers:
    """A free list of host buffers (uint8; pinned when ``cuda``) that staged chunks are copied into.
    :attr:`allocations` counts the buffers allocated (tests); :attr:`keep`: free bytes kept for reuse
    at most (a buffer given back past it is dropped)."""

    def __init__(self, cuda: bool, keep: int):
        self.cuda, self.keep = cuda, keep
        self.free: list[torch.Tensor] = []
        self.lock = threading.Lock()
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least ``nbytes`` (the smallest), or a new one."""
        with self.lock:
            # the free list is sorted by size: the first that fits is the smallest
            i = next((i for i, b in enumerate(self.free) if b.numel() >= nbytes), None)
            if i is not None:
                return self.free.pop(i)
            self.allocations += 1
        return host_bytes(nbytes, self.cuda)

    def give(self, buf: torch.Tensor) -> None:
        """Hand ``buf`` back for reuse (its copies are done and nothing reads it any more)."""
        with self.lock:
            self.free.append(buf)
            self.free.sort(key=lambda b: b.numel())
            while len(self.free) > 1 and sum(b.numel() for b in self.free) > self.keep:
                self.free.pop()  # the largest

    def stage(self, entry: Entry) -> Staged:
        """Copy ``entry``'s keys and values into one buffer (asynchronously from a CUDA device)."""
        tensors = [t for kv in entry.layers if kv is not None for t in kv]
        places, used = [], 0
        for t in tensors:
            places.append(used)
            used += aligned(t.numel() * t.element_size())
        buf = self.take(max(used, 1))
        device = next((t.device for t in tensors if t.device.type == "cuda"), None)
        cuda = device is not None
        host = iter(
            buf[p : p + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for p, t in zip(places, tensors)
        )
        try:
            layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
            for kv in entry.layers:
                if kv is None:
                    layers.append(None)
                    continue
                k, v = next(host), next(host)
                k.copy_(kv[0], non_blocking=cuda)
                v.copy_(kv[1], non_blocking=cuda)
                layers.append((k, v))
            event = None
            if device is not None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
        except BaseException:
            if device is not None:
                torch.cuda.current_stream(device).synchronize()  # no copy may still write the buffer
            self.give(buf)
            raise
        return Staged(dataclasses.replace(entry, layers=tuple(layers)), buf, event)


__all__ = ["HostBuffers", "Staged"]
