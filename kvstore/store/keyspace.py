"""Where a store keeps what, under the backend's byte keys: the one home of the key scheme.

* ``meta``: the store's own description (format version, default codec, chunk size, created);
* ``e/<key>``: an entry (a chunk, or a format-1 whole context), :mod:`kvstore.store.entry`;
* ``r/<key>``: a context record (its chain of chunk keys; the key is the chain's last chunk's);
* ``a/<key>``: the last access time of an entry or a derived entry (float64 seconds, little-endian);
* ``x/<context>/<key>``: a derived entry of the context ``<context>`` (its scores, or a pressed
  cache: :mod:`kvstore.store.owned`), ``<key>`` the owned key. Listing ``x/<context>/`` finds
  every derived entry of one context; a store written before derived entries has no ``x/`` keys.

``<key>`` and ``<context>`` are always 64 lowercase hex digits (sha256s: :mod:`kvstore.store.keys`,
:func:`kvstore.store.owned.owned_key_of`).
"""

from __future__ import annotations

import re

META = b"meta"
ENTRY = b"e/"
RECORD = b"r/"
ACCESS = b"a/"
OWNED = b"x/"
DERIVED = OWNED  # the name it had before kinds were one table
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


def owned_prefix(context: str) -> bytes:
    """The backend prefix of every entry the context ``context`` owns (its derived entries)."""
    return OWNED + context.encode("ascii") + b"/"


def owned_key(context: str, key: str) -> bytes:
    """The backend key of the entry ``key`` the context ``context`` owns (a derived entry)."""
    return owned_prefix(context) + key.encode("ascii")


def owner_of(backend_key: bytes) -> tuple[str, str] | None:
    """``(context, key)`` named by a backend key under ``x/``, or None when it is not one (a
    malformed name: both parts must be keys)."""
    if not backend_key.startswith(OWNED):
        return None
    context, sep, key = backend_key[len(OWNED) :].decode("utf-8", errors="replace").partition("/")
    return (context, key) if sep and is_key(context) and is_key(key) else None


def entry_name(backend_key: bytes) -> tuple[bytes, str, str] | None:
    """``(prefix, owner, key)`` of a stored entry's backend key: ``(ENTRY, "", key)`` for a chunk
    (its key as stored, damaged or not: reading it says), ``(OWNED, context, key)`` for an entry a
    context owns; None for a name that is no entry (a record, a last use, ``meta``, a malformed
    owned name)."""
    if backend_key.startswith(ENTRY):
        return ENTRY, "", key_of(backend_key, ENTRY, errors="replace")
    got = owner_of(backend_key)
    return None if got is None else (OWNED, *got)


# the names these had before kinds were one table
derived_prefix, derived_entry_key, derived_of = owned_prefix, owned_key, owner_of


def key_of(backend_key: bytes, prefix: bytes, errors: str = "strict") -> str:
    """The store key inside ``backend_key`` (which starts with ``prefix``). ``errors="replace"``
    names a damaged key in a report instead of raising UnicodeDecodeError."""
    return backend_key[len(prefix) :].decode("utf-8", errors=errors)


__all__ = [
    "ACCESS",
    "DERIVED",
    "ENTRY",
    "HEX64",
    "META",
    "OWNED",
    "RECORD",
    "access_key",
    "derived_entry_key",
    "derived_of",
    "derived_prefix",
    "entry_key",
    "entry_name",
    "is_key",
    "key_of",
    "owned_key",
    "owned_prefix",
    "owner_of",
    "record_key",
]
