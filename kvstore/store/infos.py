"""What a scan reports, one value per thing stored: a chunk entry (:class:`EntryInfo`), an unreadable
value (:class:`CorruptInfo`), a derived entry (:class:`OwnedInfo`), a context (:class:`ContextInfo`),
and the context record a store keeps (:class:`ContextRecord`).

A scan (:mod:`kvstore.store.scan`) keeps what it saw in compact tables (:mod:`kvstore.store.tables`)
and makes these values when they are asked for: they are frozen, raw numbers in their fields, human
strings in properties, and ``as_record()`` gives every field as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.store.keyspace import is_key
from kvstore.store.kinds import keeps_part
from kvstore.units import human_bytes, human_time

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.header import EntryHeader


@dataclass(frozen=True)
class ContextRecord:
    """A context's record (backend key ``r/<key>``): its chain of chunk keys, its tokens, when
    it was recorded. ``key`` is the chain's last chunk key. ``passage``: the chain is a passage,
    stored alone at positions ``0..n-1`` to be placed in composed contexts (written only when
    true, so other records are byte for byte what earlier versions wrote)."""

    key: str
    chunks: tuple[str, ...]
    n_tokens: int
    created: float
    passage: bool = False

    def to_bytes(self) -> bytes:
        d: dict = {"chunks": list(self.chunks), "n_tokens": self.n_tokens, "created": self.created}
        if self.passage:
            d["passage"] = True
        return json.dumps(d).encode()

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
        return cls(key, chunks, n, created, d.get("passage") is True)


def kv_ratio(stored: int, kv: int) -> float | None:
    """Stored bytes over the keys and values they hold in the model's dtype (a lossy codec's saving
    included, unlike ``ratio``, whose uncompressed payload is already quantized); None without KV."""
    return round(stored / kv, 4) if kv else None


def matches_model(model: str, model_name: str, wanted: str | None) -> bool:
    """Whether ``wanted`` (a model name, or a prefix of a fingerprint) names the model
    ``model``/``model_name``; ``None`` matches everything."""
    return not wanted or model.startswith(wanted) or model_name == wanted


@dataclass(frozen=True)
class EntryInfo:
    """One intact chunk entry as a scan saw it: its header, its stored size and its last use."""

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
        return matches_model(self.model, self.model_name, model)

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
            "kv_ratio": kv_ratio(self.stored_bytes, h.kv_bytes),
            "created": h.created,
            "last_access": self.last_access,
            "last_used": self.last_used,
        }


@dataclass(frozen=True)
class CorruptInfo:
    """A stored value that does not read: its key, what is wrong, its stored size; ``context``:
    the context of a derived entry (``""`` for a chunk entry or a context record)."""

    key: str
    reason: str
    stored_bytes: int
    context: str = ""


@dataclass(frozen=True, slots=True)
class OwnedInfo:
    """One intact derived entry (a context's scores or pressed cache) as a scan saw it: its
    header's facts, its stored size and its last use. ``codec``: its codec spec; ``kept_pairs``
    and ``kept_fraction``: the (token, head) pairs a pressed cache keeps, and their share of the
    context's (1.0 for scores); ``press``: what made it."""

    context: str
    key: str
    kind: str
    spec: str
    model: str
    model_name: str
    dtype: str
    n_tokens: int
    codec: str
    kept_pairs: int
    kept_fraction: float
    raw_bytes: int
    kv_bytes: int
    stored_bytes: int
    created: float
    format: int
    press: Mapping[str, Any] = field(default_factory=dict)
    last_access: float | None = None

    @classmethod
    def of(cls, h: Any, stored: int, codec: str, share: Callable[[Any, Any], Any]) -> OwnedInfo:
        """The value of an owned entry from its header ``h`` (its ``codec`` spec parsed), its
        strings shared through ``share(value, value)`` with a scan's other values."""
        press = json.dumps(h.press, sort_keys=True)
        return cls(
            context=share(h.context, h.context), key=h.key, kind=share(h.kind, h.kind), spec=share(h.spec, h.spec),
            model=share(h.model, h.model), model_name=share(h.model_name, h.model_name),
            dtype=share(h.dtype, h.dtype), n_tokens=h.n_tokens, codec=share(codec, codec),
            kept_pairs=h.kept_pairs, kept_fraction=h.kept_fraction, raw_bytes=h.raw_bytes, kv_bytes=h.kv_bytes,
            stored_bytes=stored, created=h.created, format=h.format, press=share(press, h.press),
        )  # fmt: skip

    @property
    def last_used(self) -> float:
        return self.last_access if self.last_access is not None else self.created

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    def matches_model(self, model: str | None) -> bool:
        return matches_model(self.model, self.model_name, model)

    def summary(self) -> str:
        """One phrase for a table: ``pressed kvzip:0.75 int8:128/64 25% 1.2 MiB``."""
        kept = f" {self.kept_fraction:.0%}" if keeps_part(self.kind) else ""
        return f"{self.kind} {self.spec} {self.codec}{kept} {human_bytes(self.stored_bytes)}"

    def as_record(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "key": self.key,
            "kind": self.kind,
            "spec": self.spec,
            "model_name": self.model_name,
            "model": self.model,
            "dtype": self.dtype,
            "n_tokens": self.n_tokens,
            "codec": self.codec,
            "kept_pairs": self.kept_pairs,
            "kept_fraction": round(self.kept_fraction, 6) if keeps_part(self.kind) else None,
            "format": self.format,
            "press": dict(self.press),
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.ratio, 4),
            "kv_ratio": kv_ratio(self.stored_bytes, self.kv_bytes),
            "created": self.created,
            "last_access": self.last_access,
            "last_used": self.last_used,
        }


