"""Object names of an S3 store: one object per backend key, one-to-one.

Keys of the form ``NAME/HEX`` fan out on their first two hex digits (``e/ab12...`` ->
``PREFIX/e/ab/ab12...``), so that listings and request rates spread over many name prefixes; any
other key is one percent-encoded name (``meta`` -> ``PREFIX/meta``). The mapping is one-to-one, so
:meth:`kvstore.store.backends.s3.S3Backend.keys` lists and decodes. The backend sees opaque byte
keys: nothing here knows which names a store uses.
"""

from __future__ import annotations

import re
import urllib.parse

from kvstore.errors import StoreError

_FANNED = re.compile(r"^([a-z0-9_-]{1,32})/([0-9a-f]{2,})$")


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b/")``: the bucket and the object-name prefix (empty,
    or ending in ``/``). Empty segments are dropped (S3 servers fold ``//``). Raises StoreError."""
    if not url.startswith("s3://"):
        raise StoreError(f"{url!r} is not an s3:// URL")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise StoreError(f"{url!r} names no bucket; use s3://BUCKET or s3://BUCKET/PREFIX")
    prefix = "/".join(p for p in prefix.split("/") if p)
    return bucket, prefix + "/" if prefix else ""


def object_name(key: bytes) -> str:
    """Object name (below the store's prefix) of a backend key: ``NAME/HEX`` fans out as
    ``NAME/HE/HEX``; anything else is percent-encoded into one name without ``/``."""
    m = _FANNED.match(key.decode("latin-1"))
    if m:
        return f"{m.group(1)}/{m.group(2)[:2]}/{m.group(2)}"
    return urllib.parse.quote_from_bytes(key, safe="")


def backend_key(name: str) -> bytes | None:
    """Inverse of :func:`object_name`; None for a name no key maps to (a foreign object)."""
    parts = name.split("/")
    if len(parts) == 3:
        key = f"{parts[0]}/{parts[2]}"
        return key.encode() if _FANNED.match(key) and parts[2][:2] == parts[1] else None
    if len(parts) == 1 and parts[0]:
        key_bytes = urllib.parse.unquote_to_bytes(parts[0])
        return key_bytes if object_name(key_bytes) == parts[0] else None
    return None


def listing_prefixes(prefix: bytes) -> list[str]:
    """Object-name prefixes whose listings together hold every key starting with ``prefix``:
    one for fanned-out names, one for percent-encoded ones (one alone when it covers the other)."""
    flat = urllib.parse.quote_from_bytes(prefix, safe="")
    text = prefix.decode("latin-1")
    name, sep, digits = text.partition("/")
    if not sep:
        fanned = text if re.fullmatch(r"[a-z0-9_-]{0,32}", text) else None
    elif re.fullmatch(r"[a-z0-9_-]{1,32}", name) and re.fullmatch(r"[0-9a-f]*", digits):
        fanned = f"{name}/{digits[:2]}/{digits}" if len(digits) >= 2 else text
    else:
        fanned = None
    if fanned is None or flat.startswith(fanned):
        return [fanned if fanned is not None and flat.startswith(fanned) else flat]
    return [flat] if fanned.startswith(flat) else [fanned, flat]


__all__ = ["backend_key", "listing_prefixes", "object_name", "parse_url"]
