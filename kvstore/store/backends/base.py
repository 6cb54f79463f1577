"""The storage protocol every backend implements, and the defaults most of it derives from.

Required: ``get`` / ``put`` / ``delete`` / ``contains`` / ``keys`` / ``close``. Everything else has
a default in :class:`BackendBase` built on those: batched variants, zero-copy ``view``, ``peek``,
``put_if_absent``, and the optional features callers use without probing for them:

* ``local``: lookups cost microseconds (LMDB, memory), so planning may afford many probes
  (:func:`kvstore.model.io.chains.stored_tails`); False for a remote store or a tier in front of one.
* ``prefetch(keys)``: start loading values in the background; a no-op where loads are already
  cheap (only the S3 backend, and a tier in front of it, do something).
* ``read_ahead()``: a context in which values read through ``view`` are read whole (a chain's
  chunks): LMDB lets the kernel read ahead in its map meanwhile, so that a cold value comes in at
  the disk's sequential speed; a no-op elsewhere.
* ``disk_bytes()``: bytes the store occupies on this machine's disk, or None when that is not a
  file here (memory, S3, a tier's remote).
* ``origin()``, ``local_copy(key)``, ``drop_local(keys)``: the copies of a local tier
  (:mod:`~kvstore.store.backends.tiered`). ``origin()`` is the backend whose copies count (the
  backend itself; a tier's remote), ``local_copy(key)`` this machine's cached copy of a value
  without asking the origin (None: there is none), ``drop_local(keys)`` forgets such copies so that
  the next read asks the origin (how many went). A store uses them so that a fault of a local copy
  stays local: a copy that fails its checksum is dropped and the remote's read, never the remote's
  removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """The storage protocol. Values are bytes-like; ``view`` may lend zero-copy memory."""

    readonly: bool
    local: bool

    def get(self, key: bytes) -> bytes | None: ...
    def put(self, key: bytes, value: bytes | memoryview) -> None: ...
    def put_if_absent(self, key: bytes, value: bytes | memoryview) -> bool: ...
    def delete(self, key: bytes) -> bool: ...
    def contains(self, key: bytes) -> bool: ...
    def keys(self, prefix: bytes = b"") -> Iterator[bytes]: ...
    def view(self, key: bytes) -> contextlib.AbstractContextManager[memoryview | None]: ...
    def peek(self, key: bytes, n: int) -> tuple[bytes, int] | None: ...
    def close(self) -> None: ...

    # batched variants; implementations may do better than these loops
    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]: ...
    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None: ...
    def put_many_if_absent(self, items: Iterable[tuple[bytes, bytes | memoryview]]) -> list[bool]: ...
    def delete_many(self, keys: Iterable[bytes]) -> int: ...

    # optional features (defaults in BackendBase)
    def prefetch(self, keys: Iterable[bytes]) -> None: ...
    def read_ahead(self) -> contextlib.AbstractContextManager[None]: ...
    def disk_bytes(self) -> int | None: ...
    def origin(self) -> Backend: ...
    def local_copy(self, key: bytes) -> contextlib.AbstractContextManager[memoryview | None]: ...
    def drop_local(self, keys: Iterable[bytes]) -> int: ...


class BackendBase:
    """Default batched variants, ``view``, ``peek``, ``put_if_absent`` and the optional features
    (``local`` False, ``prefetch`` a no-op, ``disk_bytes`` None) built on the single-key methods.

    ``put_if_absent(key, value)`` stores ``value`` unless ``key`` already holds something and
    says whether it did (an object store does this in one conditional request; the default here
    checks first, so two writers racing on one key may both write: the last one wins whole).
    ``peek(key, n)`` is ``(the first n bytes, the value's full length)``, or None when ``key`` is
    missing: a remote backend reads an entry's header without fetching the entry.
    """

    readonly = False
    local = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # type: ignore[attr-defined]

    def put_if_absent(self, key: bytes, value: bytes | memoryview) -> bool:
        if self.contains(key):  # type: ignore[attr-defined]
            return False
        self.put(key, value)  # type: ignore[attr-defined]
        return True

    def peek(self, key: bytes, n: int) -> tuple[bytes, int] | None:
        with self.view(key) as buf:
            return None if buf is None else (bytes(buf[:n]), len(buf))

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]  # type: ignore[attr-defined]

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        for k, v in items:
            self.put(k, v)  # type: ignore[attr-defined]

    def put_many_if_absent(self, items: Iterable[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """``put_if_absent`` of each item (LMDB: in one transaction); whether each was stored."""
        return [self.put_if_absent(k, v) for k, v in items]

    def delete_many(self, keys: Iterable[bytes]) -> int:
        return sum(bool(self.delete(k)) for k in keys)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        value = self.get(key)  # type: ignore[attr-defined]
        yield None if value is None else memoryview(value)

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Start loading ``keys`` in the background where that pays; here, nothing to do."""

    def read_ahead(self) -> contextlib.AbstractContextManager[None]:
        """Values viewed inside are read whole (see the module docstring); here, nothing to do."""
        return contextlib.nullcontext()

    def disk_bytes(self) -> int | None:
        """Bytes the store occupies on this machine's disk; None: not a local file."""
        return None

    def origin(self) -> Backend:
        """The backend whose copies count: this one (a tier answers its remote)."""
        return self  # type: ignore[return-value]

    @contextlib.contextmanager
    def local_copy(self, key: bytes) -> Iterator[memoryview | None]:
        """This machine's cached copy of ``key`` apart from the origin's: none here."""
        yield None

    def drop_local(self, keys: Iterable[bytes]) -> int:
        """Forget this machine's cached copies of ``keys``: none here."""
        return 0