@dataclass(frozen=True)
class ContextInfo:
    """One context: its chain of chunk keys (a format-1 entry is a chain of one; a context stored
    only as pressed caches has none), what of it is stored, the facts of its first stored chunk,
    and its derived entries. ``missing`` counts chunks absent or corrupt; ``stored_bytes``,
    ``raw_bytes`` and ``kv_bytes`` are its chunks' (a shared chunk counted for every context that
    uses it), ``derived_bytes`` its derived entries'; ``last_access`` is the latest use of any of
    them. ``passage``: its record says it is a passage, stored alone to be placed in composed
    contexts."""

    key: str
    n_tokens: int
    chunks: tuple[str, ...]
    stored_bytes: int
    raw_bytes: int
    kv_bytes: int
    missing: int
    first: EntryInfo | None
    created: float
    last_access: float | None
    owned: tuple[OwnedInfo, ...] = ()
    passage: bool = False  # recorded as a passage, placed in composed contexts (kvstore.model.compose)
    derived = property(lambda self: self.owned, doc="Deprecated: ``owned``.")

    @property
    def complete(self) -> bool:
        return self.missing == 0

    @property
    def _about(self) -> EntryInfo | OwnedInfo | None:
        return self.first if self.first is not None else next(iter(self.owned), None)

    @property
    def model(self) -> str:
        return self._about.model if self._about else "?"

    @property
    def model_name(self) -> str:
        return self._about.model_name if self._about else "?"

    @property
    def dtype(self) -> str:
        return self._about.dtype if self._about else "?"

    @property
    def codec(self) -> str:
        return self._about.codec if self._about else "?"

    @property
    def format(self) -> int:
        if self.first is not None:
            return self.first.header.format
        return self.owned[0].format if self.owned else 2

    @property
    def numerics(self) -> dict[str, str]:
        return dict(self.first.header.numerics) if self.first else {}

    @property
    def owned_bytes(self) -> int:
        """Bytes of the entries this context owns (its derived entries)."""
        return sum(d.stored_bytes for d in self.owned)

    derived_bytes = owned_bytes  # the name it had before kinds were one table

    @property
    def last_used(self) -> float:
        return self.last_access if self.last_access is not None else self.created

    def matches_model(self, model: str | None) -> bool:
        return matches_model(self.model, self.model_name, model)

    def as_record(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "model_name": self.model_name,
            "model": self.model,
            "dtype": self.dtype,
            "n_tokens": self.n_tokens,
            "chunks": len(self.chunks),
            "passage": self.passage,
            "complete": self.complete,
            "codec": self.codec,
            "format": self.format,
            "numerics": self.numerics,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.stored_bytes / self.raw_bytes, 4) if self.raw_bytes else 1.0,
            "kv_ratio": kv_ratio(self.stored_bytes, self.kv_bytes),
            "created": self.created,
            "last_access": self.last_access,
            "last_used": self.last_used,
            "derived_bytes": self.derived_bytes,
            "derived": [
                {k: d.as_record()[k] for k in ("key", "kind", "spec", "codec", "kept_fraction", "stored_bytes")}
                for d in self.owned
            ],
        }


def context_of(key: str, chunks: tuple[str, ...], n_tokens: int, created: float, entries: Mapping[str, EntryInfo],
               access: Mapping[str, float]) -> ContextInfo:  # fmt: skip
    """A context made by hand from its chain and the entries by key (what a scan makes from its
    tables; tests and callers that hold :class:`EntryInfo` values use this)."""
    present = [entries[k] for k in chunks if k in entries]
    used = [access[k] for k in chunks if k in access]
    return ContextInfo(
        key=key, n_tokens=n_tokens, chunks=tuple(chunks), stored_bytes=sum(e.stored_bytes for e in present),
        raw_bytes=sum(e.raw_bytes for e in present), kv_bytes=sum(e.header.kv_bytes for e in present),
        missing=len(chunks) - len(present), first=entries.get(chunks[0]) if chunks else None,
        created=min((e.created for e in present), default=created), last_access=max(used) if used else None,
    )  # fmt: skip


def chain_problem(chunks: tuple[str, ...], entries: Mapping[str, EntryInfo]) -> str:
    """What is wrong with a context's chain given the intact entries of a scan by key (``""``:
    nothing): a chunk missing or corrupt, or one that does not continue the chunk before it."""
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


__all__ = [
    "ContextInfo",
    "ContextRecord",
    "CorruptInfo",
    "OwnedInfo",
    "EntryInfo",
    "chain_problem",
    "context_of",
    "kv_ratio",
    "matches_model",
]

DerivedInfo = OwnedInfo  # deprecated: the name it had
