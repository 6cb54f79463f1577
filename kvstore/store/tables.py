"""Compact tables of what a scan saw, so that a store of a million chunks can be listed, summed and
planned in a few hundred megabytes.

A scan used to keep every entry's parsed header (its layer records, its codec's frame table: ~4.7 KB
of Python objects per chunk). Here each chunk is one row of columns: its key in one sorted list,
its numbers in ``array`` columns (start, tokens, bytes, times), its parent as 32 raw bytes, and
what rows share (model, dtype, codec, numerics, layer records) interned once as a
:class:`Profile`. A context is a slice of chunk rows. The values callers see
(:class:`~kvstore.store.infos.EntryInfo`, :class:`~kvstore.store.infos.ContextInfo`) are made when
asked for, and the tables are sequences of them.
"""

from __future__ import annotations

import json
import math
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar, overload

from kvstore.errors import CorruptEntryError
from kvstore.store.codecs import codec_from_params
from kvstore.store.header import EntryHeader
from kvstore.store.infos import ContextInfo, EntryInfo, OwnedInfo

_NONE = math.nan  # no recorded use
_NO_PARENT = bytes(32)
# codec params that differ per entry (frame and part tables) and never change the codec's spec
_PER_ENTRY_PARAMS = ("frames", "parts")
T = TypeVar("T")


class Profile:
    """What many chunk entries share: model, dtype, codec (spec, losslessness and one entry's
    params of it), format, numerics and layer records, with the sizes the records imply."""

    __slots__ = ("model", "model_name", "dtype", "codec", "lossless", "format", "numerics", "layers", "params",
                 "kv_bytes", "kv_heads", "head_dim")  # fmt: skip

    def __init__(self, header: EntryHeader, codec: str, lossless: bool):
        self.model, self.model_name, self.dtype = header.model, header.model_name, header.dtype
        self.codec, self.lossless, self.format = codec, lossless, header.format
        self.numerics, self.layers, self.params = dict(header.numerics), header.layers, header.codec
        self.kv_bytes, self.kv_heads, self.head_dim = header.kv_bytes, header.kv_heads, header.head_dim


