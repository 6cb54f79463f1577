"""The writer: encodes chunks on worker threads and writes them and context records, in order, on
a background thread.

:class:`Writer` is the store side of building, sampling and scoring: computed chunks go through
it, so compute never waits on compression or the store except past its byte budget. It knows
which chunks it holds and has not written yet (:meth:`Writer.unwritten`), so a batch planned while
it works sees them (:mod:`kvstore.model.plan.batch`) and waits for them before loading
(:meth:`Writer.wait_for`) instead of computing them again.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import LayerKV
from kvstore.model.io import chains
from kvstore.model.io.chains import Chain
from kvstore.model.io.offload import HostBuffers, Staged
from kvstore.store.entry import Entry
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

# Bytes of KV waiting for the writer (a chunk larger than this still passes, alone): bounds the
# memory a fast prefill can pile up while letting compute run a batch or two ahead of the writer.
WRITER_BYTES = 1 << 30


@dataclass
class WriteStats:
    """What a writer stored: chunks written, their raw and stored bytes, seconds spent encoding and
    writing (on the writer's thread, overlapping compute) and seconds the caller waited for it."""

    chunks_written: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    store_seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclass(frozen=True)
class _Record:
    key: str
    chunks: tuple[str, ...]
    n_tokens: int


@dataclass(frozen=True)
class _Owned:
    """An encoded entry a context owns (scores, a pressed cache), written as it is (``store.put``)."""

    blob: bytes


@dataclass
class _Job:
    """One put: a chunk (with its encoded bytes, their encoding in flight, or its staged copy), a
    context record, an owned entry, or None (stop)."""

    item: Entry | _Record | _Owned | None
    overwrite: bool
    blob: bytes | None = None
    staged: Staged | None = None
    future: Future | None = None

    @property
    def nbytes(self) -> int:
        return self.item.kv_bytes + self.item.state_bytes if isinstance(self.item, Entry) else 0

    def ready(self) -> bool:
        """Whether writing it waits for nothing (no encoding in flight)."""
        return self.future is None or self.future.done()


def encode_threads() -> int:
    """Default encoding threads of a writer: the CPU count, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


class Writer:
    """Encodes and writes chunks, then context records, in the order given, so that storing overlaps
    compute. Encoding runs on ``threads`` worker threads (several chunks at once: zstd and memcpy
    release the GIL; default: the CPU count, at most 8) and writing on the writer's own thread,
    strictly in order (a context record after its chunks). Chunks computed on an accelerator (or
    with the model handle's ``force_staging``) reach the host through reused pinned buffers
    (:mod:`kvstore.model.io.offload`) without blocking the next prefill. A chunk already in the
    store is not rewritten unless asked (a corrupt one is). Errors are re-raised on the caller's
    thread (next ``put``, ``flush`` or ``close``); :attr:`stats` counts what was written."""

    def __init__(self, store: KVStore, max_bytes: int | None = None, threads: int | None = None):
        self.store = store
        self.stats = WriteStats()
        self.q: queue.Queue = queue.Queue()
        self.max_bytes = WRITER_BYTES if max_bytes is None else max_bytes
        self.threads = encode_threads() if threads is None else max(1, threads)
        self.depth = 2 * self.threads  # chunks encoding or encoded and not written yet, at most
        self.pool = ThreadPoolExecutor(self.threads, "kvstore-encode") if self.threads > 1 else None
        self.host: HostBuffers | None = None  # made on the first staged chunk
        self.queued_bytes = 0  # bytes queued and not written yet
        self.room = threading.Condition()
        self._queued: dict[str, int] = {}  # chunk key -> puts of it queued and not done (under room)
        self.error: BaseException | None = None
        self.lost: list[str] = []  # contexts recorded while a concurrent gc removed chunks of theirs
        self.thread = threading.Thread(target=self._run, name="kvstore-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending: deque[_Job] = deque()  # started, in put order; written from the front only
        while True:
            try:
                job = self.q.get(block=not pending)
            except queue.Empty:  # nothing new: write the oldest (waiting for its encoding)
                self._finish(pending.popleft())
                continue
            if job.item is None:
                while pending:
                    self._finish(pending.popleft())
                self.q.task_done()
                return
            self._start(job)
            pending.append(job)
            while pending and (len(pending) > self.depth or pending[0].ready()):
                self._finish(pending.popleft())

    def _start(self, job: _Job) -> None:
        """Begin encoding ``job``'s chunk on the pool (unless it is stored already)."""
        item = job.item
        if self.error is not None or not isinstance(item, Entry) or job.blob is not None:
            return
        try:
            if not job.overwrite and self.store.contains(item.key):
                return
            job.future = self._submit(job)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            self.error = exc

    def _submit(self, job: _Job) -> Future:
        if self.pool is not None:
            return self.pool.submit(self._encode, job)
        done: Future = Future()
        try:
            done.set_result(self._encode(job))
        except BaseException as exc:  # noqa: BLE001 - raised when written
            done.set_exception(exc)
        return done

    def _encode(self, job: _Job) -> tuple[bytes, float]:
        staged = job.staged
        entry = staged.ready() if staged is not None else job.item
        assert isinstance(entry, Entry)
        try:
            t0 = time.perf_counter()
            return self.store.encode(entry), time.perf_counter() - t0
        finally:
            if staged is not None and self.host is not None:
                job.staged = None
                self.host.give(staged.buffer)

    def _finish(self, job: _Job) -> None:
        try:
            if job.future is not None:
                job.future.exception()  # wait: the encoding may still read a staged buffer
            if self.error is None:
                self._write(job)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            self.error = exc
        finally:
            self._unstage(job)
            self._release(job)
            self.q.task_done()

    def _unstage(self, job: _Job) -> None:
        """Give back the buffer of a staged chunk that was not encoded (stored already, or an error)."""
        staged, job.staged = job.staged, None
        if staged is not None and self.host is not None:
            staged.ready()
            self.host.give(staged.buffer)

    def _release(self, job: _Job) -> None:
        with self.room:
            self.queued_bytes -= job.nbytes
            if isinstance(job.item, Entry):
                key = job.item.key
                self._queued[key] -= 1
                if not self._queued[key]:
                    del self._queued[key]
            self.room.notify_all()

    def _write(self, job: _Job) -> None:
        item = job.item
        if isinstance(item, _Record):
            if self.store.put_context(item.key, item.chunks, item.n_tokens):  # names the chunks gone meanwhile
                self.lost.append(item.key)
            return
        if isinstance(item, _Owned):
            self.store.put(item.blob)
            return
        assert isinstance(item, Entry)
        if job.blob is None and job.future is None:  # stored already when it was started
            return
        if not job.overwrite and self.store.contains(item.key):  # an earlier put of it, written meanwhile
            return
        blob, seconds = (job.blob, 0.0) if job.future is None else job.future.result()
        assert blob is not None
        t0 = time.perf_counter()
        self.store.put(blob)
        s = self.stats
        s.stored_bytes += len(blob)
        s.raw_bytes += item.kv_bytes + item.state_bytes + 8 * item.n_tokens
        s.store_seconds += seconds + time.perf_counter() - t0
        s.chunks_written += 1

    def put(self, entry: Entry, *, overwrite: bool = False) -> None:
        self._enqueue(_Job(entry, overwrite))

    def put_encoded(self, entry: Entry, blob: bytes, *, overwrite: bool = False) -> None:
        """Write ``blob``, already encoded from ``entry`` with the store's codec."""
        self._enqueue(_Job(entry, overwrite, blob=blob))

    def put_owned(self, blob: bytes) -> None:
        """Write ``blob``, an encoded entry a context owns (any kind: its kind, owner and key are
        read from its frame), after what was put before it: its context's chunks and record."""
        self._enqueue(_Job(_Owned(blob), False))

    def put_context(self, chain: Chain) -> None:
        """Record ``chain``'s context once the chunks put before it are written."""
        self._enqueue(_Job(_Record(chain.key, chain.keys, chain.n_tokens), True))

    def put_chunks(
        self, handle: ModelHandle, chain: Chain, layers: LayerKV, depth: int = 0, offset: int = 0,
        record: bool = True,
    ) -> None:  # fmt: skip
        """Chunks ``depth..`` of ``chain`` from ``layers`` (positions ``offset..``), then (with
        ``record``) its context record. The chunk at ``depth`` is written even if present: it is
        missing or corrupt (a repair). From an accelerator (or with ``handle.force_staging``) each
        chunk is copied into a pinned host buffer without blocking (:mod:`kvstore.model.io.offload`)."""
        host = self._host_for(handle)
        for i, entry in enumerate(chains.chunk_entries(handle, chain, layers, depth, offset)):
            self._enqueue(_Job(entry, i == 0), host)
        if record:
            self.put_context(chain)

    def _host_for(self, handle: ModelHandle) -> HostBuffers | None:
        """The host buffers chunks of ``handle``'s model are staged through, or None (CPU)."""
        cuda = handle.device.type == "cuda" and torch.cuda.is_available()
        if not (cuda or handle.force_staging):
            return None
        if self.host is None or self.host.cuda != cuda:
            self.host = HostBuffers(cuda, keep=self.max_bytes)
        return self.host

    def unwritten(self, keys: Iterable[str]) -> frozenset[str]:
        """Which of ``keys`` are chunks put and not written yet."""
        with self.room:
            return frozenset(k for k in keys if k in self._queued)

    def wait_for(self, keys: Iterable[str]) -> None:
        """Wait until none of ``keys`` is waiting to be written (raises the writer's error, if any)."""
        wanted = set(keys)
        with self.room:
            while wanted & self._queued.keys() and self.error is None:
                self.room.wait(0.5)
        self._check()

    def flush(self) -> None:
        """Wait until everything put so far is written (raises the writer's error, if any)."""
        self.q.join()
        self._check()

    def _enqueue(self, job: _Job, host: HostBuffers | None = None) -> None:
        self._check()
        t0 = time.perf_counter()
        with self.room:  # wait while the writer holds a full budget (an oversized chunk goes alone)
            while self.queued_bytes and self.queued_bytes + job.nbytes > self.max_bytes and self.error is None:
                self.room.wait(0.5)
            self.queued_bytes += job.nbytes
            if isinstance(job.item, Entry):
                self._queued[job.item.key] = self._queued.get(job.item.key, 0) + 1
        if host is not None and isinstance(job.item, Entry):
            try:
                job.staged = host.stage(job.item)
            except BaseException:
                self._release(job)
                raise
        self.q.put(job)
        self.stats.wait_seconds += time.perf_counter() - t0

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Write what is queued, stop the thread, raise the writer's error (if any)."""
        t0 = time.perf_counter()
        self.q.put(_Job(None, False))
        self.thread.join()
        if self.pool is not None:
            self.pool.shutdown()
        self.stats.wait_seconds += time.perf_counter() - t0
        self._check()


__all__ = ["WRITER_BYTES", "WriteStats", "Writer", "encode_threads"]
