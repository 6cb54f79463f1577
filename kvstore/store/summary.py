"""Totals per group of contexts (model, dtype, codec...) from a scan: what ``kvstore stats`` and
``kvstore size --store`` both show. Logical bytes count each context's chunks; physical bytes count
the group's distinct chunks once (their ratio is the dedupe ratio). Derived entries (scores, pressed
caches) are totalled per kind apart (:func:`owned_totals`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.infos import OwnedInfo
    from kvstore.store.scan import StoreInfo
    from kvstore.store.tables import EntryTable


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
    """Totals per group of the contexts that have chunks (a context stored only as pressed caches
    is in :func:`owned_totals`), grouped by the ``by`` fields (``model_name``, ``model``,
    ``dtype``, ``codec``: their first chunk's), sorted by those fields. Fields not grouped by are
    joined when they differ."""
    C, E = info.contexts, info.entries
    groups: dict[tuple, list[int]] = {}
    facts: dict[int, dict[str, str]] = {}
    for i in range(len(C)):
        rows = C.rows(i)
        if not len(rows):
            continue
        f = _facts(E, rows[0])
        facts[i] = f
        groups.setdefault(tuple(f[name] for name in by), []).append(i)

    def joined(items: list[int], name: str) -> str:
        return ", ".join(sorted({facts[i][name] for i in items}))

    out = []
    for _, items in sorted(groups.items()):
        seen = bytearray(len(E))  # the group's distinct chunks, each counted once
        physical = kv = raw = 0
        for i in items:
            for r in C.rows(i):
                if r >= 0:
                    kv, raw = kv + E.profile(r).kv_bytes, raw + E.raw(r)
                    if not seen[r]:
                        seen[r] = 1
                        physical += E.stored(r)
        out.append(GroupStats(
            model_name=joined(items, "model_name"), model=joined(items, "model"), dtype=joined(items, "dtype"),
            codec=joined(items, "codec"), contexts=len(items), n_tokens=sum(C.n_tokens(i) for i in items),
            kv_bytes=kv, raw_bytes=raw, stored_bytes=sum(C.stored(i) for i in items), physical_bytes=physical,
        ))  # fmt: skip
    return out


def _facts(entries: EntryTable, row: int) -> dict[str, str]:
    if row < 0:
        return {"model_name": "?", "model": "?", "dtype": "?", "codec": "?"}
    p = entries.profile(row)
    return {"model_name": p.model_name, "model": p.model, "dtype": p.dtype, "codec": p.codec}


@dataclass(frozen=True)
class OwnedStats:
    """Totals over the derived entries of one kind (``scores`` or ``pressed``): entries, the
    contexts they belong to, their stored and uncompressed bytes, the (token, head) pairs a pressed
    cache keeps and the share of its contexts' pairs that is, and the specs and codecs seen."""

    kind: str
    entries: int
    contexts: int
    stored_bytes: int
    raw_bytes: int
    kv_bytes: int
    kept_pairs: int
    kept_fraction: float
    specs: str
    codecs: str

    def as_record(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "entries": self.entries, "contexts": self.contexts, "stored_bytes": self.stored_bytes,
            "raw_bytes": self.raw_bytes, "kv_bytes": self.kv_bytes, "kept_pairs": self.kept_pairs,
            "kept_fraction": round(self.kept_fraction, 4), "specs": self.specs, "codecs": self.codecs,
        }  # fmt: skip


def owned_totals(info: StoreInfo) -> list[OwnedStats]:
    """Totals of the entries the store's contexts own (derived entries), per kind (none: an empty list)."""
    by: dict[str, list[OwnedInfo]] = {}
    for d in info.owned:
        by.setdefault(d.kind, []).append(d)
    out = []
    for kind, items in sorted(by.items()):
        pairs = sum(d.kept_pairs for d in items)
        possible = sum(d.kept_pairs / d.kept_fraction for d in items if d.kept_fraction > 0)
        out.append(OwnedStats(
            kind=kind, entries=len(items), contexts=len({d.context for d in items}),
            stored_bytes=sum(d.stored_bytes for d in items), raw_bytes=sum(d.raw_bytes for d in items),
            kv_bytes=sum(d.kv_bytes for d in items), kept_pairs=pairs,
            kept_fraction=pairs / possible if possible else 1.0, specs=", ".join(sorted({d.spec for d in items})),
            codecs=", ".join(sorted({d.codec for d in items})),
        ))  # fmt: skip
    return out


DerivedStats = OwnedStats  # deprecated: the names they had
derived_totals = owned_totals

__all__ = ["GroupStats", "OwnedStats", "owned_totals", "summarize"]