class Codecs:
    """Codec params -> (spec, lossless), parsed once per codec (not per entry)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, bool]] = {}
        self._last: tuple[Mapping | None, tuple[str, bool]] = (None, ("?", True))

    def __call__(self, params: Mapping) -> tuple[str, bool]:
        if params is self._last[0]:  # the same header's codec, asked again (its sizes, then its row)
            return self._last[1]
        got = self._parse(params)
        self._last = (params, got)
        return got

    def _parse(self, params: Mapping) -> tuple[str, bool]:
        try:
            key = json.dumps({k: v for k, v in params.items() if k not in _PER_ENTRY_PARAMS}, sort_keys=True)
        except (TypeError, ValueError, AttributeError):
            key = ""
        got = self._seen.get(key) if key else None
        if got is None:
            try:
                codec = codec_from_params(params)
                got = (codec.spec, codec.lossless)
            except CorruptEntryError:
                got = ("?", True)
            if key:
                self._seen[key] = got
        return got


class _Values(Sequence[T]):
    """A table as the sequence of the values its rows make (``info(row)``), one row per key."""

    keys: list[str]

    def info(self, row: int) -> T:  # pragma: no cover - each table's
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.info(j) for j in range(len(self))[i]]
        return self.info(range(len(self))[i])

    def __iter__(self) -> Iterator[T]:
        return (self.info(i) for i in range(len(self)))


class EntryTable(_Values[EntryInfo]):
    """Every intact entry of a scan, of every kind: chunks one row each, in key order, as columns
    (see the module docstring; the table is the sequence of their values), and the entries contexts
    own (``owned``: a few per context, one value each, strings shared). ``touched``: this handle's
    uses not yet recorded; ``other_access``: recorded last uses of keys that are no chunk (owned
    entries, stale records)."""

    def __init__(self, touched: Mapping[str, float] | None = None, codecs: Codecs | None = None):
        self.keys: list[str] = []
        self._parents, self._has_parent = bytearray(), bytearray()
        self._start, self._tokens, self._raw, self._stored = array("q"), array("q"), array("q"), array("q")
        self._created, self._recorded, self._profile = array("d"), array("d"), array("i")
        self.profiles: list[Profile] = []
        self._profiles: dict[tuple, int] = {}
        self.codecs = codecs or Codecs()
        self.touched = dict(touched or {})
        self.other_access: dict[str, float] = {}
        self.refs = array("i")  # contexts using each row (ContextTable.finish)
        self.owned: list[OwnedInfo] = []  # their last uses are filled in when read (owned_infos)
        self._shared: dict[Any, Any] = {}

    # -- building ---------------------------------------------------------------------------------
    def add(self, header: Any, stored: int, recorded: float | None = None, *, owned: bool = False) -> None:
        """Append one entry (chunk rows are sorted by :meth:`finish`); ``owned``: an entry a context
        owns (``header`` its kind's)."""
        if owned:
            self.owned.append(OwnedInfo.of(header, stored, self.codecs(header.codec)[0], self._shared.setdefault))
            return
        spec, lossless = self.codecs(header.codec)
        numerics = tuple(sorted(header.numerics.items()))
        key = (header.model, header.model_name, header.dtype, spec, lossless, header.format, numerics, header.layers)
        index = self._profiles.get(key)
        if index is None:
            index = self._profiles[key] = len(self.profiles)
            self.profiles.append(Profile(header, spec, lossless))
        self.keys.append(header.key)
        self._parents += bytes.fromhex(header.parent) if header.parent else _NO_PARENT
        self._has_parent.append(bool(header.parent))
        for column, value in ((self._start, header.start), (self._tokens, header.n_tokens),
                              (self._raw, header.raw_bytes), (self._stored, stored)):  # fmt: skip
            column.append(value)
        self._created.append(header.created)
        self._recorded.append(_NONE if recorded is None else recorded)
        self._profile.append(index)

    def owned_infos(self) -> list[OwnedInfo]:
        """The owned entries' values, each with its last use (read once the uses are)."""
        return [replace(d, last_access=self.access_of(d.key)) for d in self.owned]

    def finish(self) -> None:
        """Sort the rows by key (a backend lists them sorted already: then nothing moves)."""
        keys = self.keys
        if all(keys[i] < keys[i + 1] for i in range(len(keys) - 1)):
            return
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.keys = [keys[i] for i in order]
        for name in ("_start", "_tokens", "_raw", "_stored", "_created", "_recorded", "_profile"):
            old = getattr(self, name)
            setattr(self, name, array(old.typecode, (old[i] for i in order)))
        parents = self._parents
        self._parents = bytearray(b"".join(parents[32 * i : 32 * i + 32] for i in order))
        self._has_parent = bytearray(self._has_parent[i] for i in order)

    def set_recorded(self, key: str, when: float) -> None:
        """The recorded last use of ``key`` (a chunk's column, or ``other_access``)."""
        row = self.row(key)
        if row >= 0:
            self._recorded[row] = when
        else:
            self.other_access[key] = when

    # -- rows -------------------------------------------------------------------------------------
    def row(self, key: str) -> int:
        """The row of ``key``, or -1 when no intact chunk has it."""
        i = bisect_left(self.keys, key)
        return i if i < len(self.keys) and self.keys[i] == key else -1

    def rows_with_prefix(self, prefix: str) -> range:
        """The rows whose key starts with ``prefix``."""
        lo = bisect_left(self.keys, prefix)
        hi = lo
        while hi < len(self.keys) and self.keys[hi].startswith(prefix):
            hi += 1
        return range(lo, hi)

    def profile(self, row: int) -> Profile:
        return self.profiles[self._profile[row]]

    def parent(self, row: int) -> str:
        return self._parents[32 * row : 32 * row + 32].hex() if self._has_parent[row] else ""

    def start(self, row: int) -> int:
        return self._start[row]

    def end(self, row: int) -> int:
        return self._start[row] + self._tokens[row]

    def n_tokens(self, row: int) -> int:
        return self._tokens[row]

    def stored(self, row: int) -> int:
        return self._stored[row]

    def raw(self, row: int) -> int:
        return self._raw[row]

    def created(self, row: int) -> float:
        return self._created[row]

    def recorded(self, row: int) -> float | None:
        t = self._recorded[row]
        return None if t != t else t  # NaN: none recorded

    def last_access(self, row: int) -> float | None:
        t = self.touched.get(self.keys[row])
        return t if t is not None else self.recorded(row)

    def last_used(self, row: int) -> float:
        t = self.last_access(row)
        return self._created[row] if t is None else t

    def access_of(self, key: str) -> float | None:
        """The last use of any key (a chunk's, a derived entry's, a stale record's)."""
        if key in self.touched:
            return self.touched[key]
        row = self.row(key)
        return self.recorded(row) if row >= 0 else self.other_access.get(key)

    def recorded_of(self, key: str) -> float | None:
        row = self.row(key)
        return self.recorded(row) if row >= 0 else self.other_access.get(key)

    @property
    def stored_bytes(self) -> int:
        return sum(self._stored)

    @property
    def raw_bytes(self) -> int:
        return sum(self._raw)

    def header(self, row: int) -> EntryHeader:
        p = self.profile(row)
        return EntryHeader(
            key=self.keys[row], model=p.model, model_name=p.model_name, dtype=p.dtype, n_tokens=self._tokens[row],
            layers=p.layers, codec=p.params, raw_bytes=self._raw[row], created=self._created[row], format=p.format,
            parent=self.parent(row), start=self._start[row], numerics=p.numerics,
        )  # fmt: skip

    def info(self, row: int) -> EntryInfo:
        """Row ``row`` as an :class:`EntryInfo` (its header's codec params: one entry's of the same
        codec; frame tables are not kept)."""
        return EntryInfo(self.header(row), self._stored[row], self.last_access(row))

    def get(self, key: str) -> EntryInfo | None:
        row = self.row(key)
        return None if row < 0 else self.info(row)


class ByKey(Mapping[str, EntryInfo]):
    """A scan's intact chunk entries by key (:class:`EntryTable` rows, made when asked for)."""

    def __init__(self, table: EntryTable):
        self._table = table

    def __getitem__(self, key: str) -> EntryInfo:
        got = self._table.get(key)
        if got is None:
            raise KeyError(key)
        return got

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._table.row(key) >= 0

    def __iter__(self) -> Iterator[str]:
        return iter(self._table.keys)

    def __len__(self) -> int:
        return len(self._table)


class Refs(Mapping[str, int]):
    """How many contexts use each chunk (the chunks no context uses are not in it)."""

    def __init__(self, table: EntryTable):
        self._table = table

    def __getitem__(self, key: str) -> int:
        row = self._table.row(key)
        if row < 0 or not self._table.refs[row]:
            raise KeyError(key)
        return self._table.refs[row]

    def __iter__(self) -> Iterator[str]:
        return (k for k, n in zip(self._table.keys, self._table.refs) if n)

    def __len__(self) -> int:
        return sum(1 for n in self._table.refs if n)


class Recorded(Mapping[str, float]):
    """Last uses as the store recorded them when scanned (not this handle's unsaved ones): of
    chunks, derived entries and any other key."""

    def __init__(self, table: EntryTable):
        self._table = table

    def __getitem__(self, key: str) -> float:
        got = self._table.recorded_of(key)
        if got is None:
            raise KeyError(key)
        return got

    def __iter__(self) -> Iterator[str]:
        t = self._table
        yield from (k for i, k in enumerate(t.keys) if t.recorded(i) is not None)
        yield from t.other_access

    def __len__(self) -> int:
        return sum(1 for _ in self)


# what makes a key a context: its record, a format-1 entry, or owned entries that stand for it alone
# (pressed caches: kvstore.store.kinds)
RECORDED, WHOLE_ENTRY, OWNED_ONLY = 0, 1, 2


class ContextTable(_Values[ContextInfo]):
    """Every context of a scan: its key, its chain as rows of an :class:`EntryTable` (a chunk that
    is not intact is a negative number naming it in ``missing_keys``), its tokens, its record's
    creation time, what makes it a context, and its derived entries."""

    def __init__(self, entries: EntryTable):
        self.entries = entries
        self.keys: list[str] = []
        self._offsets, self._chunks = array("q", [0]), array("i")
        self.missing_keys: list[str] = []
        self._missing: dict[str, int] = {}
        self._tokens, self._created, self.kind = array("q"), array("d"), bytearray()
        self.owned: dict[str, tuple[OwnedInfo, ...]] = {}  # context key -> the entries it owns
        self.passages: set[str] = set()  # keys of the contexts recorded as passages (kvstore.model.compose)

    def add(
        self, key: str, chunks: Sequence[str], n_tokens: int, created: float, kind: int = RECORDED, *,
        passage: bool = False,
    ) -> None:  # fmt: skip
        if passage:
            self.passages.add(key)
        for k in chunks:
            row = self.entries.row(k)
            if row < 0:
                j = self._missing.get(k)
                if j is None:
                    j = self._missing[k] = len(self.missing_keys)
                    self.missing_keys.append(k)
                row = -1 - j
            self._chunks.append(row)
        self._offsets.append(len(self._chunks))
        last = self._chunks[-1] if chunks else -1
        self.keys.append(self.entries.keys[last] if last >= 0 and self.entries.keys[last] == key else key)
        self._tokens.append(n_tokens)
        self._created.append(created)
        self.kind.append(kind)

    def attach(self, owned: Iterable[OwnedInfo]) -> None:
        """File each derived entry under its context."""
        by: dict[str, list[OwnedInfo]] = {}
        for d in owned:
            by.setdefault(d.context, []).append(d)
        self.owned = {k: tuple(v) for k, v in by.items()}

    def finish(self) -> None:
        """Count the contexts using each chunk (``entries.refs``)."""
        refs = array("i", bytes(4 * len(self.entries)))
        for i in range(len(self)):
            rows = self.rows(i)
            for r in set(rows) if len(rows) > 1 else rows:
                if r >= 0:
                    refs[r] += 1
        self.entries.refs = refs
        self._missing = {}

    # -- one context ------------------------------------------------------------------------------
    def rows(self, i: int) -> array:
        return self._chunks[self._offsets[i] : self._offsets[i + 1]]

    def chunk_key(self, row: int) -> str:
        return self.entries.keys[row] if row >= 0 else self.missing_keys[-1 - row]

    def chunk_keys(self, i: int) -> tuple[str, ...]:
        return tuple(self.chunk_key(r) for r in self.rows(i))

    def owned_of(self, i: int) -> tuple[OwnedInfo, ...]:
        return self.owned.get(self.keys[i], ())

    def n_tokens(self, i: int) -> int:
        return self._tokens[i]

    def stored(self, i: int) -> int:
        """Logical bytes: the context's intact chunks (shared ones too)."""
        e = self.entries
        return sum(e.stored(r) for r in self.rows(i) if r >= 0)

    def owned_bytes(self, i: int) -> int:
        return sum(d.stored_bytes for d in self.owned_of(i))

    def created(self, i: int) -> float:
        e = self.entries
        first = [e.created(r) for r in self.rows(i) if r >= 0] + [d.created for d in self.owned_of(i)]
        return min(first, default=self._created[i])

    def last_access(self, i: int) -> float | None:
        e = self.entries
        used = [t for t in (e.access_of(self.chunk_key(r)) if r < 0 else e.last_access(r) for r in self.rows(i))
                if t is not None]  # fmt: skip
        used += [d.last_access for d in self.owned_of(i) if d.last_access is not None]
        return max(used) if used else None

    def last_used(self, i: int) -> float:
        t = self.last_access(i)
        return self.created(i) if t is None else t

    def about(self, i: int) -> tuple[str, str]:
        """(fingerprint, model name) of context ``i``: its first chunk's, else its first derived
        entry's, else ``("?", "?")``."""
        rows = self.rows(i)
        if rows and rows[0] >= 0:
            p = self.entries.profile(rows[0])
            return p.model, p.model_name
        d = self.owned_of(i)
        return (d[0].model, d[0].model_name) if d else ("?", "?")

    def problem(self, i: int) -> str:
        """What is wrong with context ``i``'s chain (``""``: nothing), as
        :func:`kvstore.store.infos.chain_problem` says it."""
        e, rows = self.entries, self.rows(i)
        parent, start = "", 0
        for n, r in enumerate(rows):
            if r < 0:
                return f"chunk {n + 1} of {len(rows)} ({self.chunk_key(r)[:12]}) is missing or corrupt"
            if len(rows) > 1 or e.profile(r).format >= 2:
                if e.parent(r) != parent or e.start(r) != start:
                    return f"chunk {n + 1} of {len(rows)} ({e.keys[r][:12]}) does not continue the chain"
            parent, start = e.keys[r], e.end(r)
        return ""

    def info(self, i: int) -> ContextInfo:
        e, rows = self.entries, self.rows(i)
        present = [r for r in rows if r >= 0]
        return ContextInfo(
            key=self.keys[i], n_tokens=self._tokens[i], chunks=self.chunk_keys(i), stored_bytes=self.stored(i),
            raw_bytes=sum(e.raw(r) for r in present), kv_bytes=sum(e.profile(r).kv_bytes for r in present),
            missing=len(rows) - len(present), first=e.info(rows[0]) if rows and rows[0] >= 0 else None,
            created=self.created(i), last_access=self.last_access(i), owned=self.owned_of(i),
            passage=self.keys[i] in self.passages,
        )  # fmt: skip


__all__ = [
    "OWNED_ONLY",
    "RECORDED",
    "WHOLE_ENTRY",
    "ByKey",
    "Codecs",
    "ContextTable",
    "EntryTable",
    "Profile",
    "Recorded",
    "Refs",
]
