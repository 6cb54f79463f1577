"""Copies that verify: a chunk's records copied or decoded into place while its frame's checksum is
computed over the stored bytes they read, so that each block is hashed right after its copy, still
in the CPU's cache (one pass over memory instead of two).

A chunk's :class:`ChunkWork` is a list of jobs in the order their bytes lie in the frame: a block of a
run of raw bytes copied by ``ctypes.memmove`` (:data:`BLOCK` bytes: no tensor call's overhead, and
it releases the GIL), or one record decoded from its bytes, planes and zstd frames (any callable).
Each job reads the frame's bytes ``[lo, hi)`` (the hull of what it reads; the hulls of a chunk's
jobs are disjoint). Once a job ran, the frame's bytes up to its ``hi`` are hashed, the bytes between
jobs (the frame's header, the payload's own header, padding) included. xxh3-64 is a streaming
hash, so a chunk is hashed in order: run by one thread (:func:`run`, where there are as many chunks
as threads) each job is hashed right after it ran; run by several, a job done ahead of its turn is
hashed when its turn comes, by the thread that hashes (:meth:`ChunkWork.feed`), while the others copy.

The checksum on disk is the one every store has (xxh3-64 of the frame, :mod:`kvstore.store.frame`):
nothing changes in the format, and old stores verify as before. :meth:`ChunkWork.check` raises
:class:`CorruptEntryError` unless every job ran and the digest matched: only then may the copied
bytes be used (sent to a device, or counted as loaded).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import operator
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xxhash

from kvstore.errors import CorruptEntryError
from kvstore.store.codecs.records import buffer_view
from kvstore.store.frame import TRAILER_BYTES

BLOCK = 256 << 10  # bytes of a run of raw bytes copied, then hashed, in one go (in L2 once copied)
# a one-off probe while writing this (issue 46; 2-core AMD EPYC, 64 MiB copied and hashed block by
# block on one thread against a 2-thread memcpy; not a committed result): 256 KiB blocks 0.85-0.9x,
# 1 MiB 0.75x (no longer in L2 when hashed), 64 KiB 0.8x (per-call overhead)

Job = tuple[Any, int, int, int, int, int]  # (callable or None: a memmove, lo, hi, dst, src, nbytes)


_BOUNDS = operator.itemgetter(1, 2)  # a job's (lo, hi)


def _blocks(job: Job) -> list[Job]:
    """A run of copies cut into jobs of :data:`BLOCK` bytes (its tail shorter); any other job as it is."""
    fn, lo, _, dst, src, n = job
    if fn is not None or n <= BLOCK:
        return [job]
    whole, block = n - n % BLOCK, BLOCK  # built by iterators: a 64 MiB run is 256 blocks, cut per chunk opened
    los, his = range(lo, lo + whole, block), range(lo + block, lo + whole + block, block)
    dsts, srcs = range(dst, dst + whole, block), range(src, src + whole, block)
    out = list(zip(itertools.repeat(None), los, his, dsts, srcs, itertools.repeat(block)))
    if whole < n:
        out.append((None, lo + whole, lo + n, dst + whole, src + whole, n - whole))
    return out


def address(buf: Any) -> int:
    """The address of the first byte of ``buf`` (bytes, memoryview, a contiguous CPU tensor)."""
    if isinstance(buf, torch.Tensor):
        return buf.data_ptr()
    return buffer_view(memoryview(buf)).data_ptr() if len(buf) else 0


def _span(part: Any, base: int, end: int) -> tuple[int, int] | None:
    if isinstance(part, torch.Tensor):
        if part.device.type != "cpu" or not part.is_contiguous():
            return None
        nbytes = part.numel() * part.element_size()
    elif isinstance(part, memoryview):
        if not part.contiguous:
            return None
        nbytes = part.nbytes
    else:  # bytes decompressed already (not the frame's)
        return None
    if nbytes == 0:
        return (0, 0)
    start = address(part) - base
    return (start, start + nbytes) if 0 <= start and start + nbytes <= end else None


def record_spans(record: Any, base: int, end: int) -> tuple[tuple[int, int], ...] | None:
    """The spans of the frame (address ``base``, ``end`` bytes before its trailer) that decoding
    ``record`` reads: its bytes, its planes, its zstd frames. None when any of them lies outside
    the frame (decompressed already) or the record is of a kind not known here (a quantized
    reader): such a chunk is verified before it is decoded."""
    from kvstore.store.codecs.records import TensorRecord
    from kvstore.store.codecs.split import SplitRecord

    parts: list[Any]
    if isinstance(record, SplitRecord):
        parts = [data for _, data, _, _ in record.pieces]
    elif type(record) is TensorRecord:
        if record.frames is not None:
            parts = [frame for frame, _ in record.frames]
        elif record.planes is not None:
            parts = list(record.planes)
        else:
            parts = [record.source]
    else:
        return None
    spans = [_span(p, base, end) for p in parts]
    if any(s is None for s in spans):
        return None
    return tuple(s for s in spans if s is not None and s[1] > s[0])


class ChunkWork:
    """One chunk's jobs and the digest of its frame ``buf`` (see the module docstring): add jobs
    with :meth:`copy` and :meth:`record`, then :meth:`seal` them; :func:`run` runs them;
    :meth:`check` says whether the chunk may be used."""

    def __init__(self, buf: Any):
        self.view = memoryview(buf).cast("B")
        self.base, self.end = address(buf), len(self.view) - TRAILER_BYTES
        self.jobs: list[Job] = []
        self.usable = self.end >= 0  # False: a job reads bytes not the frame's (verify first)
        self.cursor = 0  # jobs hashed so far
        self.pos = 0  # bytes of the frame hashed so far
        self.ready: list[bool] = []
        self.busy = False  # a thread is hashing (only it touches ``state`` and ``pos``)
        self.state = xxhash.xxh3_64()
        self.lock = threading.Lock()

    def copy(self, dst: int, start: int, nbytes: int) -> None:
        """Jobs copying the frame's bytes ``[start, start + nbytes)`` to the address ``dst`` (the
        caller's: at least ``nbytes`` writable bytes), a :data:`BLOCK` each (one entry until
        :meth:`seal` cuts it: a 64 MiB run is 256 blocks)."""
        if start < 0 or start + nbytes > self.end:
            self.usable = False
            return
        if nbytes:
            self.jobs.append((None, start, start + nbytes, dst, self.base + start, nbytes))

    def record(self, record: Any, fn: Callable[[], object]) -> None:
        """A job decoding ``record`` (``fn``) from the frame's bytes it reads."""
        spans = record_spans(record, self.base, self.end) if self.usable else None
        if spans is None:
            self.usable = False
            return
        lo, hi = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)
        self.jobs.append((fn, lo, hi, 0, 0, 0))

    def seal(self) -> bool:
        """Order the jobs as their bytes lie in the frame; False (nothing to run here: verify the
        frame first, then decode) when a job reads bytes not the frame's or two jobs' bytes
        overlap. Runs of copies are then cut into blocks."""
        if not self.usable:
            return False
        self.jobs.sort(key=_BOUNDS)
        his = [j[2] for j in self.jobs]
        if any(hi > job[1] for hi, job in zip(his, self.jobs[1:])):
            return False
        if any(j[0] is None and j[5] > BLOCK for j in self.jobs):
            self.jobs = [block for job in self.jobs for block in _blocks(job)]
        self.ready = [False] * len(self.jobs)
        return True

    def run_in_turn(self) -> None:
        """Run every job in order on this thread, each hashed right after it ran."""
        memmove, update, view = ctypes.memmove, self.state.update, self.view
        for fn, _, hi, dst, src, n in self.jobs:
            if fn is None:
                memmove(dst, src, n)
            else:
                fn()
            if hi > self.pos:
                update(view[self.pos : hi])
                self.pos = hi
        self.cursor = len(self.jobs)

    def run_job(self, k: int) -> None:
        """Run job ``k`` and feed it (from any thread)."""
        fn, _, _, dst, src, n = self.jobs[k]
        if fn is None:
            ctypes.memmove(dst, src, n)
        else:
            fn()
        self.feed(k)

    def feed(self, k: int) -> None:
        """Mark job ``k`` done; hash, in order, every job whose turn has come (unless another
        thread is hashing: it takes these too)."""
        with self.lock:
            self.ready[k] = True
            if self.busy:
                return
            self.busy = True
        while True:
            with self.lock:
                upto = self.cursor
                while upto < len(self.jobs) and self.ready[upto]:
                    upto += 1
                if upto == self.cursor:
                    self.busy = False
                    return
                hi = max(self.pos, self.jobs[upto - 1][2])
                self.cursor = upto
            if hi > self.pos:
                self.state.update(self.view[self.pos : hi])
                self.pos = hi

    def check(self) -> None:
        """Raise CorruptEntryError unless every job ran and the frame's digest matches its trailer
        (call once every job ran)."""
        if self.end < 0:
            raise CorruptEntryError("entry is truncated")
        if self.cursor != len(self.jobs) or self.busy:
            raise CorruptEntryError("entry was not read whole")
        if self.end > self.pos:
            self.state.update(self.view[self.pos : self.end])
            self.pos = self.end
        (want,) = struct.unpack_from("<Q", self.view, self.end)
        if self.state.intdigest() != want:
            raise CorruptEntryError("entry checksum mismatch (flipped or truncated bytes)")


