"""Where a store keeps what, under the backend's byte keys: the one home of the key scheme.

* ``meta``: the store's own description (format version, default codec, chunk size, created);
* ``e/<key>``: an entry (a chunk, or a format-1 whole context), :mod:`kvstore.store.entry`;
* ``r/<key>``: a context record (its chain of chunk keys; the key is the chain's last chunk's);
* ``a/<key>``: the last access time of an entry (float64 seconds, little-endian).

``<key>`` is always 64 lowercase hex digits (a sha256, :mod:`kvstore.store.keys`).
"""

from __future__ import annotations

import re

META = b"meta"
ENTRY = b"e/"
RECORD = b"r/"
ACCESS = b"a/"
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def is_key(text: object) -> bool:
    """Whether ``text`` is a well-formed key (64 lowercase hex digits)."""
    return isinstance(text, str) and HEX64.match(text) is not None


def entry_key(key: str) -> bytes:
    """The backend key of the entry ``key``."""
    return ENTRY + key.encode("ascii")


def record_key(key: str) -> bytes:
    """The backend key of the context record ``key``."""
    return RECORD + key.encode("ascii")


def access_key(key: str) -> bytes:
    """The backend key of the entry ``key``'s last access time."""
    return ACCESS + key.encode("ascii")


def key_of(backend_key: bytes, prefix: bytes, errors: str = "strict") -> str:
    """The store key inside ``backend_key`` (which starts with ``prefix``). ``errors="replace"``
    names a damaged key in a report instead of raising UnicodeDecodeError."""
    return backend_key[len(prefix) :].decode("utf-8", errors=errors)


__all__ = ["ACCESS", "ENTRY", "HEX64", "META", "RECORD", "access_key", "entry_key", "is_key", "key_of", "record_key"]
