"""What a store holds: scans, per-group totals, and garbage-collection plans.

A scan reads every entry's header (``verify=True``: every byte) and reports intact entries as
:class:`EntryInfo` and unreadable ones as :class:`CorruptInfo`, never raising for a bad entry.
:func:`summarize` totals entries per group (model, dtype, codec...), which ``kvstore stats`` and
``kvstore size --store`` both show. Removal is plan-then-execute: :func:`plan_gc` chooses,
:func:`execute_plan` removes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import EntryNotFoundError
from kvstore.units import human_bytes, human_time

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.entry import EntryHeader
    from kvstore.store.kvstore import KVStore


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
            "model_name": h.model_name,
            "model": h.model,
            "dtype": h.dtype,
            "n_tokens": h.n_tokens,
            "n_layers": h.n_layers,
            "kv_heads": h.kv_heads,
            "head_dim": h.head_dim,
            "codec": h.codec_spec,
            "format": h.format,
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

    @property
    def n_entries(self) -> int:
        return len(self.entries)

    @property
    def stored_bytes(self) -> int:
        return sum(e.stored_bytes for e in self.entries)

    @property
    def raw_bytes(self) -> int:
        return sum(e.raw_bytes for e in self.entries)

    @property
    def n_tokens(self) -> int:
        return sum(e.n_tokens for e in self.entries)

    @property
    def size_str(self) -> str:
        return human_bytes(self.stored_bytes)


@dataclass(frozen=True)
class GroupStats:
    """Totals over a group of entries (one model, dtype, codec...)."""

    model_name: str
    model: str
    dtype: str
    codec: str  # the codecs of the group's entries, comma-separated
    entries: int
    n_tokens: int
    kv_bytes: int  # keys and values alone, uncompressed: the size formula at each entry's length
    raw_bytes: int  # uncompressed payloads (KV + token ids + safetensors headers)
    stored_bytes: int  # what the entries occupy in the store, headers and checksums included

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

    def as_record(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "model": self.model,
            "dtype": self.dtype,
            "codec": self.codec,
            "entries": self.entries,
            "n_tokens": self.n_tokens,
            "kv_bytes": self.kv_bytes,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.ratio, 4),
            "bytes_per_token": round(self.bytes_per_token, 1),
            "kv_bytes_per_token": round(self.kv_bytes_per_token, 1),
            "stored_to_kv": round(self.stored_to_kv, 4),
        }


def summarize(entries: Iterable[EntryInfo], by: Sequence[str] = ("model_name", "model", "dtype")) -> list[GroupStats]:
    """Totals per group of entries sharing the ``by`` fields (names of :class:`EntryInfo`
    properties), sorted by those fields. Fields not grouped by are joined when they differ."""
    groups: dict[tuple, list[EntryInfo]] = {}
    for e in entries:
        groups.setdefault(tuple(getattr(e, f) for f in by), []).append(e)

    def joined(items: list[EntryInfo], attr: str) -> str:
        return ", ".join(sorted({str(getattr(e, attr)) for e in items}))

    return [
        GroupStats(
            model_name=joined(items, "model_name"),
            model=joined(items, "model"),
            dtype=joined(items, "dtype"),
            codec=joined(items, "codec"),
            entries=len(items),
            n_tokens=sum(e.n_tokens for e in items),
            kv_bytes=sum(e.header.kv_bytes for e in items),
            raw_bytes=sum(e.raw_bytes for e in items),
            stored_bytes=sum(e.stored_bytes for e in items),
        )
        for _, items in sorted(groups.items())
    ]


# -- garbage collection: plan, then execute ------------------------------------------------------
@dataclass(frozen=True)
class GcPlan:
    """Entries to remove and why; nothing is removed until :func:`execute_plan`."""

    remove: tuple[tuple[str, str, int], ...]  # (key, reason, stored_bytes)
    keep_bytes: int  # stored bytes of the intact entries left afterwards

    @property
    def n(self) -> int:
        return len(self.remove)

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
    now: float | None = None,
) -> GcPlan:
    """Choose entries to remove from a scan (nothing is removed here; see :func:`execute_plan`).

    ``model`` and ``keys`` narrow what may be removed (the *scope*): entries whose fingerprint
    starts with ``model`` or whose model name equals it, and entries whose key starts with one of
    ``keys``; both given means both must match. Within the scope, ``older_than`` (seconds since
    last use) removes old entries, then ``max_bytes`` removes least-recently-used entries until
    the scope's remaining entries fit in that many stored bytes. ``corrupt`` removes the entries
    that failed the scan (those matching ``keys`` when keys are given; a corrupt entry's model is
    unknown). With a scope but none of ``older_than``/``max_bytes``/``corrupt``, the whole scope
    is removed (``kvstore rm``), corrupt entries named by ``keys`` included. With nothing at all,
    nothing is removed.

    Raises EntryNotFoundError when a key prefix matches no entry.
    """
    now = time.time() if now is None else now
    for k in keys:
        if not any(e.key.startswith(k) for e in info.entries) and not any(c.key.startswith(k) for c in info.corrupt):
            raise EntryNotFoundError(f"no entry matches key {k!r} in {info.url}")

    def in_keys(key: str) -> bool:
        return not keys or any(key.startswith(k) for k in keys)

    def in_scope(e: EntryInfo) -> bool:
        return in_keys(e.key) and e.matches_model(model)

    has_scope = bool(model) or bool(keys)
    has_criterion = corrupt or older_than is not None or max_bytes is not None
    remove: dict[str, tuple[str, str, int]] = {}
    for c in info.corrupt:
        if (corrupt and in_keys(c.key)) or (keys and not has_criterion and in_keys(c.key)):
            remove[c.key] = (c.key, f"corrupt: {c.reason}", c.stored_bytes)
    scope = [e for e in info.entries if in_scope(e)]
    if has_scope and not has_criterion:
        for e in scope:
            remove[e.key] = (e.key, f"model {e.model_name}" if model else "asked for", e.stored_bytes)
    if older_than is not None:
        for e in scope:
            if now - e.last_used > older_than:
                remove[e.key] = (e.key, f"unused for {_age_str(now - e.last_used)}", e.stored_bytes)
    if max_bytes is not None:
        kept = sorted((e for e in scope if e.key not in remove), key=lambda e: (e.last_used, e.key))
        total = sum(e.stored_bytes for e in kept)
        for e in kept:
            if total <= max_bytes:
                break
            remove[e.key] = (e.key, "least recently used over the size budget", e.stored_bytes)
            total -= e.stored_bytes
    keep_bytes = sum(e.stored_bytes for e in info.entries if e.key not in remove)
    return GcPlan(tuple(remove.values()), keep_bytes)


def execute_plan(store: KVStore, plan: GcPlan) -> int:
    """Remove the planned entries in one transaction; returns how many were removed."""
    return store.delete_many(r[0] for r in plan.remove)


__all__ = [
    "CorruptInfo",
    "EntryInfo",
    "GcPlan",
    "GroupStats",
    "StoreInfo",
    "execute_plan",
    "plan_gc",
    "summarize",
]
