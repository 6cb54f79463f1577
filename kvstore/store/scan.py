"""What a store holds: scans, per-group totals, and garbage-collection plans.

A scan reads every entry's header (``verify=True``: every byte) and every context record. Intact
entries are :class:`EntryInfo`, unreadable ones :class:`CorruptInfo` (never raised). Contexts are
:class:`ContextInfo`: a chain of chunks (format 2) or one whole-context entry (format 1). A chunk
shared by several contexts is stored once, so a store has *physical* bytes (its entries) and
*logical* bytes (each context's chunks, counted per context); their ratio is the dedupe ratio.

:func:`summarize` totals contexts per group (model, dtype, codec...), which ``kvstore stats`` and
``kvstore size --store`` both show. Removal is plan-then-execute: :func:`plan_gc` chooses contexts
and chunks, :func:`execute_plan` removes them. A chunk goes only when no remaining context uses it;
a chunk no context uses (an *orphan*) goes once its last use is older than a grace period, so that
a build running meanwhile, which writes its chunks first and its context record last, and marks
the chunks it reuses as used, never loses one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import CorruptEntryError, EntryNotFoundError, FormatVersionError
from kvstore.progress import Progress
from kvstore.store.keyspace import entry_key, is_key
from kvstore.units import human_bytes, human_time

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.entry import EntryHeader
    from kvstore.store.kvstore import KVStore

DEFAULT_GRACE_SECONDS = 3600.0


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
        """The record, or None when it is unreadable or inconsistent (its last chunk must be its key)."""
        try:
            d = json.loads(bytes(raw))
            chunks = tuple(d["chunks"])
            n, created = int(d["n_tokens"]), float(d["created"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            return None
        if not chunks or chunks[-1] != key or n < 1 or not all(is_key(c) for c in chunks):
            return None
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


def scan_store(store: KVStore, *, verify: bool = False, progress: Progress | None = None) -> StoreInfo:
    """See :meth:`KVStore.scan`."""
    from kvstore.store.entry import decode_entry

    access = store.last_access()
    entries: dict[str, EntryInfo] = {}
    corrupt: list[CorruptInfo] = []
    for key in store.keys():
        size = 0
        try:
            if verify:
                with store.backend.view(entry_key(key)) as buf:
                    got = None if buf is None else (decode_entry(buf, key=key).header, len(buf))
            else:  # the header only: a remote store's listing does not download the entries
                got = store.peek_header(key)
                if got is not None and got[0].key != key:
                    raise CorruptEntryError("entry header names another key")
        except (CorruptEntryError, FormatVersionError) as exc:
            peeked = store.backend.peek(entry_key(key), 1)
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
    records = [r for r in (store.context(k) for k in store.context_keys()) if r is not None]
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
    )


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


@dataclass(frozen=True)
class GroupStats:
    """Totals over a group of contexts (one model, dtype, codec...)."""

    model_name: str
    model: str
    dtype: str
    codec: str  # the codecs of the group's contexts, comma-separated
    contexts: int
    n_tokens: int
    kv_bytes: int  # keys and values alone, uncompressed, of every context's chunks
    raw_bytes: int  # uncompressed payloads (KV + token ids + safetensors headers), per context
    stored_bytes: int  # logical: each context's chunks, headers and checksums included
    physical_bytes: int  # the group's distinct chunks, each once

    @property
    def ratio(self) -> float:
        """Stored bytes / uncompressed payload bytes."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def bytes_per_token(self) -> float:
        return self.stored_bytes / self.n_tokens if self.n_tokens else 0.0

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes / self.n_tokens if self.n_tokens else 0.0

    @property
    def stored_to_kv(self) -> float:
        """Stored bytes / the size formula's estimate (< 1: the codec saves)."""
        return self.stored_bytes / self.kv_bytes if self.kv_bytes else 0.0

    @property
    def dedupe_ratio(self) -> float:
        return self.stored_bytes / self.physical_bytes if self.physical_bytes else 1.0

    def as_record(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "model": self.model,
            "dtype": self.dtype,
            "codec": self.codec,
            "contexts": self.contexts,
            "n_tokens": self.n_tokens,
            "kv_bytes": self.kv_bytes,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "physical_bytes": self.physical_bytes,
            "dedupe_ratio": round(self.dedupe_ratio, 4),
            "ratio": round(self.ratio, 4),
            "bytes_per_token": round(self.bytes_per_token, 1),
            "kv_bytes_per_token": round(self.kv_bytes_per_token, 1),
            "stored_to_kv": round(self.stored_to_kv, 4),
        }


