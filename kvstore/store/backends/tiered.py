"""A local LMDB tier in front of a remote backend: read-through, write-through, LRU-bounded.

``open_backend(url, cache_dir=DIR, cache_size=BYTES)`` (``--cache-dir`` / ``--cache-size`` in the
CLI) opens the remote store ``url`` (any backend: ``s3://...``, a shared LMDB path...) behind an
LMDB environment in ``DIR`` that holds at most ``BYTES`` of values:

* **reads** look in the tier first. A value of at least ``SMALL`` bytes found there is served
  without asking the remote (an entry's key names its content, so a cached entry never goes
  stale); smaller values (the store's description, access times) are read from the remote
  whenever it answers, and from the tier when it does not. Whatever comes from the remote is
  copied into the tier. A value the remote no longer has is dropped from the tier.
* **writes** go to the remote first, then into the tier; deletes remove from both.
* **faults stay local**: the tier's copies are only a cache. :meth:`TieredBackend.origin` is the
  remote, :meth:`~TieredBackend.local_copy` the tier's copy of a value and
  :meth:`~TieredBackend.drop_local` forgets copies, so that a store drops a copy that fails its
  checksum and reads the remote's (which refills the tier), and verifies and removes by the
  remote's copy alone. ``contains`` asks the remote while it answers (a value may be gone there
  while the tier still holds a copy).
* **bounds**: before a value goes in, the least recently used values go out until the values
  held (plus the new one) fit in ``max_bytes`` (values under ``SMALL`` bytes go last: they cost
  next to nothing and let the tier open offline); a value larger than that is not cached. The
  LMDB file keeps its size (LMDB reuses freed pages), so the directory stays near ``max_bytes``.
  The bound is exact for one process; processes sharing a tier may overshoot by a value each.
* **offline**: when the remote cannot be reached at open, the tier still answers every value it
  holds (with a :class:`kvstore.errors.StoreOfflineWarning`); anything else, listings and writes
  raise the remote's :class:`kvstore.errors.StoreUnavailableError`.

One tier belongs to one remote store: it records the remote's URL and refuses another.
Local layout: ``v/KEY`` the cached value, ``i/KEY`` its last use and size (``<dQ``), ``remote``.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvstore.errors import ReadOnlyStoreError, StoreError, StoreOfflineWarning, StoreUnavailableError
from kvstore.store.backends.base import Backend, BackendBase
from kvstore.store.backends.lmdb import LMDBBackend
from kvstore.store.backends.url import open_url

SMALL = 64 << 10  # values below this are re-read from the remote while it answers
_V, _I, _REMOTE = b"v/", b"i/", b"remote"
_RECORD = struct.Struct("<dQ")  # last use (epoch seconds), size in bytes


class TieredBackend(BackendBase):
    """The remote store ``url`` behind an LMDB tier in ``cache_dir`` of at most ``max_bytes``
    (see the module docstring). ``readonly`` applies to the remote (the tier is always filled);
    ``create`` and ``remote_options`` go to the remote's :func:`~kvstore.store.backends.url.open_url`.
    Raises StoreError when the tier belongs to another store, and the remote's errors (except
    unavailability)."""

    local = False  # a miss asks the remote: not cheap enough for planning's many probes

    def __init__(
        self,
        url: str,
        cache_dir: str | Path,
        *,
        max_bytes: int,
        readonly: bool = False,
        create: bool = True,
        **remote_options,
    ):
        self.url = str(url)
        self.readonly = readonly
        self.max_bytes = int(max_bytes)
        self.cache_dir = Path(cache_dir).expanduser()
        self._lock = threading.Lock()
        self.tier = LMDBBackend(self.cache_dir, sync=False)  # a cache: losing its last writes is harmless
        self.remote: Backend | None = None
        self.offline: StoreUnavailableError | None = None
        try:
            owner = self.tier.get(_REMOTE)
            if owner is None:
                self.tier.put(_REMOTE, self.url.rstrip("/").encode())
            elif owner.decode(errors="replace") != self.url.rstrip("/"):
                raise StoreError(
                    f"cache directory {self.cache_dir} holds a tier of {owner.decode(errors='replace')}, not of "
                    f"{self.url}; give each store its own --cache-dir"
                )
            try:
                self.remote = open_url(self.url, readonly=readonly, create=create, **remote_options)
            except StoreUnavailableError as exc:
                self.offline = exc
                warnings.warn(
                    f"{exc}; answering from the local cache {self.cache_dir} only",
                    StoreOfflineWarning,
                    stacklevel=2,
                )
        except BaseException:
            self.tier.close()
            raise

    # -- the tier -----------------------------------------------------------------------------------
    def _up(self) -> Backend:
        """The remote, or the unavailability error it gave at open."""
        if self.remote is None:
            assert self.offline is not None
            raise self.offline
        return self.remote

    def _cached_len(self, key: bytes) -> int | None:
        got = self.tier.peek(_V + key, 0)
        return None if got is None else got[1]

    def _touch(self, key: bytes, size: int) -> None:
        with contextlib.suppress(StoreError):  # bookkeeping only
            self.tier.put(_I + key, _RECORD.pack(time.time(), size))

    def held(self) -> dict[bytes, tuple[float, int]]:
        """Every cached key -> (last use, size in bytes)."""
        names = list(self.tier.keys(_I))
        out = {}
        for name, raw in zip(names, self.tier.get_many(names)):
            if raw is not None and len(raw) == _RECORD.size:
                out[name[len(_I) :]] = _RECORD.unpack(raw)
        return out

    def _store(self, key: bytes, value: bytes | memoryview) -> None:
        """Copy ``value`` into the tier, evicting least recently used values to make room."""
        size = len(value)
        if size > self.max_bytes:
            return
        with self._lock:
            held = self.held()
            held.pop(key, None)
            used = sum(s for _, s in held.values())
            victims = []
            # large values go first, least recently used first; small ones (the description, access
            # times) cost next to nothing and let the tier open while the remote is down
            for k, (_, s) in sorted(held.items(), key=lambda kv: (kv[1][1] < SMALL, kv[1][0])):
                if used + size <= self.max_bytes:
                    break
                victims.append(k)
                used -= s
            if victims:
                self.tier.delete_many([_V + k for k in victims] + [_I + k for k in victims])
            self.tier.put_many([(_V + key, value), (_I + key, _RECORD.pack(time.time(), size))])  # type: ignore[list-item]

    def _drop(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        if keys:
            self.tier.delete_many([_V + k for k in keys] + [_I + k for k in keys])

    # -- reads --------------------------------------------------------------------------------------
    def read_ahead(self) -> contextlib.AbstractContextManager[None]:
        return self.tier.read_ahead()  # the local tier's copies are read from its map

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        size = self._cached_len(key)
        if size is not None and (size >= SMALL or self.remote is None):
            self._touch(key, size)
            with self.tier.view(_V + key) as buf:
                if buf is not None:
                    yield buf
                    return
        remote = self._up()
        with contextlib.ExitStack() as stack:
            try:
                buf = stack.enter_context(remote.view(key))
            except StoreUnavailableError:
                if size is None:
                    raise
                buf = stack.enter_context(self.tier.view(_V + key))  # the remote went away: serve the tier's copy
            else:
                if buf is not None:
                    self._store(key, buf)
                elif size is not None:
                    self._drop([key])  # deleted from the remote: drop it here too
            yield buf

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Have the remote start loading the keys this tier does not hold (see
        :meth:`kvstore.store.backends.s3.S3Backend.prefetch`); a later :meth:`view` takes them."""
        if self.remote is not None:
            self.remote.prefetch([k for k in keys if self._cached_len(k) is None])

    def get(self, key: bytes) -> bytes | None:
        with self.view(key) as buf:
            return None if buf is None else bytes(buf)

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        keys = list(keys)
        sizes = [self._cached_len(k) for k in keys]
        out: list[bytes | None] = [None] * len(keys)
        ask = [i for i, s in enumerate(sizes) if s is None or (s < SMALL and self.remote is not None)]
        for i in sorted(set(range(len(keys))) - set(ask)):
            out[i] = self.get(keys[i])
        if ask:
            try:
                got = self._up().get_many([keys[i] for i in ask])
            except StoreUnavailableError:
                if any(sizes[i] is None for i in ask):
                    raise
                got = [self.tier.get(_V + keys[i]) for i in ask]
            else:
                for i, value in zip(ask, got):
                    if value is not None:
                        self._store(keys[i], value)
                    elif sizes[i] is not None:
                        self._drop([keys[i]])
            for i, value in zip(ask, got):
                out[i] = value
        return out

    def peek(self, key: bytes, n: int) -> tuple[bytes, int] | None:
        size = self._cached_len(key)
        if size is not None and (size >= SMALL or self.remote is None):
            return self.tier.peek(_V + key, n)
        return self._up().peek(key, n)

    def contains(self, key: bytes) -> bool:
        if self.remote is None:  # offline: what the tier holds
            return self._cached_len(key) is not None
        return self.remote.contains(key)

    # -- the copies ---------------------------------------------------------------------------------
    def origin(self) -> Backend:
        """The remote (its StoreUnavailableError while it was unreachable at open)."""
        return self._up()

    @contextlib.contextmanager
    def local_copy(self, key: bytes) -> Iterator[memoryview | None]:
        """The tier's copy of ``key`` (None when it holds none), without asking the remote."""
        with self.tier.view(_V + key) as buf:
            yield buf

    def drop_local(self, keys: Iterable[bytes]) -> int:
        """Forget the tier's copies of ``keys`` (the remote's stay); returns how many it held."""
        held = [k for k in keys if self._cached_len(k) is not None]
        self._drop(held)
        return len(held)

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        return self._up().keys(prefix)  # only the remote knows everything it holds

    # -- writes -------------------------------------------------------------------------------------
    def _writable(self) -> Backend:
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.url} was opened read-only")
        return self._up()

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        self._writable().put(key, value)
        self._store(key, value)

    def put_if_absent(self, key: bytes, value: bytes | memoryview) -> bool:
        stored = self._writable().put_if_absent(key, value)
        if stored:
            self._store(key, value)
        return stored

    def put_many_if_absent(self, items: Iterable[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        items = list(items)
        stored = self._writable().put_many_if_absent(items)
        for (key, value), done in zip(items, stored):
            if done:
                self._store(key, value)
        return stored

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        items = list(items)
        self._writable().put_many(items)
        for key, value in items:
            self._store(key, value)

    def delete(self, key: bytes) -> bool:
        found = self._writable().delete(key)
        self._drop([key])
        return found

    def delete_many(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)
        n = self._writable().delete_many(keys)
        self._drop(keys)
        return n

    def close(self) -> None:
        try:
            if self.remote is not None:
                self.remote.close()
        finally:
            self.tier.close()
