"""KVStore: content-addressed KV caches in a backend (LMDB by default).

::

    with KVStore("cache/store") as store:
        store.put(entry)                      # an Entry (see below), encoded with the store's codec
        entry = store.get(key)                # verified; None if missing *or* corrupt (with a warning)
        with store.open_entry(key) as view:   # zero-copy variant for the load path
            view.layers[0][0].copy_into(dest)  # keys of layer 0, decoded into dest
        info = store.scan()                   # headers only; scan(verify=True) checks every byte

Backend keys: ``e/<key>`` entries, ``a/<key>`` last access time (float64 seconds, written in one
batch when the store closes), ``meta`` the store's own description (format version, default codec,
creation time). Reopening a store reads its description back; a store from a newer format is
refused, never misread.

Entries are written once: a key that already holds an intact entry keeps it (on an object store
that is one conditional request), so concurrent builders and re-runs never replace each other's
entries; a corrupt one is replaced. Listings read each entry's header only (``Backend.peek``), so
``scan`` of a remote store does not download the entries.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
import warnings
from collections.abc import Iterable, Iterator

from kvstore.errors import (
    CorruptEntryError,
    CorruptEntryWarning,
    EntryNotFoundError,
    FormatVersionError,
    KVStoreError,
    ReadOnlyStoreError,
)
from kvstore.progress import Progress
from kvstore.store.backends import Backend, open_backend
from kvstore.store.codecs import Codec, get_codec
from kvstore.store.entry import (
    FORMAT_VERSION,
    MAX_ENTRY_HEADER,
    Entry,
    EntryHeader,
    EntryView,
    decode_entry,
    encode_entry,
    read_header,
)
from kvstore.store.scan import CorruptInfo, EntryInfo, StoreInfo

_META = b"meta"
_E = b"e/"
_A = b"a/"
_PEEK = 64 << 10  # first read of an entry's header; a longer header is read again in full


def _ekey(key: str) -> bytes:
    return _E + key.encode("ascii")


def _same_entry(stored: memoryview, blob: bytes, key: str) -> bool:
    """Whether ``stored`` is an intact entry with the facts of ``blob`` (model, dtype, shape,
    token ids): then it holds the same cache, written by someone else (only ``created`` and the
    codec may differ). A newer format's entry counts as the same: it is left to that version."""
    try:
        old = decode_entry(stored, key=key)
    except FormatVersionError:
        return True
    except CorruptEntryError:
        return False
    new = decode_entry(blob, key=key)
    facts = lambda h: (h.model, h.dtype, h.n_tokens, h.n_layers, h.kv_heads, h.head_dim)
    return facts(old.header) == facts(new.header) and old.token_ids() == new.token_ids()