def records_work(buf: Any, pairs: Sequence[tuple[Any, Any]], fns: Sequence[Callable[[], object]]) -> ChunkWork | None:
    """The sealed work of the frame ``buf`` whose jobs are ``fns`` (``fns[i]`` decodes the record
    of ``pairs[i]``, a ``(record, dest)`` pair); None when ``buf`` is None or a record's bytes
    are not all the frame's: then verify the frame before any of ``fns`` runs."""
    if buf is None:
        return None
    work = ChunkWork(buf)
    for (record, _), fn in zip(pairs, fns):
        work.record(record, fn)
    return work if work.seal() else None


def run(works: Sequence[ChunkWork], threads: int) -> list[BaseException | None]:
    """Run every chunk's jobs on ``threads`` threads; per chunk the first error it raised, or None
    (its later jobs do not run; :meth:`ChunkWork.check` then fails). Chunks of copies only (raw),
    as many as threads or more: one task per chunk, every job hashed right after it ran, no lock.
    Otherwise (fewer chunks than threads, or jobs that decode records: zstd), thread ``w`` starts
    on chunk ``w`` and takes its jobs in order; a thread whose chunk has no job left takes the next
    jobs of the next chunk that has some, so that no thread idles while another has work (a chunk
    of heavy jobs, a thread the system preempted); while one thread hashes a chunk (in order), the
    others run the jobs after it. A one-off A/B while writing this (issue 46; ``load_host``'s
    shape, 2,048 tokens, 2 threads, alternating on a loaded 2-core VM, medians of 9; not a
    committed result): raw 38.9 ms one task per chunk against 67.3 taking jobs; zstd-split:1:16
    407.7 against 192.5."""
    from kvstore.parallel import run_all

    copies_only = all(job[0] is None for w in works for job in w.jobs)
    if threads <= 1 or not works or (copies_only and len(works) >= threads):
        return run_all([w.run_in_turn for w in works], threads)
    errors: list[BaseException | None] = [None] * len(works)
    claimed = [0] * len(works)  # per chunk, the next job to take
    lock = threading.Lock()

    def take(start: int) -> tuple[int, int]:
        with lock:
            for d in range(len(works)):
                j = (start + d) % len(works)
                if claimed[j] < len(works[j].jobs) and errors[j] is None:
                    claimed[j] += 1
                    return j, claimed[j] - 1
        return -1, -1

    def worker(first: int) -> None:
        j = first % len(works)
        while True:
            j, k = take(j)
            if j < 0:
                return
            try:
                works[j].run_job(k)
            except BaseException as exc:  # noqa: BLE001 - handed back per chunk
                with lock:
                    errors[j] = errors[j] or exc

    for err in run_all([functools.partial(worker, w) for w in range(threads)], threads):
        if err is not None:
            raise err
    return errors


__all__ = ["BLOCK", "ChunkWork", "address", "record_spans", "records_work", "run"]