def summarize(info: StoreInfo, by: Sequence[str] = ("model_name", "model", "dtype", "codec")) -> list[GroupStats]:
    """Totals per group of contexts sharing the ``by`` fields (names of :class:`ContextInfo`
    properties), sorted by those fields. Fields not grouped by are joined when they differ."""
    groups: dict[tuple, list[ContextInfo]] = {}
    for c in info.contexts:
        groups.setdefault(tuple(str(getattr(c, f)) for f in by), []).append(c)
    sizes = {e.key: e.stored_bytes for e in info.entries}

    def joined(items: list[ContextInfo], attr: str) -> str:
        return ", ".join(sorted({str(getattr(c, attr)) for c in items}))

    return [
        GroupStats(
            model_name=joined(items, "model_name"),
            model=joined(items, "model"),
            dtype=joined(items, "dtype"),
            codec=joined(items, "codec"),
            contexts=len(items),
            n_tokens=sum(c.n_tokens for c in items),
            kv_bytes=sum(c.kv_bytes for c in items),
            raw_bytes=sum(c.raw_bytes for c in items),
            stored_bytes=sum(c.stored_bytes for c in items),
            physical_bytes=sum(sizes.get(k, 0) for k in {k for c in items for k in c.chunks}),
        )
        for _, items in sorted(groups.items())
    ]


# -- garbage collection: plan, then execute ------------------------------------------------------
@dataclass(frozen=True)
class GcPlan:
    """What to remove and why; nothing is removed until :func:`execute_plan`. ``contexts``:
    context records ``(key, reason, logical bytes)``; ``remove``: entries ``(key, reason, stored
    bytes)`` (chunks no kept context uses, format-1 entries, corrupt entries)."""

    remove: tuple[tuple[str, str, int], ...]
    keep_bytes: int  # stored bytes of the intact entries left afterwards
    contexts: tuple[tuple[str, str, int], ...] = ()

    @property
    def n(self) -> int:
        return len(self.remove) + len([c for c in self.contexts if c[0] not in {r[0] for r in self.remove}])

    @property
    def freed_bytes(self) -> int:
        return sum(r[2] for r in self.remove)


def _age_str(seconds: float) -> str:
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} minutes"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"


