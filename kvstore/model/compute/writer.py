"""The writer: encodes and writes chunks and context records on a background thread.

:class:`Writer` is the store side of building, sampling and scoring: computed chunks go through
it, so compute never waits on compression or the store except past its byte budget. It knows
which chunks it holds and has not written yet (:meth:`Writer.unwritten`), so a batch planned while
it works sees them (:mod:`kvstore.model.plan.batch`) and waits for them before loading
(:meth:`Writer.wait_for`) instead of computing them again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.model.compute.cache import LayerKV
from kvstore.model.plan import chains
from kvstore.model.plan.chains import Chain
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


class Writer:
    """Encodes and writes chunks, then context records, on a background thread (in the order
    given) so that storing overlaps compute. A chunk already in the store is not rewritten unless
    asked (a corrupt one is). Errors are re-raised on the caller's thread (next ``put``, ``flush``
    or ``close``); :attr:`stats` counts what was written."""

    def __init__(self, store: KVStore, max_bytes: int | None = None):
        self.store = store
        self.stats = WriteStats()
        self.q: queue.Queue = queue.Queue()
        self.max_bytes = WRITER_BYTES if max_bytes is None else max_bytes
        self.queued_bytes = 0  # bytes queued and not written yet
        self.room = threading.Condition()
        self._queued: dict[str, int] = {}  # chunk key -> puts of it queued and not done (under room)
        self.error: BaseException | None = None
        self.lost: list[str] = []  # contexts recorded while a concurrent gc removed chunks of theirs
        self.thread = threading.Thread(target=self._run, name="kvstore-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item, nbytes = self.q.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    self._write(*item)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                self.error = exc
            finally:
                with self.room:
                    self.queued_bytes -= nbytes
                    if item is not None and isinstance(item[0], Entry):
                        key = item[0].key
                        self._queued[key] -= 1
                        if not self._queued[key]:
                            del self._queued[key]
                    self.room.notify_all()
                self.q.task_done()

    def _write(self, item: Entry | _Record, overwrite: bool, blob: bytes | None = None) -> None:
        if isinstance(item, _Record):
            if self.store.put_context(item.key, item.chunks, item.n_tokens):  # names the chunks gone meanwhile
                self.lost.append(item.key)
            return
        if not overwrite and self.store.contains(item.key):
            return
        t0 = time.perf_counter()
        if blob is None:
            blob = self.store.encode(item)
        self.store.put_bytes(item.key, blob)
        s = self.stats
        s.stored_bytes += len(blob)
        s.raw_bytes += item.kv_bytes + item.state_bytes + 8 * item.n_tokens
        s.store_seconds += time.perf_counter() - t0
        s.chunks_written += 1

    def put(self, entry: Entry, *, overwrite: bool = False) -> None:
        self._enqueue((entry, overwrite))

    def put_encoded(self, entry: Entry, blob: bytes, *, overwrite: bool = False) -> None:
        """Write ``blob``, already encoded from ``entry`` with the store's codec."""
        self._enqueue((entry, overwrite, blob))

    def put_context(self, chain: Chain) -> None:
        """Record ``chain``'s context once the chunks put before it are written."""
        self._enqueue((_Record(chain.key, chain.keys, chain.n_tokens), True))

    def put_chunks(
        self, handle: ModelHandle, chain: Chain, layers: LayerKV, depth: int = 0, offset: int = 0,
        record: bool = True,
    ) -> None:  # fmt: skip
        """Chunks ``depth..`` of ``chain`` from ``layers`` (positions ``offset..``), then (with
        ``record``) its context record. The chunk at ``depth`` is written even if present: it is
        missing or corrupt (a repair)."""
        for i, entry in enumerate(chains.chunk_entries(handle, chain, layers, depth, offset)):
            self.put(entry, overwrite=i == 0)
        if record:
            self.put_context(chain)

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

    def _enqueue(self, item: Any) -> None:
        self._check()
        entry = item[0]
        nbytes = entry.kv_bytes + entry.state_bytes if isinstance(entry, Entry) else 0
        t0 = time.perf_counter()
        with self.room:  # wait while the writer holds a full budget (an oversized chunk goes alone)
            while self.queued_bytes and self.queued_bytes + nbytes > self.max_bytes and self.error is None:
                self.room.wait(0.5)
            self.queued_bytes += nbytes
            if isinstance(entry, Entry):
                self._queued[entry.key] = self._queued.get(entry.key, 0) + 1
        self.q.put((item, nbytes))
        self.stats.wait_seconds += time.perf_counter() - t0

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Write what is queued, stop the thread, raise the writer's error (if any)."""
        t0 = time.perf_counter()
        self.q.put((None, 0))
        self.thread.join()
        self.stats.wait_seconds += time.perf_counter() - t0
        self._check()


__all__ = ["WRITER_BYTES", "WriteStats", "Writer"]
