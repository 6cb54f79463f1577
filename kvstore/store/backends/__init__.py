"""Storage backends: opaque bytes under byte keys.

A backend knows nothing of tensors, codecs or models. One implementation per module:
``lmdb`` (the embedded default), ``memory`` (tests), ``s3`` (an S3-compatible object store,
``s3://bucket/prefix``; needs ``pip install 'kvstore[s3]'``) and ``tiered`` (a local LMDB cache in
front of any other backend: ``open_backend(url, cache_dir=DIR)``). The protocol and its defaults
live in :mod:`~kvstore.store.backends.base`; the children import that, never this package.
"""

from __future__ import annotations

from kvstore.store.backends.base import Backend, BackendBase
from kvstore.store.backends.url import open_url

__all__ = ["DEFAULT_CACHE_SIZE", "Backend", "BackendBase", "open_backend", "open_url"]

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
    return open_url(url, readonly=readonly, create=create, **options)
