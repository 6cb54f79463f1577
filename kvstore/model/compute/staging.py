"""Host staging for loads into accelerator memory: pinned buffers, one asynchronous copy per
layer, and dequantization on the device.

Stored records decode on the CPU (checksum, zstd, unshuffle). Into a CUDA batch buffer, a plain
``dest.copy_(host)`` from pageable memory is synchronous and goes through a driver bounce buffer.
:class:`Staging` instead:

* **regions** (:meth:`Staging.region`): the records of one layer's keys (or values) over a run of
  chunks decode straight into one **pinned** host tensor shaped like their span of the batch
  buffer (raw bytes: one memcpy out of the store's map), and the last record to land queues one
  host-to-device copy of the whole span on a side stream (``non_blocking=True``). The copy of one
  layer overlaps with the decoding of the others;
* **device decoding** (:meth:`Staging.copy_into` of a record with ``device_decode``, the int8/int4
  readers): the record's codes go to the device as they are stored (uint8, a quarter or an eighth
  of the bytes of float32 values) with their scales and zeros, each through a pinned tensor and an
  asynchronous copy (:meth:`Staging.upload`), and the reader dequantizes on the device, on the side
  stream;
* anything else decodes into a pinned host tensor of its own and is copied asynchronously.

:meth:`Staging.finish` makes the compute stream wait for the side stream and keeps every host
tensor alive until the copies are done. None of this has run on a GPU yet (no GPU was lent when it
was written): ``Staging(device, force=True)`` (tests) runs the same bookkeeping on CPU, with
ordinary host tensors, synchronous copies and the device branch of the readers, so it is checked
where no GPU is.

On a CPU-only machine (``force`` off) there is nothing to stage: records decode straight into the
destination.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


class Staging:
    """Loads into ``device`` tensors through pinned host memory on a side stream (CUDA), or
    directly (CPU); ``force``: stage on CPU too (tests: the same bookkeeping, ordinary memory,
    synchronous copies). Its methods may be called from several threads at once."""

    def __init__(self, device: torch.device, *, force: bool = False):
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.active = self.cuda or force
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None:  # buffers allocated or zeroed on the compute stream come first
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self._hosts: list[torch.Tensor] = []
        self._lock = threading.Lock()
        # what went through this staging (tests and benchmarks read it): copies of whole regions,
        # records decoded on the device, tensors uploaded for them, records staged one by one
        self.counts = {"regions": 0, "device_decoded": 0, "uploads": 0, "records": 0}

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _keep(self, host: torch.Tensor) -> None:
        with self._lock:
            self._hosts.append(host)

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def host_like(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized host tensor to stage ``shape``/``dtype`` in: pinned on CUDA."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def _send(self, host: torch.Tensor, dest: torch.Tensor) -> None:
        """``dest.copy_(host)``: asynchronous on the side stream (CUDA), keeping ``host`` alive."""
        if self.stream is None:
            dest.copy_(host)
            return
        with torch.cuda.stream(self.stream):
            dest.copy_(host, non_blocking=True)
        self._keep(host)

    def upload(self, source, device: torch.device) -> torch.Tensor:
        """``source`` (a stored tensor: ``copy_into(dest)``, or a host tensor) as a new tensor on
        ``device``, through a pinned host tensor and an asynchronous copy (CUDA). The result is
        ready on the side stream: use it there (device decoding runs there)."""
        host = self.host_like(tuple(source.shape), source.dtype)
        if isinstance(source, torch.Tensor):
            host.copy_(source)
        else:
            source.copy_into(host)
        self._count("uploads")
        with self._on_side_stream():
            out = torch.empty(host.shape, dtype=host.dtype, device=device)
        self._send(host, out)
        return out

    def copy_into(self, record, dest: torch.Tensor) -> None:
        """Decode ``record`` (a stored tensor: ``copy_into(dest)``) into ``dest``: on the device
        when the record can (``device_decode``), else through a host tensor of its own."""
        if not self.active:
            record.copy_into(dest)
            return
        if getattr(record, "device_decode", False):
            self._count("device_decoded")
            with self._on_side_stream():
                record.copy_into(dest, stage=self.upload)
            return
        self._count("records")
        host = self.host_like(tuple(dest.shape), dest.dtype)
        record.copy_into(host)
        self._send(host, dest)

    def region(self, dest: torch.Tensor, parts: int) -> Region:
        """A host tensor shaped like ``dest`` (``[heads, span, dim]``: one layer's keys or values
        over a run of chunks) that ``parts`` records decode into (:meth:`Region.copy_into`); once
        every part has been tried, one copy moves it all into ``dest``."""
        return Region(self, dest, parts)

    def finish(self) -> None:
        """Order the compute stream after every queued copy and device decode; release the host
        tensors once the copies are done."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.stream.synchronize()  # the pinned sources must outlive their copies
        self._hosts.clear()


class Region:
    """One host staging tensor for a span of a batch buffer, filled by several records (possibly
    on several threads) and sent with one copy when the last of them has been tried: a part that
    fails (a corrupt record) still counts, so the parts before it arrive; what the failed part left
    in its slots is never read (the caller loads only the prefix before it and recomputes the rest
    into those slots)."""

    def __init__(self, staging: Staging, dest: torch.Tensor, parts: int):
        self.staging, self.dest, self.left = staging, dest, parts
        self.host = staging.host_like(tuple(dest.shape), dest.dtype)
        self._lock = threading.Lock()

    def copy_into(self, record, start: int, end: int) -> None:
        """Decode ``record`` into slots ``start:end`` (dim 1) of the region; the last part sends it."""
        try:
            record.copy_into(self.host[:, start:end])
        finally:
            with self._lock:
                self.left -= 1
                last = self.left == 0
            if last:
                self.staging._count("regions")
                self.staging._send(self.host, self.dest)


__all__ = ["Region", "Staging"]
