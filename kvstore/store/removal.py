"""Executing a removal plan (:class:`GcPlan`, made by :func:`kvstore.store.gc.plan_gc`) without losing what is in use.

A plan is made from a scan and may wait (at a prompt, behind a long listing) while builds run. A
build records a context in three steps (:meth:`kvstore.store.kvstore.KVStore.put_context`): it
marks the chunks it reuses as used (their ``a/`` records), writes the record, then checks that
every chunk is still there and computes again whatever is not. :func:`execute_plan` removes, in this order:

1. the planned entries contexts own, those that stand for their context (pressed caches) last
   (the kind says: :attr:`Planned.phase`), except those of a planned context used since the plan;
2. the planned context records (records before the chunks they name: an interruption leaves
   unused chunks, which a later gc collects, never a record whose chunks are gone);
3. the planned chunk entries, a batch at a time;
4. the last-use records of the entries removed;
5. through a local tier, the planned bad copies in the tier (the remote's stay).

Each batch is read first (values are kept in memory until the batch is done); those that changed
since the plan are kept: an entry marked used, a chunk named by a record the plan
did not see, a corrupt entry repaired, a broken context complete again, a context used (through any
of its chunks' or owned entries' marks), an owned entry whose context was recorded since. The rest is deleted, then
checked again, and what a writer marked or recorded in the meantime is put back
(``put_if_absent``). Either that second check sees a build's record, or the build's own check,
which follows its record, sees the deletion and computes the chunk again: a build running at the same time
never ends with a record whose chunks are gone, on LMDB or on an object store (no transactions
needed). A corrupt entry is never put back: a build that repaired it in the instant between the
check and the delete finds it missing and computes it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import CorruptEntryError, FormatVersionError, ReadOnlyStoreError
from kvstore.store.entry import CHUNK
from kvstore.store.keyspace import access_key, record_key
from kvstore.store.kinds import EntryKind, stands_for_context
from kvstore.store.owned import ANY_OWNED

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.kvstore import KVStore

BATCH_KEYS = 256  # entries checked, held and deleted together
BATCH_BYTES = 256 << 20  # ... and at most this many bytes of them (one larger entry goes alone)
CORRUPT = "corrupt: "  # the reason of what is removed for failing its checks

# (items: context keys or planned rows, their values as read) -> {item that must stay: why}
Busy = Callable[[Sequence[Any], Mapping[Any, bytes]], dict[Any, str]]


@dataclass(frozen=True)
class Planned:
    """One stored entry of any kind a plan removes (or whose bad local-tier copy it drops): its
    ``key``, why, its stored bytes, the context that ``owner``s it (``""``: a chunk, owned by no
    context) and its ``kind``'s name (``""`` where its header does not read)."""

    key: str
    reason: str
    stored_bytes: int
    owner: str = ""
    kind: str = "chunk"

    @property
    def corrupt(self) -> bool:
        """Planned for failing its checks."""
        return self.reason.startswith(CORRUPT)

    @property
    def entry_kind(self) -> EntryKind:
        """The kind that reads it (any owned kind, its header says which, for an owned entry)."""
        return ANY_OWNED if self.owner else CHUNK

    @property
    def name(self) -> bytes:
        """Its backend key."""
        return self.entry_kind.address(self.key, self.owner)

    @property
    def phase(self) -> tuple[int, bool]:
        """When it goes: owned entries before the context records (those that stand for their
        context last, so that a context known by them alone stays one until the last goes),
        chunks after them."""
        return (0, stands_for_context(self.kind)) if self.owner else (2, True)


