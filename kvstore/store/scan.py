"""What a store holds: a scan of its entries and contexts.

A scan reads every entry's header (``verify=True``: every byte) and every context record. Intact
entries are :class:`EntryInfo`, unreadable ones :class:`CorruptInfo` (never raised). Contexts are
:class:`ContextInfo`: a chain of chunks (format 2) or one whole-context entry (format 1). A chunk
shared by several contexts is stored once, so a store has *physical* bytes (its entries) and
*logical* bytes (each context's chunks, counted per context); their ratio is the dedupe ratio.

Per-group totals are :mod:`kvstore.store.summary`; removal plans, :mod:`kvstore.store.gc`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.progress import Progress
from kvstore.store.keyspace import RECORD, entry_key, is_key, key_of
from kvstore.units import human_bytes, human_time

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.backends.base import Backend
    from kvstore.store.codecs import Codec
    from kvstore.store.header import EntryHeader
    from kvstore.store.meta import StoreMeta


@dataclass(frozen=True)
class ContextRecord:
    """A context's record (backend key ``r/<key>``): its chain of chunk keys, its tokens, when
    it was recorded. ``key`` is the chain's last chunk key."""

    key: str
    chunks: tuple[str, ...]
    n_tokens: int
    created: float

    def to_bytes(self) -> bytes:
        return json.dumps({"chunks": list(self.chunks), "n_tokens": self.n_tokens, "created": self.created}).encode()

    @classmethod
    def parse(cls, key: str, raw: bytes | memoryview) -> ContextRecord | None:
        """The record, or None when it is unreadable or inconsistent (see :meth:`read`)."""
        try:
            return cls.read(key, raw)
        except ValueError:
            return None

    @classmethod
    def read(cls, key: str, raw: bytes | memoryview) -> ContextRecord:
        """The record stored under ``r/<key>``; raises ValueError saying what is wrong when it is
        unreadable or inconsistent (its name a key, its last chunk that key, at least one token)."""
        if not is_key(key):
            raise ValueError("its name is not a key")
        try:
            d = json.loads(bytes(raw))
            chunks = tuple(d["chunks"])
            n, created = int(d["n_tokens"]), float(d["created"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            what = f"field {exc}" if isinstance(exc, KeyError) else "not a JSON object with chunks, n_tokens, created"
            raise ValueError(f"unreadable: {what}") from None
        if not chunks or not all(is_key(c) for c in chunks):
            raise ValueError("its chunks are not a list of keys")
        if chunks[-1] != key:
            raise ValueError("its last chunk is not its own key")
        if n < 1:
            raise ValueError("it counts no tokens")
        return cls(key, chunks, n, created)


@dataclass(frozen=True)
class EntryInfo:
    """One intact entry as a scan saw it: its header, its stored size and its last use."""

    header: EntryHeader
    stored_bytes: int
    last_access: float | None = None

    # the header's facts, flat
    @property
    def key(self) -> str:
        return self.header.key

    @property
    def model(self) -> str:
        return self.header.model

    @property
    def model_name(self) -> str:
        return self.header.model_name

    @property
    def dtype(self) -> str:
        return self.header.dtype

    @property
    def n_tokens(self) -> int:
        return self.header.n_tokens

    @property
    def n_layers(self) -> int:
        return self.header.n_layers

    @property
    def codec(self) -> str:
        return self.header.codec_spec

    @property
    def raw_bytes(self) -> int:
        return self.header.raw_bytes

    @property
    def created(self) -> float:
        return self.header.created

    @property
    def ratio(self) -> float:
        """Stored size as a fraction of the uncompressed safetensors size (lower is better)."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def last_used(self) -> float:
        return self.last_access if self.last_access is not None else self.created

    @property
    def size_str(self) -> str:
        return human_bytes(self.stored_bytes)

    @property
    def created_str(self) -> str:
        return human_time(self.created)

    def matches_model(self, model: str | None) -> bool:
        """Whether ``model`` (a model name, or a prefix of a fingerprint) names this entry's model;
        ``None`` matches everything."""
        return not model or self.model.startswith(model) or self.model_name == model

    def as_record(self) -> dict[str, Any]:
        """Every field as a flat, JSON-serialisable dict (sizes in bytes, times in epoch seconds)."""
        h = self.header
        return {
            "key": h.key,
            "parent": h.parent,
            "model_name": h.model_name,
            "model": h.model,
            "dtype": h.dtype,
            "start": h.start,
            "n_tokens": h.n_tokens,
            "n_layers": h.n_layers,
            "kv_heads": h.kv_heads,
            "head_dim": h.head_dim,
            "codec": h.codec_spec,
            "format": h.format,
            "numerics": dict(h.numerics),
            "raw_bytes": h.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.ratio, 4),
            "created": h.created,
            "last_access": self.last_access,
            "last_used": self.last_used,
        }


@dataclass(frozen=True)
class CorruptInfo:
    key: str
    reason: str
    stored_bytes: int


@dataclass(frozen=True)
class ContextInfo:
    """One context: its chain of chunk keys (a format-1 entry is a chain of one), what of it is
    stored, and the facts of its first stored chunk. ``missing`` counts chunks absent or corrupt."""

    key: str
    n_tokens: int
    chunks: tuple[str, ...]
    stored_bytes: int  # logical: every chunk of this context, shared ones included
    raw_bytes: int
    kv_bytes: int
    missing: int
    first: EntryInfo | None
    created: float
    last_access: float | None

    @property
    def complete(self) -> bool:
        return self.missing == 0

    @property
    def model(self) -> str:
        return self.first.model if self.first else "?"

    @property
    def model_name(self) -> str:
        return self.first.model_name if self.first else "?"

    @property
    def dtype(self) -> str:
        return self.first.dtype if self.first else "?"

    @property
    def codec(self) -> str:
        return self.first.codec if self.first else "?"

    @property
    def format(self) -> int:
        return self.first.header.format if self.first else 2

    @property
    def numerics(self) -> dict[str, str]:
        return dict(self.first.header.numerics) if self.first else {}

    @property
    def last_used(self) -> float:
        return self.last_access if self.last_access is not None else self.created

    def matches_model(self, model: str | None) -> bool:
        return not model or self.model.startswith(model) or self.model_name == model

    def as_record(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "model_name": self.model_name,
            "model": self.model,
            "dtype": self.dtype,
            "n_tokens": self.n_tokens,
            "chunks": len(self.chunks),
            "complete": self.complete,
            "codec": self.codec,
            "format": self.format,
            "numerics": self.numerics,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.stored_bytes / self.raw_bytes, 4) if self.raw_bytes else 1.0,
            "created": self.created,
            "last_access": self.last_access,
            "last_used": self.last_used,
        }


@dataclass(frozen=True)
class StoreInfo:
    """A store's description and contents (see :meth:`KVStore.scan`)."""

    url: str
    format: int
    codec: str
    created: float
    entries: tuple[EntryInfo, ...]
    corrupt: tuple[CorruptInfo, ...]
    disk_bytes: int | None
    verified: bool
    contexts: tuple[ContextInfo, ...] = ()
    chunk_tokens: int = 0
    refs: dict[str, int] = field(default_factory=dict, compare=False)  # chunk key -> contexts using it
    # last-use records as stored when scanned (not this handle's unsaved uses): what a removal
    # plan compares with before it removes anything
    recorded_access: dict[str, float] = field(default_factory=dict, compare=False)
    # through a local tier: its copies that failed (the remote's copies are what ``corrupt`` lists)
    local_corrupt: tuple[CorruptInfo, ...] = ()
    malformed: tuple[CorruptInfo, ...] = ()  # context records that do not read (r/ keys)

    @property
    def n_entries(self) -> int:
        return len(self.entries)

    @property
    def stored_bytes(self) -> int:
        """Physical bytes: every intact entry once."""
        return sum(e.stored_bytes for e in self.entries)

    @property
    def logical_bytes(self) -> int:
        """Every context's chunks, a shared chunk counted once per context that uses it."""
        return sum(c.stored_bytes for c in self.contexts)

    @property
    def dedupe_ratio(self) -> float:
        """Logical / physical bytes of the chunks contexts use (1.0: nothing shared)."""
        used = sum(e.stored_bytes for e in self.entries if self.refs.get(e.key))
        return self.logical_bytes / used if used else 1.0

    @property
    def raw_bytes(self) -> int:
        return sum(e.raw_bytes for e in self.entries)

    @property
    def n_tokens(self) -> int:
        """Tokens of the contexts (not of the chunks, which a shared prefix would count once)."""
        return sum(c.n_tokens for c in self.contexts)

    @property
    def orphans(self) -> tuple[EntryInfo, ...]:
        """Chunks no context record uses (a build in progress, or left by removed contexts)."""
        return tuple(e for e in self.entries if e.header.format >= 2 and not self.refs.get(e.key))

    @property
    def size_str(self) -> str:
        return human_bytes(self.stored_bytes)


class ScannedStore(Protocol):
    """What :func:`scan_store` reads of a store (a :class:`kvstore.store.kvstore.KVStore`; the
    interface keeps this module below the store, which calls it)."""

    backend: Backend
    url: str
    meta: StoreMeta
    codec: Codec

    @property
    def format(self) -> int: ...

    @property
    def chunk_tokens(self) -> int: ...

    def keys(self) -> list[str]: ...

    def peek_header(self, key: str, *, origin: bool = False) -> tuple[EntryHeader, int] | None: ...

    def recorded_access(self, keys: Any = None) -> dict[str, float]: ...

    def last_access(self, recorded: dict[str, float] | None = None) -> dict[str, float]: ...


def scan_store(store: ScannedStore, *, verify: bool = False, progress: Progress | None = None) -> StoreInfo:
    """See :meth:`KVStore.scan`. Through a local tier the remote's copy of an entry is what counts:
    a bad copy in the tier is listed in ``local_corrupt``, not in ``corrupt``."""
    recorded = store.recorded_access()
    access = store.last_access(recorded)
    entries: dict[str, EntryInfo] = {}
    corrupt: list[CorruptInfo] = []
    local_corrupt: list[CorruptInfo] = []
    tiered = store.backend.origin() is not store.backend
    for key in store.keys():
        size = 0
        try:
            got = _read_entry(store, key, verify, local_corrupt if tiered else None)
        except (CorruptEntryError, FormatVersionError) as exc:
            peeked = store.backend.origin().peek(entry_key(key), 1)
            size = 0 if peeked is None else peeked[1]
            corrupt.append(CorruptInfo(key, str(exc), size))
        else:
            if got is None:  # deleted while we scanned
                continue
            header, size = got
            entries[key] = EntryInfo(header, size, access.get(key))
        if progress is not None:
            progress(1, size)
    contexts = []
    records, malformed = _records(store)
    for r in records:
        contexts.append(_context(r.key, r.chunks, r.n_tokens, r.created, entries, access))
    for e in entries.values():
        if e.header.format == 1:  # a whole-context entry is its own context
            contexts.append(_context(e.key, (e.key,), e.n_tokens, e.created, entries, access))
    refs: dict[str, int] = {}
    for c in contexts:
        for k in set(c.chunks):
            refs[k] = refs.get(k, 0) + 1
    return StoreInfo(
        url=store.url,
        format=store.format,
        codec=store.codec.spec,
        created=float(store.meta.created),
        entries=tuple(entries.values()),
        corrupt=tuple(corrupt),
        disk_bytes=store.backend.disk_bytes(),
        verified=verify,
        contexts=tuple(contexts),
        chunk_tokens=store.chunk_tokens,
        refs=refs,
        recorded_access=recorded,
        local_corrupt=tuple(local_corrupt),
        malformed=malformed,
    )


def _records(store: ScannedStore) -> tuple[list[ContextRecord], tuple[CorruptInfo, ...]]:
    """Every context record that reads, and the malformed ones (``key``, what is wrong, size)."""
    records, malformed = [], []
    names = list(store.backend.keys(RECORD))
    for name, raw in zip(names, store.backend.get_many(names)):
        if raw is None:  # removed while we listed
            continue
        key = key_of(name, RECORD, errors="replace")
        try:
            records.append(ContextRecord.read(key, raw))
        except ValueError as exc:
            malformed.append(CorruptInfo(key, f"malformed context record: {exc}", len(raw)))
    return records, tuple(malformed)


def _read_entry(
    store: ScannedStore, key: str, verify: bool, local_bad: list[CorruptInfo] | None
) -> tuple[EntryHeader, int] | None:
    """(header, stored size) of an entry, or None when it is gone; raises CorruptEntryError or
    FormatVersionError for the copy that counts. ``verify``: every byte of the origin's copy
    (and, with ``local_bad``, the local tier's copy too); else its header only (a remote
    listing downloads no entry), from the tier's copy when it has one and that reads."""
    from kvstore.store.entry import decode_entry

    if verify:
        if local_bad is not None:
            with store.backend.local_copy(entry_key(key)) as copy:
                if copy is not None:
                    try:
                        decode_entry(copy, key=key)
                    except (CorruptEntryError, FormatVersionError) as exc:
                        local_bad.append(CorruptInfo(key, str(exc), len(copy)))
        with store.backend.origin().view(entry_key(key)) as buf:
            return None if buf is None else (decode_entry(buf, key=key).header, len(buf))
    try:
        got = store.peek_header(key)
        if got is not None and got[0].key != key:
            raise CorruptEntryError("entry header names another key")
    except CorruptEntryError as exc:
        if local_bad is None:
            raise
        got = store.peek_header(key, origin=True)  # the tier's copy is bad; the remote's decides
        if got is not None and got[0].key != key:
            raise CorruptEntryError("entry header names another key") from None
        local_bad.append(CorruptInfo(key, str(exc), got[1] if got else 0))
    return got


def chain_problem(chunks: tuple[str, ...], entries: dict[str, EntryInfo]) -> str:
    """What is wrong with a context's chain given the intact entries of a scan (``""``: nothing):
    a chunk missing or corrupt, or one that does not continue the chunk before it."""
    parent, start = "", 0
    for i, key in enumerate(chunks):
        e = entries.get(key)
        if e is None:
            return f"chunk {i + 1} of {len(chunks)} ({key[:12]}) is missing or corrupt"
        h = e.header
        if len(chunks) > 1 or h.format >= 2:
            if h.parent != parent or h.start != start:
                return f"chunk {i + 1} of {len(chunks)} ({key[:12]}) does not continue the chain"
        parent, start = key, h.end
    return ""


def _context(key, chunks, n_tokens, created, entries: dict[str, EntryInfo], access) -> ContextInfo:
    present = [entries[k] for k in chunks if k in entries]
    used = [access[k] for k in chunks if k in access]
    created = min((e.created for e in present), default=created)  # when its chain was first stored
    return ContextInfo(
        key=key,
        n_tokens=n_tokens,
        chunks=tuple(chunks),
        stored_bytes=sum(e.stored_bytes for e in present),
        raw_bytes=sum(e.raw_bytes for e in present),
        kv_bytes=sum(e.header.kv_bytes for e in present),
        missing=len(chunks) - len(present),
        first=entries.get(chunks[0]),
        created=created,
        last_access=max(used) if used else None,
    )


__all__ = [
    "ContextInfo",
    "ContextRecord",
    "CorruptInfo",
    "EntryInfo",
    "ScannedStore",
    "StoreInfo",
    "chain_problem",
    "scan_store",
]