def plan_gc(
    info: StoreInfo,
    *,
    corrupt: bool = False,
    model: str | None = None,
    older_than: float | None = None,
    max_bytes: int | None = None,
    keys: Sequence[str] = (),
    orphans: bool = False,
    grace: float = DEFAULT_GRACE_SECONDS,
    now: float | None = None,
) -> GcPlan:
    """Choose contexts and entries to remove from a scan (see :func:`execute_plan`).

    ``model`` and ``keys`` narrow which contexts may go (the *scope*): contexts whose fingerprint
    starts with ``model`` or whose model name equals it, and whose key starts with one of ``keys``
    (a key prefix may also name an entry that no context uses, a chunk or a corrupt entry). Within
    the scope, ``older_than`` (seconds since last use) removes old contexts, then ``max_bytes``
    removes least-recently-used contexts until the scope's chunks fit in that many stored bytes.
    With a scope but none of ``older_than``/``max_bytes``/``corrupt``, the whole scope goes
    (``kvstore rm``). A removed context's chunks go when no kept context uses them. ``corrupt``
    removes the entries that failed the scan; ``orphans`` removes chunks no context uses whose last
    use is older than ``grace`` seconds. With nothing at all, nothing is removed.

    Raises EntryNotFoundError when a key prefix matches nothing.
    """
    now = time.time() if now is None else now
    contexts = {c.key: c for c in info.contexts}
    entries = {e.key: e for e in info.entries}
    for k in keys:
        if not any(x.startswith(k) for x in (*contexts, *entries, *(c.key for c in info.corrupt))):
            raise EntryNotFoundError(f"no context or entry matches key {k!r} in {info.url}")

    def in_keys(key: str) -> bool:
        return not keys or any(key.startswith(k) for k in keys)

    scope = [c for c in info.contexts if in_keys(c.key) and c.matches_model(model)]
    has_criterion = corrupt or older_than is not None or max_bytes is not None or orphans
    drop: dict[str, str] = {}  # context key -> reason
    if (model or keys) and not has_criterion:
        for c in scope:
            drop[c.key] = f"model {c.model_name}" if model else "asked for"
    if older_than is not None:
        for c in scope:
            if now - c.last_used > older_than:
                drop[c.key] = f"unused for {_age_str(now - c.last_used)}"
    refs = dict(info.refs)

    def release(c: ContextInfo) -> None:
        for k in set(c.chunks):
            refs[k] = refs.get(k, 1) - 1

    for key in drop:
        release(contexts[key])
    remove: dict[str, tuple[str, str, int]] = {}
    if max_bytes is not None:
        kept = sorted((c for c in scope if c.key not in drop), key=lambda c: (c.last_used, c.key))
        scope_chunks = {k for c in scope for k in c.chunks}
        total = sum(entries[k].stored_bytes for k in scope_chunks if k in entries and refs.get(k, 0) > 0)
        for c in kept:
            if total <= max_bytes:
                break
            drop[c.key] = "least recently used over the size budget"
            release(c)
            total -= sum(entries[k].stored_bytes for k in set(c.chunks) if k in entries and refs.get(k, 0) == 0)
    for key, why in drop.items():
        for k in dict.fromkeys(contexts[key].chunks):
            if k in entries and refs.get(k, 0) <= 0 and k not in remove:
                remove[k] = (k, f"chunk of a removed context ({why})" if k != key else why, entries[k].stored_bytes)
    if keys and not has_criterion:  # entries named by key that no context uses
        for e in info.entries:
            if in_keys(e.key) and not info.refs.get(e.key) and e.matches_model(model):
                remove.setdefault(e.key, (e.key, "asked for", e.stored_bytes))
    for bad in info.corrupt:
        if (corrupt and in_keys(bad.key)) or (keys and not has_criterion and in_keys(bad.key)):
            remove[bad.key] = (bad.key, f"corrupt: {bad.reason}", bad.stored_bytes)
    if corrupt:  # a context that uses a removed entry is dropped; its intact chunks stay for a rebuild
        gone = {bad.key for bad in info.corrupt} & set(remove)
        for c in info.contexts:
            if c.key not in drop and gone & set(c.chunks):
                drop[c.key] = "uses a corrupt entry"
    if orphans:
        for e in info.orphans:
            if e.matches_model(model) and in_keys(e.key) and now - e.last_used > grace:
                remove.setdefault(e.key, (e.key, f"no context uses it (unused for {_age_str(now - e.last_used)})",
                                          e.stored_bytes))  # fmt: skip
    keep_bytes = sum(e.stored_bytes for e in info.entries if e.key not in remove)
    context_rows = tuple((k, why, contexts[k].stored_bytes) for k, why in drop.items())
    return GcPlan(tuple(remove.values()), keep_bytes, context_rows)


def execute_plan(store: KVStore, plan: GcPlan) -> int:
    """Remove the planned context records and entries; returns how many entries were removed."""
    return store.delete_many((r[0] for r in plan.remove), contexts=(c[0] for c in plan.contexts))


__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "ContextInfo",
    "ContextRecord",
    "CorruptInfo",
    "EntryInfo",
    "GcPlan",
    "GroupStats",
    "StoreInfo",
    "execute_plan",
    "plan_gc",
    "scan_store",
    "summarize",
]