@dataclass(frozen=True)
class GcPlan:
    """What to remove and why; nothing is removed until :func:`execute_plan`. ``entries``: the
    entries of every kind to remove (:class:`Planned` rows: chunks no kept context uses, format-1
    entries, corrupt entries, the entries removed contexts own); ``contexts``: context records
    ``(key, reason, logical bytes)``; ``tier_copies``: bad copies in a local tier, to drop from the
    tier only (the remote's copies are intact). The per-kind fields a plan had (``remove``,
    ``derived``, ``local``, ``derived_local``, ``corrupt``, ``derived_corrupt``, ``pressed_only``)
    are read-only views of these, deprecated."""

    entries: tuple[Planned, ...]
    keep_bytes: int  # stored bytes of the intact entries left afterwards
    contexts: tuple[tuple[str, str, int], ...] = ()
    tier_copies: tuple[Planned, ...] = ()
    # what the scan saw, checked again by execution before anything goes:
    chains: Mapping[str, tuple[str, ...]] = field(default_factory=dict, compare=False)  # planned context -> chunks
    seen: Mapping[str, float] = field(default_factory=dict, compare=False)  # entry -> recorded last use
    kept_contexts: frozenset[str] = field(default=frozenset(), compare=False)  # contexts the plan keeps
    broken: frozenset[str] = field(default=frozenset(), compare=False)  # contexts planned as broken
    owned_only: frozenset[str] = field(default=frozenset(), compare=False)  # planned contexts known by owned entries
    # contexts the scan saw gone (no record, no entry standing for them) -> the owned keys it saw of each
    gone: Mapping[str, frozenset[str]] = field(default_factory=dict, compare=False)

    @property
    def n(self) -> int:
        keys = {r.key for r in self.entries}
        return len(self.entries) + len([c for c in self.contexts if c[0] not in keys])

    @property
    def freed_bytes(self) -> int:
        return sum(r.stored_bytes for r in self.entries)

    # deprecated views (one release): the fields a plan had per kind
    remove = property(lambda self: tuple((r.key, r.reason, r.stored_bytes) for r in self.entries if not r.owner))
    derived = property(lambda self: tuple((r.owner, r.key, r.reason, r.stored_bytes) for r in self.entries if r.owner))
    local = property(lambda self: tuple((r.key, r.reason, r.stored_bytes) for r in self.tier_copies if not r.owner))
    derived_local = property(lambda self: tuple((r.owner, r.key, r.reason, r.stored_bytes) for r in self.tier_copies
                                                if r.owner))  # fmt: skip
    corrupt = property(lambda self: frozenset(r.key for r in self.entries if r.corrupt and not r.owner))
    derived_corrupt = property(lambda self: frozenset(r.key for r in self.entries if r.corrupt and r.owner))
    pressed_only = property(lambda self: self.owned_only)


@dataclass(frozen=True)
class GcReport:
    """What :func:`execute_plan` did: the context records, chunk entries and owned entries (their
    keys) it removed, the stored bytes freed, and ``kept``: ``(key, why)`` of what the plan named
    but execution left in place because it was used, recorded or repaired since the plan."""

    contexts: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()
    freed_bytes: int = 0
    kept: tuple[tuple[str, str], ...] = ()
    dropped_local: int = 0  # bad copies dropped from a local tier (the remote's untouched)
    owned: tuple[str, ...] = ()  # owned entries removed
    derived = property(lambda self: self.owned, doc="Deprecated: ``owned``.")


def execute_plan(store: KVStore, plan: GcPlan) -> GcReport:
    """Remove what ``plan`` names and is still as the plan saw it (see the module docstring).
    Raises ReadOnlyStoreError on a read-only store, and the backend's errors (what was removed
    before stays removed; a re-run plans again)."""
    if store.readonly:
        raise ReadOnlyStoreError(f"store {store.url} was opened read-only")
    kept: dict[str, str] = {}
    planned = [k for k, _, _ in plan.contexts]
    contexts_busy = _contexts_busy(store, plan)
    used = contexts_busy(planned, {})  # a planned context used since the plan keeps its owned entries
    rows_busy = _rows_busy(store, plan, used, contexts_busy)
    rows = sorted(plan.entries, key=lambda r: r.phase)  # stable: a plan's order within a phase stays
    owned = [r for r in rows if r.phase[0] < 1]
    gone = _remove_rows(store, owned, rows_busy, kept)
    contexts, held = _remove(store, planned, record_key, contexts_busy)
    kept |= held
    unrecorded = [k for k in planned if k not in held and k not in contexts]  # format 1: the entry is the context
    gone += _remove_rows(store, rows[len(owned) :], rows_busy, kept)
    chunks = {r.key for r in gone if not r.owner}
    contexts += [k for k in unrecorded if k in chunks]
    owners, went = {r.owner for r in gone if r.owner}, set(gone)
    left = {r.owner for r in owned if r not in went}
    contexts += [k for k in unrecorded if k in plan.owned_only and k in owners and k not in left]
    removed = [r.key for r in gone]
    now = store.recorded_access(removed)  # the last uses of what went, unless someone used it since
    store.backend.delete_many([access_key(k) for k in removed if k in now and now[k] == plan.seen.get(k)])
    names = [r.name for r in plan.tier_copies]
    dropped = store.backend.drop_local(names) if names else 0  # a tier's fault stays local
    return GcReport(tuple(contexts), tuple(r.key for r in gone if not r.owner), sum(r.stored_bytes for r in gone),
                    tuple(kept.items()), dropped, tuple(r.key for r in gone if r.owner))  # fmt: skip


def _remove_rows(store: KVStore, rows: list[Planned], busy: Busy, kept: dict[str, str]) -> list[Planned]:
    """Remove ``rows`` a batch at a time (see :func:`_remove`); what is held goes into ``kept``."""
    gone: list[Planned] = []
    for batch in _batches(rows):
        removed, held = _remove(store, batch, lambda r: r.name, busy, lambda r: not r.corrupt)
        gone += removed
        kept |= {r.key: why for r, why in held.items()}
    return gone


