"""KVStore: content-addressed KV caches in a backend (LMDB by default).

::

    with KVStore("cache/store") as store:
        store.put(entry)                      # an Entry (one chunk), encoded with the store's codec
        store.put_context(key, chunk_keys, n) # the record naming a context's chain of chunks
        with store.open_chain(chunk_keys) as views:   # the longest verified prefix, zero-copy
            views[0].layers[0][0].copy_into(dest)     # keys of layer 0, decoded into dest
        info = store.scan()                   # headers only; scan(verify=True) checks every byte
        store.put(blob)                       # any kind's encoded entry: a context's scores, a pressed cache
        with store.open(kind, key, owner=context) as view: ...  # any kind, verified (kvstore.store.access)

Backend keys: ``e/<key>`` entries (chunks, or format-1 whole contexts), ``r/<key>`` context records
(JSON: the chain's chunk keys, its tokens, its creation time; the key is the last chunk's),
``a/<key>`` last access time (float64 seconds, written in one batch when the store closes, and at
once for chunks a build reuses, so that a concurrent gc's grace period sees them), ``x/<context>/<key>``
the entries a context owns (scores, pressed caches: :mod:`kvstore.store.access`), ``meta`` the
store's own description (format version, default codec, chunk size, creation time). Reopening a
store reads its description back; a store from a newer format is refused, never misread; a
format-1 store opened for writing is upgraded in place (its entries stay readable).

Entries are written once: a key that already holds an intact entry keeps it (on an object store
that is one conditional request), so concurrent builders and re-runs never replace each other's
entries; a corrupt one is replaced. Listings read each entry's header only (``Backend.peek``), so
``scan`` of a remote store does not download the entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import struct
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence

from kvstore.errors import (
    CorruptEntryError,
    CorruptEntryWarning,
    EntryNotFoundError,
    KVStoreError,
    ReadOnlyStoreError,
)
from kvstore.facts import ATTN
from kvstore.parallel import run_all
from kvstore.progress import Progress
from kvstore.store.access import EntryAccess, WantedEntry
from kvstore.store.backends import Backend, open_backend
from kvstore.store.codecs import Codec, get_codec
from kvstore.store.codecs.choice import CodecChoice
from kvstore.store.entry import CHUNK, Entry, EntryView, encode_entry
from kvstore.store.frame import TRAILER_BYTES, peek_frame, verify_checksum
from kvstore.store.header import EntryHeader, check_sizes, read_header
from kvstore.store.keyspace import (
    ACCESS,
    ENTRY,
    RECORD,
    access_key,
    entry_key,
    is_key,
    key_of,
    owned_key,
    record_key,
)
from kvstore.store.meta import MAX_CHUNK_TOKENS, load_meta
from kvstore.store.scan import ContextRecord, StoreInfo, scan_store


class KVStore(EntryAccess):
    """A KV-cache store. ``path_or_url``: a directory (LMDB), ``lmdb://DIR``, ``s3://BUCKET[/PREFIX]``
    or ``memory://NAME``; default ``$KVSTORE_STORE`` or ``<home>/store``.

    ``readonly`` opens for reading only (a missing store is then an error). ``codec`` sets the
    codec for the entries this handle writes (default: the store's, itself ``zstd-split:1:16`` for
    a store created by this release, ``zstd-shuffle:1`` before, unless chosen when it was
    created). A store's recorded default is always lossless: a lossy codec applies only to the
    handle that names it, and is part of the keys it computes (see :attr:`codec`).
    ``chunk_tokens`` sets the chunk size of a new store (default 512); an existing store keeps its
    own. ``default_codec``: the codec a store this handle creates records when ``codec`` names none,
    with its reason (:func:`kvstore.store.codecs.choice.choose_codec`: ``raw`` for a store built on
    CUDA); ignored for an existing store. ``backend_options`` go to
    :func:`kvstore.store.backends.open_backend`, e.g. ``cache_dir`` and ``cache_size`` for a local
    tier in front of a remote store.
    """

    def __init__(
        self,
        path_or_url: str | None = None,
        *,
        readonly: bool = False,
        codec: str | Codec | None = None,
        chunk_tokens: int | None = None,
        default_codec: CodecChoice | None = None,
        **backend_options,
    ):
        from kvstore.paths import default_store

        self.url = str(path_or_url or default_store())
        if chunk_tokens is not None and not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ValueError(f"chunk_tokens must be between 1 and {MAX_CHUNK_TOKENS}")
        self.backend: Backend = open_backend(self.url, readonly=readonly, **backend_options)
        self.readonly = readonly
        self._touched: dict[str, float] = {}
        self._written: set[str] = set()  # entries this handle wrote and no record of its named yet
        try:
            chosen = get_codec(codec) if codec is not None else None
            self.meta = load_meta(
                self.backend, self.url, chosen, chunk_tokens, readonly=readonly, default=default_codec
            )
            self.codec: Codec = chosen or get_codec(self.meta.codec)
        except BaseException:
            self.backend.close()
            raise

    # -- description --------------------------------------------------------------------------
    @property
    def format(self) -> int:
        return self.meta.format

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk of the chains this store holds (a store setting)."""
        return self.meta.chunk_tokens

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Record last-access times (one transaction) and close the backend."""
        if self._touched and not self.readonly:
            with contextlib.suppress(KVStoreError):
                self.backend.put_many((access_key(k), struct.pack("<d", t)) for k, t in self._touched.items())
        self._touched.clear()
        self.backend.close()

    def _writable(self) -> None:
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.url} was opened read-only")

    # -- entries --------------------------------------------------------------------------------
    def encode(self, entry: Entry, codec: str | Codec | None = None) -> bytes:
        """The stored bytes for ``entry`` (what :meth:`put` writes)."""
        return encode_entry(entry, get_codec(codec) if codec is not None else self.codec)

    def put(self, item: Entry | bytes, *, codec: str | Codec | None = None) -> int:
        """Store an entry of any kind once; returns its stored size in bytes. ``item``: an
        :class:`Entry` (a chunk, encoded with ``codec``, default the store's), or the bytes of an
        entry of any kind (:meth:`encode`, :func:`~kvstore.store.owned.encode_scores`,
        :func:`~kvstore.store.owned.encode_pressed`, a kind's encoder): its kind, key and owner
        are read from its frame. A key that holds an intact entry of the same facts keeps it
        (another writer's copy); a corrupt or different one is replaced. Raises
        ReadOnlyStoreError on a read-only store, CorruptEntryError for bytes that are no intact
        entry, FormatVersionError for a kind this process does not know."""
        if isinstance(item, Entry):
            self._writable()
            blob = self.encode(item, codec)
            self.put_bytes(item.key, blob)
            return len(blob)
        return self._put_blob(item)

    def put_bytes(self, key: str, blob: bytes) -> None:
        """Deprecated: :meth:`put` (``store.put(blob)``). Store already-encoded chunk bytes (see
        :meth:`encode`) under ``key``, not verified, unless ``key`` already holds an intact entry
        of the same model, dtype, shape and tokens (another writer's copy, kept)."""
        if self._put_once(CHUNK, entry_key(key), key, blob):
            self._written.add(key)

    def contains(self, key: str) -> bool:
        return self.has(CHUNK, key)

    __contains__ = contains

    def delete(self, key: str) -> bool:
        """Remove an entry (and a context record of the same key, first); True if either existed.
        Unconditional: :func:`kvstore.store.gc.execute_plan` is what removes only what is unused."""
        self._writable()
        found = self.backend.delete(record_key(key))
        found = bool(self.backend.delete(entry_key(key))) or found
        self.backend.delete(access_key(key))
        return found

    def delete_many(self, keys: Iterable[str], *, contexts: Iterable[str] = ()) -> int:
        """Remove context records ``contexts``, then entries ``keys`` (records before the chunks
        they name: an interruption leaves unused chunks, never a record without its chunks);
        returns how many entries existed. Unconditional, like :meth:`delete`."""
        self._writable()
        keys = list(keys)
        self.backend.delete_many([record_key(k) for k in contexts])
        n = self.backend.delete_many([entry_key(k) for k in keys])
        self.backend.delete_many([access_key(k) for k in keys])
        return n

    def open_entry(self, key: str) -> contextlib.AbstractContextManager[EntryView | None]:
        """Verified zero-copy access to one chunk entry: ``open(CHUNK, key)``; yields None when it
        is missing or corrupt (a corrupt entry also emits a :class:`CorruptEntryWarning`: treat it
        as a miss)."""
        return self.open(CHUNK, key)

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
        """The verified entry ``key``. Raises EntryNotFoundError when it is missing,
        CorruptEntryError when it is corrupt (through a local tier: the remote's copy)."""
        with contextlib.ExitStack() as stack:
            view = self._open_in(stack, CHUNK, key, strict=True)
            if view is None:
                raise EntryNotFoundError(f"no entry {key} in {self.url}")
            return view.materialize()

    def header(self, key: str) -> EntryHeader | None:
        """An entry's header without verifying or decoding its payload (None when missing).
        Raises CorruptEntryError or FormatVersionError for an unreadable header."""
        got = self.peek_header(key)
        return None if got is None else got[0]

    def peek_header(self, key: str, *, origin: bool = False) -> tuple[EntryHeader, int] | None:
        """(header, stored size) from the first bytes of an entry, or None when it is missing.
        ``origin``: read the remote's copy even where a local tier holds one."""
        got = peek_frame(self.backend.origin() if origin else self.backend, entry_key(key), read_header)
        if got is None:
            return None
        header, offset, size = got
        check_sizes(header, size - offset - TRAILER_BYTES)  # what a listing shows is consistent
        return header, size

    def keys(self) -> list[str]:
        """Keys of every entry (chunks and format-1 contexts)."""
        return [key_of(k, ENTRY) for k in self.backend.keys(ENTRY)]

    def __len__(self) -> int:
        return len(self.keys())

    def touch(self, keys: Iterable[str]) -> None:
        """Record now as the last use of ``keys`` at once (not at close): a build that reuses a
        chunk marks it so that a concurrent gc, whose grace period counts from the last use,
        leaves it alone."""
        now = time.time()
        items = [(access_key(k), struct.pack("<d", now)) for k in keys]
        if items and not self.readonly:
            self.backend.put_many(items)

    def prefetch(
        self, keys: Iterable[str], *, owned: Iterable[tuple[str, str]] = (), derived: Iterable[tuple[str, str]] = ()
    ) -> None:
        """Start fetching these entries, and the ``owned`` entries ``(context, key)`` (``derived``:
        its deprecated name), in the background where the backend can (a remote one: ``sample``
        asks for the next batch's chunks while the current batch decodes); later loads take them
        from there. Local backends (LMDB, memory) need nothing: a no-op."""
        names = [entry_key(k) for k in dict.fromkeys(keys)]
        names += [owned_key(c, k) for c, k in dict.fromkeys([*owned, *derived])]  # derived: deprecated
        self.backend.prefetch(names)

    # -- chains ---------------------------------------------------------------------------------
    def stored_prefix(self, keys: Sequence[str]) -> int:
        """How many leading chunks of a chain are present (not verified: :meth:`open_chain` does)."""
        depth = 0
        for k in keys:
            if not self.contains(k):
                break
            depth += 1
        return depth

    @contextlib.contextmanager
    def open_chain(
        self, keys: Sequence[str], *, parent: str = "", lazy: bool = False, defer: bool = False
    ) -> Iterator[list[EntryView]]:
        """Verified zero-copy views of the longest prefix of the chain ``keys`` that is stored
        intact and links up (each chunk's parent is the previous key, the first one's is
        ``parent``, and each starts where the previous ended). A missing or corrupt chunk ends the
        prefix (a corrupt one warns): the rest of the chain is a miss from there on. ``lazy``: see
        :func:`kvstore.store.entry.decode_entry` (checksums are still verified here). ``defer``
        (with ``lazy``): the checksums are left to the reader, who verifies each view's
        ``unverified`` frame while copying from it (:mod:`kvstore.store.fused`); the headers and
        the chain's links are still checked here. Ignored on a tiered store (a corrupt local copy
        is dropped there, and the remote's read, when it is opened)."""
        defer = defer and lazy and self._single_copy()
        with contextlib.ExitStack() as stack:
            bufs = []
            with self.backend.read_ahead():  # read whole: a cold chunk at the disk's sequential speed
                for key in keys:
                    buf = stack.enter_context(self.backend.view(entry_key(key)))
                    if buf is None:
                        break
                    bufs.append(buf)
            # every chunk's checksum at once, on the load threads (xxh3 releases the GIL): one
            # thread verifying a long context's chunks in turn cost as much as copying them
            checks: list[BaseException | bool] = [defer] * len(bufs)
            if len(bufs) > 1 and not defer:
                errors = run_all([functools.partial(verify_checksum, b) for b in bufs], self.codec.decode_threads())
                checks = [True if err is None else err for err in errors]
            views: list[EntryView] = []
            expected_parent, expected_start = parent, 0
            for key, buf, check in zip(keys, bufs, checks):
                if isinstance(check, BaseException) and not isinstance(check, CorruptEntryError):
                    raise check
                view = self._verified(WantedEntry(CHUNK, entry_key(key), key), buf, stack, lazy=lazy, checked=check)
                if view is None:
                    break
                if defer:
                    view = dataclasses.replace(view, unverified=buf)
                h = view.header
                if h.format < 2 or h.parent != expected_parent or h.start != expected_start:
                    warnings.warn(
                        f"kvstore: entry {key[:16]} does not continue its chain; treating it as a miss",
                        CorruptEntryWarning,
                        stacklevel=3,
                    )
                    break
                views.append(view)
                expected_parent, expected_start = key, h.end
            yield views

    def _single_copy(self) -> bool:
        """Whether the backend holds one copy of each entry (no local tier before a remote)."""
        try:
            return self.backend.origin() is self.backend
        except KVStoreError:  # a tier whose remote is unreachable
            return False

    # -- contexts -------------------------------------------------------------------------------
    def put_context(self, key: str, chunks: Sequence[str], n_tokens: int, *, passage: bool = False) -> tuple[str, ...]:
        """Record that the context ``key`` (its last chunk's key) is the chain ``chunks`` (a
        position-independent passage with ``passage``: :mod:`kvstore.model.compose`).

        The record is written together with a mark of use now on each chunk this handle did not
        write itself (the ones it reuses; one transaction on LMDB), then every chunk is checked
        to be still there. A concurrent gc or rm removes only what nobody marked or recorded since
        its plan, and puts back what it removed while a record appeared, so either the chunks stay
        or their loss shows in this check. Returns the chunks that are missing: compute and put
        them again, then record the context again (a build does)."""
        self._writable()
        now = struct.pack("<d", time.time())
        marks = [(access_key(k), now) for k in dict.fromkeys(chunks) if k not in self._written]
        self._written.difference_update(chunks)
        record = ContextRecord(key, tuple(chunks), n_tokens, time.time(), passage)
        self.backend.put_many([*marks, (record_key(key), record.to_bytes())])
        return tuple(k for k in dict.fromkeys(chunks) if not self.backend.contains(entry_key(k)))

    def context(self, key: str) -> ContextRecord | None:
        """The context record ``key``, or None when there is none (or it is unreadable)."""
        raw = self.backend.get(record_key(key))
        return None if raw is None else ContextRecord.parse(key, raw)

    def get_context(self, key: str) -> Entry | None:
        """A whole stored context (its record ``key``, or a format-1 entry) as one :class:`Entry`:
        every chunk verified, each layer's keys and values joined over the chain (so that
        ``entry.to_dynamic_cache()`` drives ``model.generate``). None when the record or a chunk is
        missing or corrupt. Raises ValueError for a context whose layers keep less than every
        token (windows, recurrent states: only kvstore's own decoding continues those)."""
        import torch

        record = self.context(key)
        if record is None:  # a format-1 entry (or a lone first chunk) is a context of its own
            entry = self.get(key)
            return entry if entry is None or entry.start == 0 else None
        chunks = record.chunks
        with self.open_chain(chunks) as views:
            if not views or len(views) < len(chunks):
                return None
            parts = [view.materialize() for view in views]
        first = parts[0]
        if any(e.kinds and set(e.kinds) != {ATTN} for e in parts):
            raise ValueError(f"context {key[:16]}: only full-attention contexts join into one entry")
        layers = tuple(
            (torch.cat([e.layers[i][0] for e in parts], 1), torch.cat([e.layers[i][1] for e in parts], 1))  # type: ignore[index]
            for i in range(len(first.layers))
        )
        return Entry(key, first.model, first.model_name, torch.cat([e.token_ids for e in parts]), layers,
                     first.created, numerics=first.numerics)  # fmt: skip

    def context_keys(self) -> list[str]:
        """Keys of the context records (under well-formed names: ``scan`` reports the others)."""
        return [k for k in (key_of(n, RECORD, errors="replace") for n in self.backend.keys(RECORD)) if is_key(k)]

    # -- scanning -------------------------------------------------------------------------------
    def recorded_access(self, keys: Iterable[str] | None = None) -> dict[str, float]:
        """Last-use times as recorded in the store (``a/`` records), of ``keys`` or of every entry."""
        names = list(self.backend.keys(ACCESS)) if keys is None else [access_key(k) for k in keys]
        out = {}
        for k, raw in zip(names, self.backend.get_many(names)):
            if raw is not None and len(raw) == 8:
                out[key_of(k, ACCESS)] = struct.unpack("<d", raw)[0]
        return out

    def last_access(self, recorded: dict[str, float] | None = None) -> dict[str, float]:
        """Last-use times by entry key: what was recorded (``recorded``, read now if None), plus
        this handle's unsaved ones."""
        return (self.recorded_access() if recorded is None else recorded) | self._touched

    def scan(self, *, verify: bool = False, progress: Progress | None = None) -> StoreInfo:
        """Describe every entry from its header and every context from its record; with ``verify``
        also check each entry's checksum and decode its payload. Corrupt entries are reported,
        never raised; ``progress(1, stored bytes)`` is called after each entry."""
        return scan_store(self, verify=verify, progress=progress)

    def verify(self, progress: Progress | None = None) -> StoreInfo:
        """Same as ``scan(verify=True)``."""
        return self.scan(verify=True, progress=progress)


__all__ = ["KVStore"]
