"""Host staging for loads into accelerator memory: pinned buffers and asynchronous copies.

Stored records decode on the CPU (checksum, zstd, unshuffle). Into a CUDA batch buffer, a plain
``dest.copy_(host)`` from pageable memory is synchronous and goes through a driver bounce buffer.
:class:`Staging` instead decodes each record into a **pinned** host tensor and queues its
host-to-device copy on a side stream (``non_blocking=True``), so the copy of one record can
overlap with the decoding of the next ones (not measured: no GPU was at hand when this was
written); :meth:`Staging.finish` makes the compute stream wait for the
copies (and keeps every host tensor alive until they are done).

On a CPU-only machine there is nothing to stage: :meth:`Staging.copy_into` decodes straight into
the destination. ``FORCE`` (tests) runs the staged path on CPU with ordinary host tensors, so its
bookkeeping is checked where no GPU is.
"""

from __future__ import annotations

import threading

import torch

FORCE = False  # stage on CPU too (tests): same bookkeeping, ordinary memory, synchronous copies


class Staging:
    """Loads into ``device`` tensors through pinned host memory on a side stream (CUDA), or
    directly (CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.active = self.cuda or FORCE
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None:  # buffers allocated or zeroed on the compute stream come first
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self._hosts: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def copy_into(self, record, dest: torch.Tensor) -> None:
        """Decode ``record`` (a stored tensor: ``copy_into(dest)``) into ``dest`` (may be called
        from several threads at once)."""
        if not self.active:
            record.copy_into(dest)
            return
        host = torch.empty(tuple(dest.shape), dtype=dest.dtype, pin_memory=self.cuda)
        record.copy_into(host)
        if self.stream is None:
            dest.copy_(host)
            return
        with torch.cuda.stream(self.stream):
            dest.copy_(host, non_blocking=True)
        with self._lock:
            self._hosts.append(host)

    def finish(self) -> None:
        """Order the compute stream after every queued copy; release the host tensors once the
        copies are done."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.stream.synchronize()  # the pinned sources must outlive their copies
        self._hosts.clear()


__all__ = ["FORCE", "Staging"]
