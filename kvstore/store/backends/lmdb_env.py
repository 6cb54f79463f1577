"""One LMDB environment per store directory and process, shared by every handle on it.

LMDB forbids opening one environment twice in a process (its locks belong to the process and
file, so a second open would share them and closing it would drop them), and py-lmdb refuses
with "already open in this process". Yet a process may well hold several handles on one store:
a notebook opening ``KVStore(d)`` twice, lm-eval building a new model object for every
``simple_evaluate`` and never closing the last one. So handles share one ``lmdb.Environment``,
keyed by the directory's real path and reference-counted: :func:`acquire` opens it for the first
handle, :func:`release` closes it with the last.

The environment is opened for writing whenever the directory is writable, so that a read-only
handle and a writable one can share it (a read-only handle still refuses writes itself); on a
read-only directory it is opened read-only, without LMDB's lock file when even that cannot be
created.

**Fork.** An environment must not be used in a child process (LMDB ties its reader slots to the
process that opened it), and py-lmdb refuses to open the same files again while the inherited
copy exists. A child closes its inherited copy and opens its own, which is safe only when no
transaction of the parent's was in progress at the fork: closing ends the transactions the copy
knows of, and the reader slots of those belong to the parent. So every transaction is counted
here (cached read transactions are off: one would hold a reader slot between uses), the count is
read under the registry lock at the fork, and in the child an environment with none in progress
is closed (its files stay open in the parent) while one that had some is refused with one line.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import ReadOnlyStoreError, StoreError
from kvstore.process import LMDB  # the open environments and their lock (process-wide: see there)


@dataclass(eq=False)
class SharedEnv:
    """One open environment and the handles using it."""

    key: str  # the directory's real path
    env: Any  # lmdb.Environment
    writable: bool
    sync: bool
    pid: int
    users: int = 0
    active: int = 0  # transactions in progress (read and write)
    busy_at_fork: bool = False  # inherited from a parent that was inside a transaction when it forked
    reading_ahead: int = 0  # loads inside read_ahead() (the map's read-ahead is on while any is)
    mapped: tuple[int, list[tuple[int, int]]] | None = None  # (map size, where the map is) once found

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Count a transaction as in progress for its duration (see the module docstring)."""
        with LMDB.lock:
            self.active += 1
        try:
            yield
        finally:
            with LMDB.lock:
                self.active -= 1

    @contextlib.contextmanager
    def read_ahead(self) -> Iterator[None]:
        """The kernel's read-ahead on this environment's map while any load is inside: LMDB opens
        it with read-ahead off (random reads of a store larger than memory), so that a cold 64 MiB
        value came in 4 KiB page by 4 KiB page (~60 MB/s on the VM it was measured on)."""
        with LMDB.lock:
            self.reading_ahead += 1
            if self.reading_ahead == 1:
                advise(self._ranges(), MADV_NORMAL)
        try:
            yield
        finally:
            with LMDB.lock:
                self.reading_ahead -= 1
                if self.reading_ahead == 0:
                    advise(self._ranges(), MADV_RANDOM)  # as LMDB left it (readahead=False)

    def _ranges(self) -> list[tuple[int, int]]:
        """Where the map is (call under the lock): found once per map size (LMDB maps again only
        when the size changes: the store grew, here or in another process), ~0.6 ms each time."""
        size = self.env.info()["map_size"]
        if self.mapped is None or self.mapped[0] != size:
            self.mapped = (size, mapped_ranges(Path(self.key) / "data.mdb"))
        return self.mapped[1]


MADV_NORMAL, MADV_RANDOM = 0, 1  # Linux's madvise(2) advice values
_LIBC: list[Any] = []  # libc's madvise, looked up once ([None] where there is none)


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """``(address, length)`` of every mapping of the file ``path`` in this process, from
    /proc/self/maps (py-lmdb does not tell where its map is); none where there is no /proc."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    want, out = str(path), []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].rstrip("\n") == want:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi - lo))
    return out


def advise(ranges: list[tuple[int, int]], advice: int) -> int:
    """``madvise(advice)`` on each of ``ranges``; how many took it (none without madvise). A
    stale range (the map moved) gets advice that only ever changes read-ahead."""
    if not _LIBC:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _LIBC.append(fn)
    madvise = _LIBC[0]
    return 0 if madvise is None else sum(madvise(lo, n, advice) == 0 for lo, n in ranges)


def _open(path: Path, *, map_size: int, sync: bool, max_readers: int, writable: bool):
    try:
        return lmdb.open(
            str(path),
            map_size=map_size,
            subdir=True,
            readonly=not writable,
            lock=True,
            sync=sync,
            metasync=sync,
            readahead=False,
            meminit=False,
            max_readers=max_readers,
            max_spare_txns=0,  # a cached read transaction would hold a reader slot across a fork
        )
    except lmdb.Error as exc:
        if not writable and not os.access(path, os.W_OK):
            # a read-only directory cannot hold the lock file: read without LMDB's reader table
            return lmdb.open(str(path), readonly=True, lock=False, subdir=True, readahead=False, max_spare_txns=0)
        raise StoreError(f"cannot open store {path}: {exc}") from None


def acquire(path: Path, *, readonly: bool, map_size: int, sync: bool, max_readers: int) -> SharedEnv:
    """The environment of the store directory ``path`` (which holds ``data.mdb``, or is about to),
    opened for this handle or shared with the handles already using it. Raises StoreError when it
    cannot be opened, ReadOnlyStoreError when a writable handle asks for an environment that could
    only be opened read-only."""
    key = os.path.realpath(path)
    with LMDB.lock:
        shared = LMDB.envs.get(key)
        if shared is not None and shared.busy_at_fork:
            raise StoreError(
                f"store {path} was inside a transaction in the parent process when this process was forked, so "
                "it cannot be opened here; open it in a process started with spawn, or fork when no read or "
                "write is in progress"
            )
        if shared is None:
            data = path / "data.mdb"
            writable = os.access(path, os.W_OK) and (not data.exists() or os.access(data, os.W_OK))
            env = _open(path, map_size=map_size, sync=sync, max_readers=max_readers, writable=writable)
            shared = SharedEnv(key, env, writable, sync, os.getpid())
            LMDB.envs[key] = shared
        elif not readonly and not shared.writable:
            raise ReadOnlyStoreError(f"store {path} is not writable (it is open read-only in this process)")
        shared.users += 1
        return shared


def release(shared: SharedEnv) -> None:
    """One handle is done with ``shared``; the last one closes the environment."""
    with LMDB.lock:
        shared.users -= 1
        if shared.users > 0:
            return
        if LMDB.envs.get(shared.key) is shared:
            del LMDB.envs[shared.key]
    with contextlib.suppress(Exception):
        shared.env.close()


def open_count() -> int:
    """Environments open in this process (for tests)."""
    with LMDB.lock:
        return len(LMDB.envs)


def _before_fork() -> None:
    LMDB.lock.acquire()


def _after_fork_in_parent() -> None:
    LMDB.lock.release()


def _after_fork_in_child() -> None:
    inherited = list(LMDB.envs.values())
    LMDB.lock = threading.Lock()  # the parent's other threads, which might hold it, are gone
    for shared in inherited:
        if shared.active:
            # closing would end the parent's transactions in its reader table: leave it alone
            shared.busy_at_fork, shared.users, shared.active = True, 0, 0
            continue
        del LMDB.envs[shared.key]
        with contextlib.suppress(Exception):
            shared.env.close()  # this process's mapping and file handles only


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


__all__ = ["SharedEnv", "acquire", "advise", "mapped_ranges", "open_count", "release"]