def _remove(
    store: KVStore, items: Sequence[Any], name: Callable[[Any], bytes], busy: Busy,
    restore: Callable[[Any], bool] = lambda item: True,
) -> tuple[list[Any], dict[Any, str]]:  # fmt: skip
    """Delete those of ``items`` (backend keys ``name(item)``) that ``busy`` does not hold, check
    again, put back what became busy meanwhile (when ``restore(item)``). Returns (removed, held)."""
    if not items:
        return [], {}
    values = store.backend.origin().get_many([name(k) for k in items])  # not a local tier's copies
    saved = {k: bytes(v) for k, v in zip(items, values) if v is not None}
    held = busy(list(saved), saved)
    doomed = [k for k in saved if k not in held]
    if doomed:
        store.backend.delete_many([name(k) for k in doomed])
        late = busy(doomed, {})  # a build that marked or recorded one while we deleted
        for k in doomed:
            if k in late and restore(k):
                store.backend.put_if_absent(name(k), saved[k])
                held[k] = late[k]
    return [k for k in doomed if k not in held], held


def _contexts_busy(store: KVStore, plan: GcPlan) -> Busy:
    owned_of: dict[str, list[str]] = {}
    for r in plan.entries:
        if r.owner:
            owned_of.setdefault(r.owner, []).append(r.key)

    def busy(keys: Sequence[str], saved: Mapping[str, bytes]) -> dict[str, str]:
        # a context's use marks its last chunk, whose key it has, or one of its owned entries
        marks = {k: [k, *owned_of.get(k, ())] for k in keys}
        now = store.recorded_access([m for ms in marks.values() for m in ms])
        out = {k: "used since the plan" for k, ms in marks.items() if any(now.get(m) != plan.seen.get(m) for m in ms)}
        for k in keys:
            if k in plan.broken and k not in out and all(store.contains(c) for c in plan.chains.get(k, ())):
                out[k] = "complete again since the plan"
        return out

    return busy


def _rows_busy(store: KVStore, plan: GcPlan, used: Mapping[str, str], contexts_busy: Busy) -> Busy:
    planned = {k for k, _, _ in plan.contexts}

    def busy(rows: Sequence[Planned], saved: Mapping[Planned, bytes]) -> dict[Planned, str]:
        """An entry used since the plan; owned by a planned context used since, or by a context gone
        at the plan and recorded (or standing again) since; a chunk named by a context recorded
        since; or corrupt and intact again."""
        now = store.recorded_access([r.key for r in rows])
        late = contexts_busy(sorted({r.owner for r in rows if r.owner in planned}), {}) if not saved else used
        named = _recorded_chunks(store, plan) if any(not r.owner for r in rows) else set()
        out: dict[Planned, str] = {}
        for r in rows:
            if now.get(r.key) != plan.seen.get(r.key):
                out[r] = "used since the plan"
            elif r.owner in late:
                out[r] = f"its context was {late[r.owner].replace(' since the plan', '')} since the plan"
            elif r.owner in plan.gone and (
                store.backend.contains(record_key(r.owner)) or set(store.owned_keys(r.owner)) - plan.gone[r.owner]
            ):
                out[r] = "its context was recorded since the plan"
            elif not r.owner and r.key in named:
                out[r] = "named by a context recorded since the plan"
            elif r.corrupt and r in saved and _intact(saved[r], r.key, r.entry_kind):
                out[r] = "intact again since the plan"
        return out

    return busy


def _recorded_chunks(store: KVStore, plan: GcPlan) -> set[str]:
    """Chunks named by the context records the plan did not keep (new ones, or planned ones that
    execution kept): the plan's own kept contexts use none of the chunks it removes."""
    chunks: set[str] = set()
    for key in store.context_keys():
        if key not in plan.kept_contexts and (record := store.context(key)) is not None:
            chunks.update(record.chunks)
    return chunks


def _intact(value: bytes, key: str, kind: EntryKind) -> bool:
    """Whether ``value`` decodes as the entry ``key`` of ``kind`` (a chunk, or any owned kind), or
    is an intact entry of a newer format or unknown kind (decoding checks the checksum first):
    never removed as corrupt."""
    try:
        kind.decode(value, key=key)
    except FormatVersionError:
        return True
    except CorruptEntryError:
        return False
    return True


def _batches(rows: list[Planned]) -> Iterator[list[Planned]]:
    batch: list[Planned] = []
    total = 0
    for r in rows:
        if batch and (len(batch) >= BATCH_KEYS or total + r.stored_bytes > BATCH_BYTES or r.phase != batch[0].phase):
            yield batch
            batch, total = [], 0
        batch.append(r)
        total += r.stored_bytes
    if batch:
        yield batch


__all__ = ["BATCH_BYTES", "BATCH_KEYS", "CORRUPT", "GcPlan", "GcReport", "Planned", "execute_plan"]
