"""Totals per group of contexts (model, dtype, codec...) from a scan: what ``kvstore stats`` and
``kvstore size --store`` both show. Logical bytes count each context's chunks; physical bytes count
the group's distinct chunks once (their ratio is the dedupe ratio)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.scan import ContextInfo, StoreInfo


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


__all__ = ["GroupStats", "summarize"]
