"""LMDB backend: the embedded default.

One store is one directory holding an LMDB environment (``data.mdb``, ``lock.mdb``). Many reader
processes may open it at once; writes are transactions, so a put is atomic and a crash keeps every
committed entry. Puts are durable (``sync=True``: the commit returns after the data reached the
disk) unless ``sync=False`` is passed. The memory map starts at ``map_size`` and doubles whenever it
fills; other processes adopt the new size on their next transaction.

Reads through :meth:`LMDBBackend.view` are zero-copy: the memoryview points into the map and stays
valid until the ``with`` block ends.

Handles on one directory in one process share its environment (:mod:`.lmdb_env`: LMDB allows one
per process), so a store can be opened any number of times; a forked child opens its own. A handle
used in a forked child (opened by its parent) raises one StoreError naming that rule, never a raw
``lmdb.Error``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb

from kvstore.errors import ReadOnlyStoreError, StoreError, StoreFullError, StoreNotFoundError
from kvstore.store.backends import lmdb_env
from kvstore.store.backends.base import BackendBase

DEFAULT_MAP_SIZE = 1 << 30  # 1 GiB of address space to start; grows by doubling
DISK_FULL_BYTES = 16 << 20  # a failed write with less free space than this is a full disk
KEYS_PAGE = 4096  # keys listed per read transaction


class LMDBBackend(BackendBase):
    local = True  # lookups cost microseconds: planning may probe for stored chunk tails

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        readonly: bool = False,
        create: bool = True,
        map_size: int | None = None,
        sync: bool = True,
        max_readers: int = 512,
    ):
        self.path = Path(path).expanduser()
        self.readonly = readonly
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"store path {self.path} is a file; give a directory (a store is a directory)")
        if not (self.path / "data.mdb").exists():
            if readonly or not create:
                raise StoreNotFoundError(f"no store at {self.path}; build one first with `kvstore build`")
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ReadOnlyStoreError(f"cannot create store directory {self.path}: {exc.strerror}") from None
        if not readonly and not os.access(self.path, os.W_OK):
            raise ReadOnlyStoreError(
                f"store {self.path} is not writable; fix its permissions, use another --store, "
                "or read it without storing anything (kvstore sample --readonly-store)"
            )
        size = map_size or DEFAULT_MAP_SIZE
        data = self.path / "data.mdb"
        if data.exists():
            size = max(size, data.stat().st_size)
        self._grow_lock = threading.Lock()
        self._sync = sync
        # handles on one directory share its environment (LMDB allows one per process)
        self._shared: lmdb_env.SharedEnv | None = lmdb_env.acquire(
            self.path, readonly=readonly, map_size=size, sync=sync, max_readers=max_readers
        )
        self.env = self._shared.env

    # -- helpers ------------------------------------------------------------------------------
    def _writable(self) -> None:
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only")

    def _begin(self, buffers: bool):
        try:
            return self.env.begin(buffers=buffers)
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)  # another process grew the map: adopt its size
            return self.env.begin(buffers=buffers)

    @contextlib.contextmanager
    def _read_txn(self, buffers: bool = False) -> Iterator:
        """A read transaction, counted as in progress (see :mod:`.lmdb_env`) until it ends."""
        with self._txns():
            txn = self._begin(buffers)
            try:
                yield txn
            finally:
                txn.abort()

    def _txns(self):
        if self._shared is None:
            raise StoreError(f"store {self.path} is closed")
        if self._shared.pid != os.getpid():
            raise StoreError(
                f"store {self.path} was opened in process {self._shared.pid} and used in its forked child "
                f"{os.getpid()}; an open store is not shared across fork(): open your own store in each process "
                "(KVStore(path) in the child)"
            )
        return self._shared.transaction()

    def _write(self, fn) -> None:
        """Run ``fn(txn)`` in a write transaction, growing the map and retrying when it is full."""
        self._writable()
        while True:
            try:
                try:
                    with self._txns(), self.env.begin(write=True) as txn:
                        fn(txn)
                    if self._sync and self._shared is not None and not self._shared.sync:
                        self.env.sync(True)  # shared with a handle that opened it without syncing
                    return
                except lmdb.MapResizedError:
                    self.env.set_mapsize(0)
                    continue
            except lmdb.MapFullError:
                with self._grow_lock:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                text = str(exc)
                full = "No space left" in text or getattr(exc, "errno", None) == errno.ENOSPC
                if not full and ("Permission denied" in text or "read-only" in text.lower()):
                    raise ReadOnlyStoreError(f"store {self.path} is not writable ({text})") from None
                # A disk that fills mid-commit makes write() return short, which LMDB reports as
                # EIO ("Input/output error"), not ENOSPC: ask the filesystem whether it is full.
                if full or self._disk_full():
                    raise StoreFullError(
                        f"disk full while writing to {self.path}; the entries stored before are intact - free space "
                        "and re-run"
                    ) from None
                raise StoreError(f"LMDB write failed in {self.path}: {text}") from None

    def _disk_full(self) -> bool:
        try:
            return shutil.disk_usage(self.path).free < DISK_FULL_BYTES
        except OSError:
            return False

    # -- protocol -----------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        with self._read_txn() as txn:
            return txn.get(key)

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        with self._read_txn(buffers=True) as txn:
            buf = txn.get(key)
            yield None if buf is None else memoryview(buf)

    @contextlib.contextmanager
    def read_ahead(self) -> Iterator[None]:
        if self._shared is None:
            yield
            return
        with self._shared.read_ahead():
            yield

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        with self._read_txn() as txn:
            return [txn.get(k) for k in keys]

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        self._write(lambda txn: txn.put(key, value))

    def put_if_absent(self, key: bytes, value: bytes | memoryview) -> bool:
        stored = []
        self._write(lambda txn: stored.append(txn.put(key, value, overwrite=False)))
        return bool(stored and stored[-1])

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        items = list(items)

        def fn(txn):
            for k, v in items:
                txn.put(k, v)

        self._write(fn)

    def put_many_if_absent(self, items: Iterable[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        items = list(items)
        stored: list[list[bool]] = []
        self._write(lambda txn: stored.append([bool(txn.put(k, v, overwrite=False)) for k, v in items]))
        return stored[-1] if stored else []

    def delete(self, key: bytes) -> bool:
        result = []
        self._write(lambda txn: result.append(txn.delete(key)))
        return bool(result and result[-1])

    def delete_many(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)
        result = []
        self._write(lambda txn: result.append(sum(bool(txn.delete(k)) for k in keys)))
        return result[-1] if result else 0

    def contains(self, key: bytes) -> bool:
        with self._read_txn(buffers=True) as txn:
            return txn.get(key) is not None

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        """Keys starting with ``prefix``, in order, read a page at a time (one short read
        transaction each, none held between pages: a listing of a million keys holds one page);
        keys written or deleted meanwhile may or may not be listed."""
        first = self._page(prefix, prefix, skip=False)  # the store's errors now, not at the first next()
        return self._pages(first, prefix)

    def _pages(self, page: list[bytes], prefix: bytes) -> Iterator[bytes]:
        while True:
            yield from page
            if len(page) < KEYS_PAGE:
                return
            page = self._page(page[-1], prefix, skip=True)

    def _page(self, start: bytes, prefix: bytes, *, skip: bool) -> list[bytes]:
        """Up to ``KEYS_PAGE`` keys with ``prefix`` from ``start`` on (``skip``: after it)."""
        found: list[bytes] = []
        with self._read_txn() as txn:
            cur = txn.cursor()
            if cur.set_range(start):
                for k in cur.iternext(keys=True, values=False):
                    if skip and k == start:
                        skip = False
                        continue
                    if not k.startswith(prefix) or len(found) >= KEYS_PAGE:
                        break
                    found.append(k)
        return found

    def disk_bytes(self) -> int:
        """Bytes the environment occupies on disk (LMDB files never shrink; freed pages are reused)."""
        data = self.path / "data.mdb"
        return data.stat().st_size if data.exists() else 0

    def close(self) -> None:
        """Give this handle's share of the environment back (the last handle closes it). In a
        forked child a handle inherited from the parent lets go without touching the environment
        (the fork closed the child's copy, or left it alone while a transaction was in progress)."""
        shared, self._shared = self._shared, None
        if shared is not None and shared.pid == os.getpid():
            lmdb_env.release(shared)
