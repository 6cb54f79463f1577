"""Host staging for loads into accelerator memory: a ring of pinned buffers allocated once, one
large host-to-device copy per stored chunk on a side stream, and dequantization on the device.

Stored records decode on the CPU (checksum, zstd, unshuffle). Into a CUDA batch buffer, a plain
``dest.copy_(host)`` from pageable memory is synchronous and goes through a driver bounce buffer,
and a pinned allocation per load costs more than the copy. :class:`Staging` instead:

* **chunks** (:meth:`Staging.load_chunks`): every key and value record of one stored chunk decodes
  (on the load threads: memcpy and zstd release the GIL) into a **slot of a ring** (:class:`Ring`)
  of pinned host buffers, laid end to end (64-byte aligned); then, on a side stream, **one**
  host-to-device copy moves the slot's bytes into its device twin (a 512-token chunk of an 8B model:
  64 MiB), device-side copies move each record's span into its place in the left-padded batch
  buffer, and an event marks the slot's copies done. The next chunk decodes into the next slot
  while that copy runs; a slot is written again only after its event (so two or three slots
  overlap the host's decoding with the copy engine). The ring belongs to the model handle
  (:meth:`Ring.of`, :mod:`kvstore.model.io.ring`): its buffers are allocated once, grown
  only when a larger chunk comes, and reused by every load. A chunk's checksum is computed while
  its bytes are copied into the slot (:mod:`kvstore.store.fused`), and the slot is sent only once
  it matched; a few chunks decode at once, one per thread;
* **zstd frames decoded on the device** (a ``decoder``, :mod:`kvstore.model.io.device_zstd`:
  nvCOMP with the ``gpu`` extra): a lossless chunk's stored bytes cross as they are and its frames
  decode on the device in one batched call, its byte planes joined there;
* **device decoding** (:meth:`Staging.copy_into` of a record with ``device_decode``, the
  int8/int4/ecq readers): the record's codes go to the device as they are stored (uint8) with their
  scales and zeros, each through a pinned tensor and an asynchronous copy (:meth:`Staging.upload`),
  and the reader dequantizes on the device, on the side stream;
* anything else (:meth:`Staging.copy_into`) decodes into a pinned host tensor of its own and is
  copied asynchronously.

:meth:`Staging.finish` makes the compute stream wait for the side stream (the host does not wait,
unless tensors of their own were uploaded: those must outlive their copies). None of this has run
on a GPU yet (no GPU was lent when it was written): ``Staging(device, force=True)`` (tests) runs
the same bookkeeping on CPU, with ordinary host tensors as the slots and their "device" twins,
synchronous copies and the device branch of the readers, so it is checked where no GPU is.

On a CPU-only machine (``force`` off) there is nothing to stage: records decode straight into the
destination.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.errors import CorruptEntryError
from kvstore.model.io import device_zstd
from kvstore.model.io.ring import ALIGN, RING_SLOTS, Ring, Slot, _view  # noqa: F401 - RING_SLOTS: tests
from kvstore.parallel import run_all
from kvstore.store import fused
from kvstore.store.frame import verify_checksum


class SlotUploads:
    """The ``stage`` of device-decoded records (int8/int4/ecq codes, scales, zeros) through a ring
    slot: each tensor is copied into the slot's pinned bytes ``[start, end)`` (taken in turn, from
    several threads), sent to the same bytes of the slot's device twin by a copy on the side stream,
    and handed back as a view of them: no pinned allocation per tensor. A tensor that no longer
    fits goes through :meth:`Staging.upload` instead."""

    def __init__(self, staging: Staging, slot: Slot, start: int, end: int):
        self.staging, self.slot, self.pos, self.end = staging, slot, start, end
        self._lock = threading.Lock()

    def __call__(self, source, device: torch.device) -> torch.Tensor:
        shape, dtype = tuple(source.shape), source.dtype
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            offset = self.pos
            fits = offset + nbytes <= self.end and _same_device(torch.device(device), self.slot.device.device)
            if fits:
                self.pos = offset + -(-nbytes // ALIGN) * ALIGN
        if not fits:
            return self.staging.upload(source, device)
        host = _view(self.slot.host, offset, shape, dtype)
        if isinstance(source, torch.Tensor):
            host.copy_(source)
        else:
            source.copy_into(host)
        out = _view(self.slot.device, offset, shape, dtype)
        ring = self.staging.ring
        with ring.on_stream():
            out.copy_(host, non_blocking=ring.cuda)
        self.staging._count("uploads")
        return out


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is not None and b.index is not None):
        return a.index == b.index or a.type == "cpu"
    return (a.index if a.index is not None else torch.cuda.current_device()) == (
        b.index if b.index is not None else torch.cuda.current_device()
    )


def _layout(dests: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Each destination's offset in a slot (end to end, aligned) and the bytes they take."""
    offsets, pos = [], 0
    for d in dests:
        offsets.append(pos)
        pos += -(-(d.numel() * d.element_size()) // ALIGN) * ALIGN
    return offsets, pos


class Staging:
    """Loads into ``device`` tensors through pinned host memory on a side stream (CUDA), or
    directly (CPU); ``force``: stage on CPU too (tests: the same bookkeeping, ordinary memory,
    synchronous copies). ``ring``: the handle's :class:`Ring` (default: one of its own). Its
    methods may be called from several threads at once, except :meth:`load_chunks`."""

    def __init__(
        self, device: torch.device, *, force: bool = False, ring: Ring | None = None,
        decoder: device_zstd.DeviceDecoder | None = None,
    ):  # fmt: skip
        self.device = device
        self.decoder = decoder  # zstd frames decoded on the device (kvstore.model.io.device_zstd)
        self.ring = ring if ring is not None else Ring(device, force=force)
        self.cuda, self.active, self.stream = self.ring.cuda, self.ring.cuda or force, self.ring.stream
        if self.stream is not None:  # buffers allocated or zeroed on the compute stream come first
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self._hosts: list[torch.Tensor] = []
        self._lock = threading.Lock()
        # what went through this staging (tests and benchmarks read it): chunks sent through ring
        # slots (of decoded values; of device-decoded records only), records decoded on the device,
        # tensors uploaded for them, records staged one by one, chunks sent compressed (their zstd
        # frames decoded by ``decoder``)
        self.counts = {"chunks": 0, "device_chunks": 0, "device_decoded": 0, "uploads": 0, "records": 0,
                       "compressed_chunks": 0}  # fmt: skip

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def _keep(self, host: torch.Tensor) -> None:
        with self._lock:
            self._hosts.append(host)

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
        with self.ring.on_stream():
            out = torch.empty(host.shape, dtype=host.dtype, device=device)
        self._send(host, out)
        return out

    def copy_into(self, record, dest: torch.Tensor) -> None:
        """Decode ``record`` (a stored tensor: ``copy_into(dest)``) into ``dest``: on the device
        when the record can (``device_decode``), else through a host tensor of its own."""
        if not self.active:
            record.copy_into(dest)
            return
        if record.device_decode:
            self._count("device_decoded")
            with self.ring.on_stream():
                record.copy_into(dest, stage=self.upload)
            return
        self._count("records")
        host = self.host_like(tuple(dest.shape), dest.dtype)
        record.copy_into(host)
        self._send(host, dest)

    def load_chunks(
        self, chunks: Sequence[Sequence[tuple[Any, torch.Tensor]]], threads: int, frames: Sequence[Any] | None = None
    ) -> tuple[int, BaseException | None]:
        """Decode each chunk's ``(record, dest)`` pairs and send them, chunk after chunk, through
        the ring (see the module docstring); records that decode on the device go that way instead.
        ``frames``: each chunk's frame whose checksum is still to be verified, or None: verified
        while its records are copied into the slot (:mod:`kvstore.store.fused`; a chunk with
        device-decoded records: before). A chunk is sent only once every record of it decoded and
        its checksum matched: at the first chunk that fails, nothing of that chunk or the later
        ones is sent (its device-decoded records may have written their slots: the caller
        recomputes those). Chunks decode a few at a time (one per thread where the ring has slots
        for them). Returns ``(chunks sent, the first error or None)``; the ring is released
        however this ends."""
        frames = list(frames) if frames is not None else [None] * len(chunks)
        wave = max(1, min(threads, len(self.ring.slots) - 1))
        with self.ring.lock:
            for first in range(0, len(chunks), wave):
                js = range(first, min(first + wave, len(chunks)))
                preps = [self._prepare(chunks[j], frames[j], threads) for j in js]
                try:
                    failed = self._decode_wave(preps, threads)
                    for j, prep, err in zip(js, preps, failed):
                        if err is not None:
                            return j, err
                        if prep.slot is not None:
                            err = self._send_chunk(prep)
                            prep.slot = None
                            if err is not None:
                                return j, err
                finally:
                    for prep in preps:
                        if prep.slot is not None:  # not sent: copies its device-decoded records queued may read it
                            self.ring.release(prep.slot)
        return len(chunks), None

    def _send_chunk(self, prep: _Chunk) -> BaseException | None:
        """Send ``prep``'s slot; a chunk crossing compressed is then decoded on the device (its
        error, a frame that does not decode, is returned: nothing of it reached its places)."""
        assert prep.slot is not None
        self.ring.send(prep.slot, prep.used, prep.places)
        if prep.compressed is None:
            self._count("chunks" if prep.places else "device_chunks")
            return None
        assert self.decoder is not None
        try:
            with self.ring.on_stream():
                device_zstd.decode_into(prep.compressed, prep.slot.device, self.decoder)
        except CorruptEntryError as exc:
            return exc
        self._count("compressed_chunks")
        return None

    def _prepare(self, pairs: Sequence[tuple[Any, torch.Tensor]], frame: Any, threads: int) -> _Chunk:
        staged = [(rec, dest) for rec, dest in pairs if not rec.device_decode]
        on_device = [(rec, dest) for rec, dest in pairs if rec.device_decode]
        compressed = device_zstd.plan(staged) if self.decoder is not None and staged and not on_device else None
        if compressed is not None:
            return self._prepare_compressed(compressed, frame)
        offsets, used = _layout([dest for _, dest in staged])
        # a device-decoded record uploads fewer bytes than its decoded values take (codes of 1 byte
        # or less per value, a few scales): its values' size bounds its share
        _, reserve = _layout([dest for _, dest in on_device])
        slot = self.ring.acquire(used + reserve) if pairs else None
        prep = _Chunk(slot, used, [(off, dest) for (_, dest), off in zip(staged, offsets)], frame)
        if slot is None:
            return prep
        if on_device:
            uploads = SlotUploads(self, slot, used, used + reserve)
            prep.device = [functools.partial(self._decode_on_device, rec, dest, uploads) for rec, dest in on_device]
        prep.work, prep.tasks = _decode_tasks(staged, offsets, slot.host, threads, None if on_device else frame)
        return prep

    def _prepare_compressed(self, compressed: device_zstd.Compressed, frame: Any) -> _Chunk:
        """A chunk whose stored bytes cross as they are: copied into its slot (hashed as they are
        copied, when ``frame`` is still to be verified), decoded on the device once sent."""
        slot = self.ring.acquire(compressed.used)
        prep = _Chunk(slot, compressed.used, [], frame, compressed=compressed)
        dst = slot.host.data_ptr() + compressed.at
        if frame is not None:
            work = fused.ChunkWork(frame)
            work.copy(dst, compressed.start - work.base, compressed.nbytes)
            if work.seal():
                prep.work = work
                return prep
        prep.tasks = [functools.partial(ctypes.memmove, dst, compressed.start, compressed.nbytes)]
        return prep

    def _decode_wave(self, preps: Sequence[_Chunk], threads: int) -> list[BaseException | None]:
        """Decode the chunks ``preps`` into their slots; per chunk its first error, or None. A
        chunk not verified while it is copied is verified before anything of it is decoded."""
        first = [i for i, p in enumerate(preps) if p.frame is not None and p.work is None]
        failed: list[BaseException | None] = [None] * len(preps)
        for i, err in zip(first, run_all([functools.partial(verify_checksum, preps[i].frame) for i in first], threads)):
            failed[i] = err
        todo = [i for i, p in enumerate(preps) if failed[i] is None and p.slot is not None]
        tasks = [(i, fn) for i in todo for fn in preps[i].device + preps[i].tasks]
        for (i, _), err in zip(tasks, run_all([fn for _, fn in tasks], threads)):
            if err is not None and failed[i] is None:
                failed[i] = err
        works = [(i, w) for i in todo if (w := preps[i].work) is not None]
        for (i, work), err in zip(works, fused.run([w for _, w in works], threads)):
            failed[i] = err if err is not None else run_all([work.check], 1)[0]
        return failed

    def _decode_on_device(self, record, dest: torch.Tensor, uploads: SlotUploads) -> None:
        self._count("device_decoded")
        with self.ring.on_stream():
            record.copy_into(dest, stage=uploads)

    def finish(self) -> None:
        """Order the compute stream after every queued copy and device decode; release the host
        tensors of their own once their copies are done (the ring's slots wait for their events)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            if self._hosts:
                self.stream.synchronize()  # the pinned sources must outlive their copies
        self._hosts.clear()


def _decode(record, host: torch.Tensor, offset: int, like: torch.Tensor) -> None:
    record.copy_into(_view(host, offset, like.shape, like.dtype))


PIECE = 1 << 20  # bytes: the smallest piece of a run of raw bytes a thread copies


def _plain(record, dest: torch.Tensor) -> torch.Tensor | None:
    """The stored bytes of ``record`` when it is ``dest``'s values as they are (a ``raw`` record:
    one 1-D uint8 view of the payload), else None."""
    source = record.raw_bytes()
    if source is None:
        return None
    if tuple(record.shape) != tuple(dest.shape) or record.dtype != dest.dtype or not source.is_contiguous():
        return None
    return source if source.numel() == dest.numel() * dest.element_size() else None


@dataclasses.dataclass
class _Chunk:
    """One chunk on its way through the ring: its slot (None once sent), the bytes it uses, where
    each staged record's bytes go (``(offset in the slot, dest)``), its unverified frame, what
    decodes it into the slot (``work``, hashing as it copies; else ``tasks``) and the tasks of its
    device-decoded records."""

    slot: Slot | None
    used: int
    places: list[tuple[int, torch.Tensor]]
    frame: Any
    work: fused.ChunkWork | None = None
    tasks: list[Any] = dataclasses.field(default_factory=list)
    device: list[Any] = dataclasses.field(default_factory=list)
    compressed: device_zstd.Compressed | None = None


def _decode_tasks(staged: Sequence[tuple[Any, torch.Tensor]], offsets: Sequence[int], host: torch.Tensor,
                  threads: int, frame: Any = None) -> tuple[fused.ChunkWork | None, list[Any]]:  # fmt: skip
    """What decodes ``staged`` into ``host`` at ``offsets``: records whose bytes lie end to end in
    the store and in the slot (a ``raw`` chunk: all of its keys and values) make one run, copied as
    one memcpy cut into a piece per thread; every other record decodes on its own. With ``frame``
    (the chunk's, unverified): ``(its work, [])``, the run copied block by block and hashed as it
    goes (:class:`kvstore.store.fused.ChunkWork`); without one, or when a record's bytes are not all the
    frame's: ``(None, the tasks)``."""
    tasks: list[Any] = []
    work = fused.ChunkWork(frame) if frame is not None else None
    run: list[tuple[torch.Tensor, int]] = []  # (stored bytes, offset in the slot)

    def flush() -> None:
        if not run:
            return
        first, start = run[0]
        nbytes = run[-1][1] + run[-1][0].numel() - start
        if work is not None:  # its tasks are made only when the work cannot be sealed (below)
            work.copy(host.data_ptr() + start, first.data_ptr() - work.base, nbytes)
            run.clear()
            return
        span = first.as_strided((nbytes,), (1,))  # the run's bytes: one view of the payload
        share = -(-nbytes // max(threads, 1))  # bytes per thread, rounded up
        step = max(PIECE, -(-share // ALIGN) * ALIGN)
        tasks.extend(
            functools.partial(torch.Tensor.copy_, host[start + a : start + min(a + step, nbytes)], span[a : a + step])
            for a in range(0, nbytes, step)
        )
        run.clear()

    for (rec, dest), off in zip(staged, offsets):
        source = _plain(rec, dest)
        if source is None:
            flush()
            tasks.append(functools.partial(_decode, rec, host, off, dest))
            if work is not None:
                work.record(rec, tasks[-1])
            continue
        if run:
            prev, prev_off = run[-1]
            follows = (
                source.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
                and source.storage_offset() == prev.storage_offset() + prev.numel()
                and off == prev_off + prev.numel()
            )
            if not follows:
                flush()
        run.append((source, off))
    flush()
    if work is None:
        return None, tasks
    return (work, []) if work.seal() else _decode_tasks(staged, offsets, host, threads)


__all__ = ["SlotUploads", "Staging"]
