"""Storage backends: opaque bytes under byte keys.

A backend knows nothing of tensors, codecs or models. One implementation per module:
``kvstore.backends.lmdb`` (the embedded default) and ``kvstore.backends.memory`` (tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """The storage protocol. Values are bytes-like; ``view`` may lend zero-copy memory."""

    readonly: bool

    def get(self, key: bytes) -> bytes | None: ...
    def put(self, key: bytes, value: bytes | memoryview) -> None: ...
    def delete(self, key: bytes) -> bool: ...
    def contains(self, key: bytes) -> bool: ...
    def keys(self, prefix: bytes = b"") -> Iterator[bytes]: ...
    def view(self, key: bytes) -> contextlib.AbstractContextManager[memoryview | None]: ...
    def close(self) -> None: ...

    # batched variants; implementations may do better than these loops
    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]: ...
    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None: ...
    def delete_many(self, keys: Iterable[bytes]) -> int: ...


class BackendBase:
    """Default batched variants and ``view`` built on the single-key methods."""

    readonly = False

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]  # type: ignore[attr-defined]

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        for k, v in items:
            self.put(k, v)  # type: ignore[attr-defined]

    def delete_many(self, keys: Iterable[bytes]) -> int:
        return sum(bool(self.delete(k)) for k in keys)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        value = self.get(key)  # type: ignore[attr-defined]
        yield None if value is None else memoryview(value)


def open_backend(url: str, *, readonly: bool = False, create: bool = True, **options) -> Backend:
    """Open a backend from a path or URL: ``memory://NAME``, ``lmdb://PATH`` or a plain path (LMDB)."""
    if url.startswith("memory://"):
        from kvstore.store.backends.memory import MemoryBackend

        return MemoryBackend(url[len("memory://") :], readonly=readonly)
    if url.startswith("lmdb://"):
        url = url[len("lmdb://") :]
    from kvstore.store.backends.lmdb import LMDBBackend

    return LMDBBackend(url, readonly=readonly, create=create, **options)