class KVStore:
    """A KV-cache store. ``path_or_url``: a directory (LMDB), ``lmdb://DIR``, ``s3://BUCKET[/PREFIX]``
    or ``memory://NAME``; default ``$KVSTORE_STORE`` or ``<home>/store``.

    ``readonly`` opens for reading only (a missing store is then an error). ``codec`` sets the
    codec for new entries (default: the one recorded in the store, else ``zstd-shuffle:1``).
    ``backend_options`` go to :func:`kvstore.store.backends.open_backend`, e.g. ``cache_dir`` and
    ``cache_size`` for a local tier in front of a remote store.
    """

    def __init__(
        self,
        path_or_url: str | None = None,
        *,
        readonly: bool = False,
        codec: str | Codec | None = None,
        **backend_options,
    ):
        from kvstore.paths import default_store

        self.url = str(path_or_url or default_store())
        self.backend: Backend = open_backend(self.url, readonly=readonly, **backend_options)
        self.readonly = readonly
        self._touched: dict[str, float] = {}
        try:
            self.meta = self._load_meta(codec)
            self.codec = get_codec(codec or self.meta.get("codec"))
        except BaseException:
            self.backend.close()
            raise

    # -- description --------------------------------------------------------------------------
    def _load_meta(self, codec: str | Codec | None = None) -> dict:
        raw = self.backend.get(_META)
        if raw is None:
            # a new store records the codec it was created with, so a reopen uses it again
            meta = {"format": FORMAT_VERSION, "codec": get_codec(codec).spec, "created": time.time()}
            if self.readonly or self.backend.put_if_absent(_META, json.dumps(meta, sort_keys=True).encode()):
                return meta
            raw = self.backend.get(_META)  # another process created the store meanwhile: use its description
            if raw is None:
                raise KVStoreError(f"store {self.url} lost its description record while opening; open it again")
        try:
            meta = json.loads(raw)
            fmt = int(meta["format"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            raise KVStoreError(
                f"store {self.url} has an unreadable description record; is it a kvstore store?"
            ) from None
        if fmt > FORMAT_VERSION:
            raise FormatVersionError(
                f"store {self.url} was written by format version {fmt}; this kvstore reads up to {FORMAT_VERSION} - "
                "upgrade kvstore"
            )
        return meta

    @property
    def format(self) -> int:
        return int(self.meta["format"])

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Record last-access times (one transaction) and close the backend."""
        if self._touched and not self.readonly:
            with contextlib.suppress(KVStoreError):
                self.backend.put_many((_A + k.encode(), struct.pack("<d", t)) for k, t in self._touched.items())
        self._touched.clear()
        self.backend.close()

    # -- single entries -------------------------------------------------------------------------
    def encode(self, entry: Entry, codec: str | Codec | None = None) -> bytes:
        """The stored bytes for ``entry`` (what :meth:`put` writes)."""
        return encode_entry(entry, get_codec(codec) if codec is not None else self.codec)

    def put(self, entry: Entry, *, codec: str | Codec | None = None) -> int:
        """Store ``entry`` atomically under ``entry.key``; returns the stored size in bytes."""
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.url} was opened read-only")
        blob = self.encode(entry, codec)
        self.put_bytes(entry.key, blob)
        return len(blob)

    def put_bytes(self, key: str, blob: bytes) -> None:
        """Store already-encoded entry bytes (see :meth:`encode`) under ``key``, unless ``key``
        already holds an intact entry of the same model, dtype, shape and tokens (another writer's
        copy, kept); a corrupt or different one is replaced."""
        if self.backend.put_if_absent(_ekey(key), blob):
            return
        with self.backend.view(_ekey(key)) as buf:
            keep = buf is not None and _same_entry(buf, blob, key)
        if not keep:
            self.backend.put(_ekey(key), blob)

    def contains(self, key: str) -> bool:
        return self.backend.contains(_ekey(key))

    __contains__ = contains

    def delete(self, key: str) -> bool:
        """Remove an entry; True if it existed."""
        found = self.backend.delete(_ekey(key))
        self.backend.delete(_A + key.encode())
        return found

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        n = self.backend.delete_many([_ekey(k) for k in keys])
        self.backend.delete_many([_A + k.encode() for k in keys])
        return n

    @contextlib.contextmanager
    def open_entry(self, key: str) -> Iterator[EntryView | None]:
        """Verified zero-copy access to one entry; yields None when it is missing or corrupt
        (a corrupt entry also emits a :class:`CorruptEntryWarning`: treat it as a miss)."""
        with self.backend.view(_ekey(key)) as buf:
            if buf is None:
                yield None
                return
            try:
                view = decode_entry(buf, key=key, threads=self.codec.decode_threads())
            except CorruptEntryError as exc:
                warnings.warn(
                    f"kvstore: entry {key[:16]} is corrupt ({exc}); treating it as a miss",
                    CorruptEntryWarning,
                    stacklevel=3,
                )
                yield None
                return
            self._touched[key] = time.time()
            yield view

    def is_intact(self, key: str) -> bool:
        """True when ``key`` holds an entry that verifies and decodes; False when it is missing or
        corrupt (a corrupt one also warns). Builds use it so that they redo broken entries."""
        with self.open_entry(key) as view:
            return view is not None

    def get(self, key: str, default=None) -> Entry | None:
        """The verified entry under ``key``, or ``default`` if it is missing or corrupt."""
        with self.open_entry(key) as view:
            return default if view is None else view.materialize()

    def __getitem__(self, key: str) -> Entry:
        with self.backend.view(_ekey(key)) as buf:
            if buf is None:
                raise EntryNotFoundError(f"no entry {key} in {self.url}")
            view = decode_entry(buf, key=key)
            self._touched[key] = time.time()
            return view.materialize()

    def header(self, key: str) -> EntryHeader | None:
        """An entry's header without verifying or decoding its payload (None when missing).
        Raises CorruptEntryError or FormatVersionError for an unreadable header."""
        got = self._peek_header(key)
        return None if got is None else got[0]

    def _peek_header(self, key: str) -> tuple[EntryHeader, int] | None:
        """(header, stored size) from the first bytes of an entry, or None when it is missing."""
        got = self.backend.peek(_ekey(key), _PEEK)
        if got is None:
            return None
        head, size = got
        try:
            return read_header(head)[0], size
        except CorruptEntryError:
            if size <= len(head):
                raise
        # a header longer than the first read (or a truncated entry): read as much as one can hold
        got = self.backend.peek(_ekey(key), MAX_ENTRY_HEADER + 64)
        return None if got is None else (read_header(got[0])[0], got[1])

    def keys(self) -> list[str]:
        return [k[len(_E) :].decode() for k in self.backend.keys(_E)]

    def __len__(self) -> int:
        return len(self.keys())

    # -- scanning -------------------------------------------------------------------------------
    def _last_access(self) -> dict[str, float]:
        out = {}
        names = list(self.backend.keys(_A))
        for k, raw in zip(names, self.backend.get_many(names)):
            if raw is not None and len(raw) == 8:
                out[k[len(_A) :].decode()] = struct.unpack("<d", raw)[0]
        return out | self._touched

    def scan(self, *, verify: bool = False, progress: Progress | None = None) -> StoreInfo:
        """Describe every entry from its header; with ``verify`` also check each checksum and
        decode each payload. Corrupt entries are reported in ``corrupt``, never raised.
        ``progress(1, stored bytes)`` is called after each entry."""
        access = self._last_access()
        entries, corrupt = [], []
        keys = self.keys()
        for key in keys:
            size = 0
            try:
                if verify:
                    with self.backend.view(_ekey(key)) as buf:
                        got = None if buf is None else (decode_entry(buf, key=key).header, len(buf))
                else:
                    got = self._peek_header(key)
                    if got is not None and got[0].key != key:
                        raise CorruptEntryError("entry header names another key")
            except (CorruptEntryError, FormatVersionError) as exc:
                peeked = self.backend.peek(_ekey(key), 1)
                size = 0 if peeked is None else peeked[1]
                corrupt.append(CorruptInfo(key, str(exc), size))
            else:
                if got is None:  # deleted while we scanned
                    continue
                header, size = got
                entries.append(EntryInfo(header, size, access.get(key)))
            if progress is not None:
                progress(1, size)
        disk = getattr(self.backend, "disk_bytes", None)
        return StoreInfo(
            url=self.url,
            format=self.format,
            codec=self.codec.spec,
            created=float(self.meta.get("created", 0.0)),
            entries=tuple(entries),
            corrupt=tuple(corrupt),
            disk_bytes=disk() if disk else None,
            verified=verify,
        )

    def verify(self, progress: Progress | None = None) -> StoreInfo:
        """Same as ``scan(verify=True)``."""
        return self.scan(verify=True, progress=progress)


__all__ = ["KVStore"]
