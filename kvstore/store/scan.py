"""What a store holds: a scan of its entries, of every kind, and its contexts.

A scan reads every entry's header, chunks and the entries contexts own alike, in one loop, asking
the kind that reads each (:func:`kvstore.store.kinds.stored_at`; ``verify=True``: every byte), then
every last-use record and every context record, streaming: what it keeps is one compact table
(:mod:`kvstore.store.tables`: a few hundred bytes per chunk, whatever the model), and the values callers read
(:mod:`kvstore.store.infos`) are made when asked for. Intact entries are
:class:`~kvstore.store.infos.EntryInfo`, unreadable ones :class:`~kvstore.store.infos.CorruptInfo`
(never raised). Contexts are :class:`~kvstore.store.infos.ContextInfo`: a chain of chunks (format 2),
one whole-context entry (format 1), or, in a store that keeps only pressed caches, a context known
by its pressed entries alone. A chunk shared by several contexts is stored once, so a store has
*physical* bytes (its entries) and *logical* bytes (each context's chunks, counted per context);
their ratio is the dedupe ratio. An owned entry (:class:`~kvstore.store.infos.OwnedInfo`) lives
with its context: one whose context is neither recorded nor pressed is an orphan.

Per-group totals are :mod:`kvstore.store.summary`; removal plans, :mod:`kvstore.store.gc`.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.progress import Progress
from kvstore.store.frame import TRAILER_BYTES, peek_frame
from kvstore.store.header import check_sizes

# the values a scan reports live in infos; importable from here, as before
from kvstore.store.infos import (  # noqa: F401
    ContextInfo,
    ContextRecord,
    CorruptInfo,
    EntryInfo,
    OwnedInfo,
    chain_problem,
    matches_model,
)
from kvstore.store.keyspace import ACCESS, ENTRY, OWNED, RECORD, key_of
from kvstore.store.kinds import EntryKind, stands_for_context, stored_at
from kvstore.store.tables import (
    OWNED_ONLY,
    RECORDED,
    WHOLE_ENTRY,
    ByKey,
    Codecs,
    ContextTable,
    EntryTable,
    Recorded,
    Refs,
)
from kvstore.units import human_bytes

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterable, Mapping, Sequence

    from kvstore.store.backends.base import Backend
    from kvstore.store.codecs import Codec
    from kvstore.store.meta import StoreMeta

_BATCH = 256  # records read per backend call


@dataclass(frozen=True)
class StoreAbout:
    """What a scan says of the store itself: its ``url``, on-disk ``format``, default ``codec``
    spec, ``created`` time, ``disk_bytes`` (None where the backend cannot say), whether the scan
    ``verified`` every checksum, its ``chunk_tokens``, and why its codec was chosen
    (``codec_reason``: empty unless kvstore chose it by the device it was built on)."""

    url: str
    format: int
    codec: str
    created: float = 0.0
    disk_bytes: int | None = None
    verified: bool = False
    chunk_tokens: int = 0
    codec_reason: str = ""


@dataclass(frozen=True)
class Unreadable:
    """What a scan could not read beside its corrupt entries (see :class:`StoreInfo`): through a local
    tier, its bad copies (``local_corrupt``); context records that do not parse (``malformed``);
    entries of a newer format or an unknown kind (``unknown``)."""

    local_corrupt: Sequence[CorruptInfo] = ()
    malformed: Sequence[CorruptInfo] = ()
    unknown: Sequence[CorruptInfo] = ()


class StoreInfo:
    """A store's description and contents (see :meth:`KVStore.scan`): ``about`` (a
    :class:`StoreAbout`; its fields read as this object's own: ``url``, ``format``, ``codec``,
    ``created``, ``disk_bytes``, ``verified``, ``chunk_tokens``, ``codec_reason``), ``entries`` (its intact chunks, an
    :class:`~kvstore.store.tables.EntryTable`: a sequence of ``EntryInfo``), ``contexts`` (a
    :class:`~kvstore.store.tables.ContextTable`: a sequence of ``ContextInfo``), ``derived`` (its
    intact derived entries), what does not read (``corrupt``: chunk and derived entries;
    ``malformed``: context records; ``local_corrupt``: through a local tier, its bad copies), what
    this kvstore cannot read but is no damage (``unknown``: entries whose header says a newer format
    or a kind this process does not know; management keeps them and sync copies them), and
    ``refs`` / ``recorded_access`` / ``by_key`` (mappings by key, made when read).

    Made by a scan; also from values (``entries``/``contexts`` as sequences of ``EntryInfo`` and
    ``ContextInfo``, ``recorded_access`` a dict, ``unreadable`` an :class:`Unreadable`), as tests do."""

    def __init__(
        self, about: StoreAbout, entries: EntryTable | Sequence[EntryInfo], corrupt: Sequence[CorruptInfo] = (),
        contexts: ContextTable | Sequence[ContextInfo] = (), *, recorded_access: Mapping[str, float] | None = None,
        owned: Sequence[OwnedInfo] = (), unreadable: Unreadable = Unreadable(),
    ):  # fmt: skip
        local_corrupt, malformed, unknown = unreadable.local_corrupt, unreadable.malformed, unreadable.unknown
        self.about = about
        self.url, self.format, self.codec, self.created = about.url, about.format, about.codec, about.created
        self.disk_bytes, self.verified, self.chunk_tokens = about.disk_bytes, about.verified, about.chunk_tokens
        self.codec_reason = about.codec_reason
        self.corrupt, self.local_corrupt, self.malformed = tuple(corrupt), tuple(local_corrupt), tuple(malformed)
        self.unknown = tuple(unknown)
        if not isinstance(entries, EntryTable):
            entries = entry_table_of(entries, recorded_access)
        if not isinstance(contexts, ContextTable):
            contexts = context_table_of(entries, contexts, owned)
        self.entries: EntryTable = entries
        self.contexts: ContextTable = contexts
        self.owned: tuple[OwnedInfo, ...] = tuple(d for ds in contexts.owned.values() for d in ds)

    @property
    def n_entries(self) -> int:
        """Intact chunk entries (derived entries are ``derived``)."""
        return len(self.entries)

    @property
    def refs(self) -> Mapping[str, int]:
        """Chunk key -> contexts using it (chunks no context uses are not in it)."""
        return Refs(self.entries)

    @property
    def recorded_access(self) -> Mapping[str, float]:
        """Last-use records as stored when scanned (not this handle's unsaved uses): what a removal
        plan compares with before it removes anything."""
        return Recorded(self.entries)

    @property
    def by_key(self) -> Mapping[str, EntryInfo]:
        """The intact chunk entries by key."""
        return ByKey(self.entries)

    @property
    def stored_bytes(self) -> int:
        """Physical bytes: every intact chunk entry once (derived entries: ``derived_bytes``)."""
        return self.entries.stored_bytes

    @property
    def owned_bytes(self) -> int:
        """Bytes of the entries contexts own (derived entries)."""
        return sum(d.stored_bytes for d in self.owned)

    derived_bytes = owned_bytes  # deprecated: the name it had
    derived = property(lambda self: self.owned, doc="Deprecated: ``owned``.")

    @property
    def logical_bytes(self) -> int:
        """Every context's chunks, a shared chunk counted once per context that uses it."""
        return sum(self.contexts.stored(i) for i in range(len(self.contexts)))

    @property
    def dedupe_ratio(self) -> float:
        """Logical / physical bytes of the chunks contexts use (1.0: nothing shared)."""
        e = self.entries
        used = sum(e.stored(r) for r in range(len(e)) if e.refs[r])
        return self.logical_bytes / used if used else 1.0

    @property
    def raw_bytes(self) -> int:
        return self.entries.raw_bytes

    @property
    def n_tokens(self) -> int:
        """Tokens of the contexts (not of the chunks, which a shared prefix would count once)."""
        return sum(self.contexts.n_tokens(i) for i in range(len(self.contexts)))

    def orphan_rows(self) -> Iterator[int]:
        """Rows of the chunks no context record uses (a build in progress, or left by removed contexts)."""
        e = self.entries
        return (r for r in range(len(e)) if not e.refs[r] and e.profile(r).format >= 2)

    @property
    def orphans(self) -> tuple[EntryInfo, ...]:
        """Chunks no context record uses (a build in progress, or left by removed contexts)."""
        return tuple(self.entries.info(r) for r in self.orphan_rows())

    @property
    def orphan_owned(self) -> tuple[OwnedInfo, ...]:
        """Derived entries whose context is neither recorded (a record, a format-1 entry) nor
        stored as a pressed cache: nothing uses them (a context removed by an older kvstore, or a
        removal interrupted after the context went)."""
        live = set(self.contexts.keys) | self.unknown_contexts
        return tuple(d for d in self.owned if d.context not in live)

    @property
    def unknown_contexts(self) -> frozenset[str]:
        """Contexts that own an entry this kvstore cannot read (``unknown``): a newer writer's
        context, which management keeps (its readable entries are no orphans)."""
        return frozenset(u.context for u in self.unknown if u.context)

    @property
    def unknown_chunks(self) -> frozenset[str]:
        """Keys of the chunk entries this kvstore cannot read (``unknown``): present, not missing."""
        return frozenset(u.key for u in self.unknown if not u.context)

    orphan_derived = orphan_owned  # the name it had before kinds were one table

    @property
    def size_str(self) -> str:
        return human_bytes(self.stored_bytes)


def entry_table_of(entries: Iterable[EntryInfo], recorded: Mapping[str, float] | None = None) -> EntryTable:
    """A table of ``entries`` made by hand (a scan makes its own): each entry's ``last_access`` is
    kept as this handle's use unless ``recorded`` (the store's records) says the same."""
    recorded = dict(recorded or {})
    table = EntryTable()
    for e in entries:
        table.add(e.header, e.stored_bytes, recorded.get(e.key))
        if e.last_access is not None and recorded.get(e.key) != e.last_access:
            table.touched[e.key] = e.last_access
    table.finish()
    for key, when in recorded.items():
        if table.row(key) < 0:
            table.other_access[key] = when
    return table


def context_table_of(entries: EntryTable, contexts: Iterable[ContextInfo], owned: Iterable[OwnedInfo] = ()
                     ) -> ContextTable:  # fmt: skip
    """A table of ``contexts`` made by hand over ``entries``."""
    table = ContextTable(entries)
    extra: list[OwnedInfo] = list(owned)
    for c in contexts:
        whole = len(c.chunks) == 1 and c.first is not None and c.first.header.format == 1
        kind = OWNED_ONLY if not c.chunks else WHOLE_ENTRY if whole else RECORDED
        table.add(c.key, c.chunks, c.n_tokens, c.created, kind, passage=c.passage)
        extra += c.owned
    table.attach({(d.context, d.key): d for d in extra}.values())
    table.finish()
    return table


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

    def last_access(self, recorded: dict[str, float] | None = None) -> dict[str, float]: ...


def scan_store(store: ScannedStore, *, verify: bool = False, progress: Progress | None = None) -> StoreInfo:
    """See :meth:`KVStore.scan`. Through a local tier the remote's copy of an entry is what counts:
    a bad copy in the tier is listed in ``local_corrupt``, not in ``corrupt``. ``progress(1, stored
    bytes)`` after each entry, of any kind."""
    tiered = store.backend.origin() is not store.backend
    entries = EntryTable(touched=store.last_access({}), codecs=Codecs())  # this handle's unsaved uses
    corrupt: list[CorruptInfo] = []
    unknown: list[CorruptInfo] = []
    local_corrupt: list[CorruptInfo] = []
    malformed: list[CorruptInfo] = []
    local_bad = local_corrupt if tiered else None
    # streamed, every kind in one loop: nothing but the table grows with the store
    for name in itertools.chain(store.backend.keys(ENTRY), store.backend.keys(OWNED)):
        got = stored_at(name)
        if got is None:  # under x/, a name that names no context and key
            malformed.append(CorruptInfo(key_of(name, OWNED, errors="replace"), "malformed derived entry name",
                                         _size(store, name)))  # fmt: skip
            continue
        kind, owner, key = got
        size = 0
        try:
            read = _read(store, _Wanted(kind, name, key, owner, entries.codecs), verify, local_bad)
        except (CorruptEntryError, FormatVersionError) as exc:
            size = _size(store, name)
            _unreadable(exc, unknown, corrupt).append(CorruptInfo(key, str(exc), size, owner))
        else:
            if read is not None:  # else deleted while we scanned
                size = read[1]
                entries.add(*read, owned=kind.owned)
        if progress is not None:
            progress(1, size)
    entries.finish()
    _read_access(store.backend, entries)
    contexts = ContextTable(entries)
    for record in _records(store.backend, malformed):
        contexts.add(record.key, record.chunks, record.n_tokens, record.created, RECORDED, passage=record.passage)
    for row in range(len(entries)):
        if entries.profile(row).format == 1:  # a whole-context entry is its own context
            contexts.add(entries.keys[row], (entries.keys[row],), entries.n_tokens(row), entries.created(row),
                         WHOLE_ENTRY)  # fmt: skip
    owned = entries.owned_infos()
    known = set(contexts.keys)
    for d in owned:  # a context stored only as entries that stand for it (pressed caches: build --no-dense)
        if d.context not in known and stands_for_context(d.kind):
            known.add(d.context)
            contexts.add(d.context, (), d.n_tokens, d.created, OWNED_ONLY)
    contexts.attach(owned)
    contexts.finish()
    about = StoreAbout(store.url, store.format, store.codec.spec, float(store.meta.created),
                       store.backend.disk_bytes(), verify, store.chunk_tokens, store.meta.codec_reason)  # fmt: skip
    return StoreInfo(about, entries, corrupt, contexts, unreadable=Unreadable(local_corrupt, malformed, unknown))


def _unreadable(exc: Exception, unknown: list[CorruptInfo], corrupt: list[CorruptInfo]) -> list[CorruptInfo]:
    """Where an entry that does not read is listed: a newer format or an unknown kind (whose
    checksum, when verified, held: decoding checks it first) is ``unknown``, never corrupt."""
    return unknown if isinstance(exc, FormatVersionError) else corrupt


def _size(store: ScannedStore, name: bytes) -> int:
    peeked = store.backend.origin().peek(name, 1)
    return 0 if peeked is None else peeked[1]


def _batches(names: Iterable[bytes]) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for name in names:
        batch.append(name)
        if len(batch) >= _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _read_access(backend: Backend, entries: EntryTable) -> None:
    """Every recorded last use (``a/`` records), into the table's rows (or ``other_access``)."""
    for names in _batches(backend.keys(ACCESS)):
        for name, raw in zip(names, backend.get_many(names)):
            if raw is not None and len(raw) == 8:
                entries.set_recorded(key_of(name, ACCESS), struct.unpack("<d", raw)[0])


def _records(backend: Backend, malformed: list[CorruptInfo]) -> Iterator[ContextRecord]:
    """Every context record that reads; the malformed ones go to ``malformed`` (key, what is wrong, size)."""
    for names in _batches(backend.keys(RECORD)):
        for name, raw in zip(names, backend.get_many(names)):
            if raw is None:  # removed while we listed
                continue
            key = key_of(name, RECORD, errors="replace")
            try:
                yield ContextRecord.read(key, raw)
            except ValueError as exc:
                malformed.append(CorruptInfo(key, f"malformed context record: {exc}", len(raw)))


@dataclass(frozen=True)
class _Wanted:
    """One stored entry a scan reads: its kind, backend key, own key, owner (the context of an
    owned entry, ``""`` for a chunk) and the scan's parsed codecs."""

    kind: EntryKind
    name: bytes
    key: str
    owner: str
    codecs: Codecs


def _peek(backend: Backend, w: _Wanted) -> tuple[Any, int] | None:
    """(header, stored size) of an entry from its first bytes, its sizes checked (what a listing
    shows is consistent), or None when it is gone."""
    got = peek_frame(backend, w.name, w.kind.read_header)
    if got is None:
        return None
    header, offset, size = got
    if header.key != w.key or (w.owner and header.context != w.owner):
        raise CorruptEntryError(f"{w.kind.noun} header names another {'context or key' if w.owner else 'key'}")
    payload = size - offset - TRAILER_BYTES
    if w.owner:
        w.kind.check_sizes(header, payload)
    else:  # a chunk's codec parsed once per scan
        check_sizes(header, payload, w.codecs(header.codec)[1])
    return header, size


def _decoded(w: _Wanted, buf: Any) -> Any:
    header = w.kind.decode(buf, key=w.key).header
    if w.owner and header.context != w.owner:
        raise CorruptEntryError("derived entry header names another context")
    return header


def _read(store: ScannedStore, w: _Wanted, verify: bool, local_bad: list[CorruptInfo] | None) -> tuple[Any, int] | None:
    """(header, stored size) of an entry of any kind, or None when it is gone; raises
    CorruptEntryError or FormatVersionError for the copy that counts. ``verify``: every byte of the
    origin's copy (and, with ``local_bad``, the local tier's copy too); else its header only (a
    remote listing downloads no entry), from the tier's copy when it has one and that reads."""
    if verify:
        if local_bad is not None:
            with store.backend.local_copy(w.name) as copy:
                if copy is not None:
                    try:
                        _decoded(w, copy)
                    except (CorruptEntryError, FormatVersionError) as exc:
                        local_bad.append(CorruptInfo(w.key, str(exc), len(copy), w.owner))
        with store.backend.origin().view(w.name) as buf:
            return None if buf is None else (_decoded(w, buf), len(buf))
    try:
        return _peek(store.backend, w)
    except CorruptEntryError as exc:
        if local_bad is None:
            raise
        got = _peek(store.backend.origin(), w)  # the tier's copy is bad; the remote's decides
        local_bad.append(CorruptInfo(w.key, str(exc), got[1] if got else 0, w.owner))
        return got


__all__ = ["ScannedStore", "StoreInfo", "Unreadable", "scan_store"]
