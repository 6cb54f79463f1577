"""The build writer: encodes and writes chunks and context records on a background thread.

:class:`BuildReport` counts what a build did; :class:`Writer` is the store side of building and
decoding (computed chunks go through it, so compute never waits on compression or the store
except past its byte budget).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.model import chains
from kvstore.model.cache import LayerKV
from kvstore.model.chains import ContextPlan
from kvstore.store.entry import Entry
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

# Bytes of KV waiting for the writer (a chunk larger than this still passes, alone): bounds the
# memory a fast prefill can pile up while letting compute run a batch or two ahead of the writer.
WRITER_BYTES = 1 << 30


@dataclass
class BuildReport:
    """What :meth:`Adapter.generate_kv_cache` did. Sizes are bytes; times are seconds."""

    contexts: int = 0  # contexts given (with duplicates)
    distinct: int = 0  # in this shard
    other_shards: int = 0  # distinct contexts left to the other shards
    built: int = 0  # contexts computed (whole or from a stored prefix)
    skipped: int = 0  # already stored whole and intact
    failed: int = 0
    tokens: int = 0  # context tokens run through the model
    tokens_reused: int = 0  # context tokens found stored (skipped contexts and stored prefixes)
    migrated: int = 0  # contexts found as format-1 entries and rewritten as chains (nothing recomputed)
    chunks_written: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    store_seconds: float = 0.0  # encode + write, on the writer thread (overlaps compute)
    store_wait_seconds: float = 0.0  # time the compute thread waited for the writer
    errors: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # key of each given context, in input order

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "keys"}
        return d | {"ratio": round(self.ratio, 4), "tokens_per_second": round(self.tokens_per_second, 1)}


@dataclass(frozen=True)
class _Record:
    key: str
    chunks: tuple[str, ...]
    n_tokens: int


class Writer:
    """Encodes and writes chunks, then context records, on a background thread (in the order
    given) so that storing overlaps compute. A chunk already in the store is not rewritten unless
    asked (a corrupt one is). Errors are re-raised on the caller's thread (next ``put`` or
    ``close``)."""

    def __init__(self, store: KVStore, report: BuildReport | None, max_bytes: int | None = None):
        self.store, self.report = store, report
        self.q: queue.Queue = queue.Queue()
        self.max_bytes = WRITER_BYTES if max_bytes is None else max_bytes
        self.pending = 0  # bytes queued and not written yet
        self.room = threading.Condition()
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
                    self.pending -= nbytes
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
        if self.report is not None:
            r = self.report
            r.stored_bytes += len(blob)
            r.raw_bytes += item.kv_bytes + item.state_bytes + 8 * item.n_tokens
            r.store_seconds += time.perf_counter() - t0
            r.chunks_written += 1

    def put(self, entry: Entry, *, overwrite: bool = False) -> None:
        self._enqueue((entry, overwrite))

    def put_encoded(self, entry: Entry, blob: bytes, *, overwrite: bool = False) -> None:
        """Write ``blob``, already encoded from ``entry`` with the store's codec."""
        self._enqueue((entry, overwrite, blob))

    def put_context(self, plan: ContextPlan) -> None:
        """Record ``plan``'s context once the chunks put before it are written."""
        self._enqueue((_Record(plan.key, plan.keys, plan.n_tokens), True))

    def put_chunks(
        self,
        adapter: ModelHandle,
        plan: ContextPlan,
        layers: LayerKV,
        depth: int = 0,
        offset: int = 0,
        record: bool = True,
    ) -> None:
        """Chunks ``depth..`` of ``plan`` from ``layers`` (positions ``offset..``), then (with
        ``record``) its context record. The chunk at ``depth`` is written even if present: it is
        missing or corrupt (a repair)."""
        for i, entry in enumerate(chains.chunk_entries(adapter, plan, layers, depth, offset)):
            self.put(entry, overwrite=i == 0)
        if record:
            self.put_context(plan)

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
            while self.pending and self.pending + nbytes > self.max_bytes and self.error is None:
                self.room.wait(0.5)
            self.pending += nbytes
        self.q.put((item, nbytes))
        if self.report is not None:
            self.report.store_wait_seconds += time.perf_counter() - t0

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        t0 = time.perf_counter()
        self.q.put((None, 0))
        self.thread.join()
        if self.report is not None:
            self.report.store_wait_seconds += time.perf_counter() - t0
        self._check()


__all__ = ["WRITER_BYTES", "BuildReport", "Writer"]
