"""Open one backend from its URL (no local tier: :func:`kvstore.store.backends.open_backend` adds
that). Its own module so the tier, which opens its remote by URL, needs nothing from the package."""

from __future__ import annotations

from kvstore.store.backends.base import Backend


def open_url(url: str, *, readonly: bool = False, create: bool = True, **options) -> Backend:
    """``s3://BUCKET[/PREFIX]``, ``memory://NAME``, ``lmdb://PATH`` or a plain path (LMDB);
    ``options`` go to the backend's constructor. Raises :class:`kvstore.errors.StoreError`
    subclasses when it cannot be opened."""
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
