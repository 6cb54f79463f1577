"""Storage backends: opaque bytes under byte keys.

A backend knows nothing of tensors, codecs or models. One implementation per module:
``lmdb`` (the embedded default), ``memory`` (tests), ``s3`` (an S3-compatible object store,
``s3://bucket/prefix``; needs ``pip install 'kvstore[s3]'``) and ``tiered`` (a local LMDB cache in
front of any other backend: ``open_backend(url, cache_dir=DIR)``).
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
    def delete_many(self, keys: Iterable[bytes]) -> int: ...


class BackendBase:
    """Default batched variants, ``view``, ``peek`` and ``put_if_absent`` built on the single-key
    methods.

    ``put_if_absent(key, value)`` stores ``value`` unless ``key`` already holds something and
    says whether it did (an object store does this in one conditional request; the default here
    checks first, so two writers racing on one key may both write: the last one wins whole).
    ``peek(key, n)`` is ``(the first n bytes, the value's full length)``, or None when ``key`` is
    missing: a remote backend reads an entry's header without fetching the entry.
    """

    readonly = False

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

    def delete_many(self, keys: Iterable[bytes]) -> int:
        return sum(bool(self.delete(k)) for k in keys)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        value = self.get(key)  # type: ignore[attr-defined]
        yield None if value is None else memoryview(value)


DEFAULT_CACHE_SIZE = 10 << 30  # bytes a local tier (cache_dir) holds unless told otherwise


def open_backend(
    url: str,
    *,
    readonly: bool = False,
    create: bool = True,
    cache_dir: str | None = None,
    cache_size: int = DEFAULT_CACHE_SIZE,
    **options,
) -> Backend:
    """Open a backend from a path or URL: ``s3://BUCKET[/PREFIX]``, ``memory://NAME``,
    ``lmdb://PATH`` or a plain path (LMDB).

    ``cache_dir`` puts a local LMDB tier of at most ``cache_size`` bytes in front of it
    (:class:`kvstore.store.backends.tiered.TieredBackend`). ``options`` go to the backend's
    constructor. Raises :class:`kvstore.errors.StoreError` subclasses when it cannot be opened."""
    if cache_dir is not None:
        from kvstore.store.backends.tiered import TieredBackend

        return TieredBackend(url, cache_dir, max_bytes=cache_size, readonly=readonly, create=create, **options)
    if url.startswith("s3://"):
        from kvstore.store.backends.s3 import S3Backend

        return S3Backend(url, readonly=readonly, create=create, **options)
    if url.startswith("memory://"):
        from kvstore.store.backends.memory import MemoryBackend

        return MemoryBackend(url[len("memory://") :], readonly=readonly)
    if url.startswith("lmdb://"):
        url = url[len("lmdb://") :]
    from kvstore.store.backends.lmdb import LMDBBackend

    return LMDBBackend(url, readonly=readonly, create=create, **options)
