"""Executing a removal plan (:class:`GcPlan`, made by :func:`kvstore.store.gc.plan_gc`) without losing what is in use.

A plan is made from a scan and may wait (at a prompt, behind a long listing) while builds run. A
build records a context in three steps (:meth:`kvstore.store.kvstore.KVStore.put_context`): it
marks the chunks it reuses as used (their ``a/`` records), writes the record, then checks that
every chunk is still there and computes again whatever is not. :func:`execute_plan` removes, in this order:

1. the planned derived entries (a context's scores, then its pressed caches), except those of a
   planned context used since the plan;
2. the planned context records (records before the chunks they name: an interruption leaves
   unused chunks, which a later gc collects, never a record whose chunks are gone);
3. the planned entries, a batch at a time;
4. the last-use records of the entries and derived entries removed;
5. through a local tier, the planned bad copies in the tier (the remote's stay).

Each batch is read first (values are kept in memory until the batch is done); those that changed
since the plan are kept: an entry or derived entry marked used, a chunk named by a record the plan
did not see, a corrupt entry repaired, a broken context complete again, a context used (through any
of its chunks' or derived entries' marks), a derived entry whose context was recorded since. The rest is deleted, then
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
from typing import TYPE_CHECKING

from kvstore.errors import CorruptEntryError, FormatVersionError, ReadOnlyStoreError
from kvstore.store.derived import ANY_OWNED
from kvstore.store.entry import CHUNK
from kvstore.store.keyspace import access_key, entry_key, owned_key, record_key
from kvstore.store.kinds import EntryKind

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.kvstore import KVStore

BATCH_KEYS = 256  # entries checked, held and deleted together
BATCH_BYTES = 256 << 20  # ... and at most this many bytes of them (one larger entry goes alone)

# (keys, their values as read) -> {key that must stay: why}
Busy = Callable[[Sequence[str], Mapping[str, bytes]], dict[str, str]]


@dataclass(frozen=True)
class GcPlan:
    """What to remove and why; nothing is removed until :func:`execute_plan`. ``contexts``:
    context records ``(key, reason, logical bytes)``; ``remove``: entries ``(key, reason, stored
    bytes)`` (chunks no kept context uses, format-1 entries, corrupt entries); ``derived``: derived
    entries ``(context, key, reason, stored bytes)``."""

    remove: tuple[tuple[str, str, int], ...]
    keep_bytes: int  # stored bytes of the intact entries and derived entries left afterwards
    contexts: tuple[tuple[str, str, int], ...] = ()
    # what the scan saw, checked again by execution before anything goes:
    chains: Mapping[str, tuple[str, ...]] = field(default_factory=dict, compare=False)  # planned context -> chunks
    seen: Mapping[str, float] = field(default_factory=dict, compare=False)  # entry -> recorded last use
    kept_contexts: frozenset[str] = field(default=frozenset(), compare=False)  # contexts the plan keeps
    corrupt: frozenset[str] = field(default=frozenset(), compare=False)  # entries planned as corrupt
    broken: frozenset[str] = field(default=frozenset(), compare=False)  # contexts planned as broken
    # bad copies in a local tier, to drop from the tier only (the remote's copies are intact)
    local: tuple[tuple[str, str, int], ...] = ()
    derived: tuple[tuple[str, str, str, int], ...] = ()
    derived_local: tuple[tuple[str, str, str, int], ...] = ()
    pressed_only: frozenset[str] = field(default=frozenset(), compare=False)  # planned contexts without a record
    derived_corrupt: frozenset[str] = field(default=frozenset(), compare=False)  # derived keys planned as corrupt
    # contexts the scan saw gone (no record, no pressed cache) -> the derived keys it saw of each
    gone: Mapping[str, frozenset[str]] = field(default_factory=dict, compare=False)

    @property
    def n(self) -> int:
        return (
            len(self.remove) + len([c for c in self.contexts if c[0] not in {r[0] for r in self.remove}])
            + len(self.derived)
        )  # fmt: skip

    @property
    def freed_bytes(self) -> int:
        return sum(r[2] for r in self.remove) + sum(d[3] for d in self.derived)


@dataclass(frozen=True)
class GcReport:
    """What :func:`execute_plan` did: the context records, entries and derived entries (their
    keys) it removed, the stored bytes freed, and ``kept``: ``(key, why)`` of what the plan named
    but execution left in place because it was used, recorded or repaired since the plan."""

    contexts: tuple[str, ...] = ()
    entries: tuple[str, ...] = ()
    freed_bytes: int = 0
    kept: tuple[tuple[str, str], ...] = ()
    dropped_local: int = 0  # bad copies dropped from a local tier (the remote's untouched)
    derived: tuple[str, ...] = ()


def _owned_id(context: str, key: str) -> str:
    return f"{context}/{key}"


def _owned_name(ident: str) -> bytes:
    context, _, key = ident.partition("/")
    return owned_key(context, key)


def execute_plan(store: KVStore, plan: GcPlan) -> GcReport:
    """Remove what ``plan`` names and is still as the plan saw it (see the module docstring).
    Raises ReadOnlyStoreError on a read-only store, and the backend's errors (what was removed
    before stays removed; a re-run plans again)."""
    if store.readonly:
        raise ReadOnlyStoreError(f"store {store.url} was opened read-only")
    kept: dict[str, str] = {}
    planned = [k for k, _, _ in plan.contexts]
    contexts_busy = _contexts_busy(store, plan)
    used = contexts_busy(planned, {})  # a planned context used since the plan keeps its derived entries
    sizes_d = {_owned_id(c, k): size for c, k, _, size in plan.derived}
    derived, held = _remove(store, list(sizes_d), _owned_name, _owned_busy(store, plan, used, contexts_busy),
                            lambda d: d.partition("/")[2] not in plan.derived_corrupt)  # fmt: skip
    kept |= held
    contexts, held = _remove(store, planned, record_key, contexts_busy)
    kept |= held
    unrecorded = [k for k in planned if k not in held and k not in contexts]  # format 1: the entry is the context
    sizes = {k: size for k, _, size in plan.remove}
    entries: list[str] = []
    for batch in _batches(list(sizes), sizes):
        gone, held = _remove(store, batch, entry_key, _entries_busy(store, plan), lambda k: k not in plan.corrupt)
        entries += gone
        kept |= held
    contexts += [k for k in unrecorded if k in set(entries)]
    gone_derived = {d.partition("/")[0] for d in derived}
    left = {c for c, k, _, _ in plan.derived if _owned_id(c, k) not in derived}
    contexts += [k for k in unrecorded if k in plan.pressed_only and k in gone_derived and k not in left]
    removed = entries + [d.partition("/")[2] for d in derived]
    now = store.recorded_access(removed)  # the last uses of what went, unless someone used it since
    store.backend.delete_many([access_key(k) for k in removed if k in now and now[k] == plan.seen.get(k)])
    names = [entry_key(k) for k, _, _ in plan.local] + [owned_key(c, k) for c, k, _, _ in plan.derived_local]
    dropped = store.backend.drop_local(names) if names else 0  # a tier's fault stays local
    freed = sum(sizes[k] for k in entries) + sum(sizes_d[d] for d in derived)
    return GcReport(tuple(contexts), tuple(entries), freed, tuple(kept.items()), dropped,
                    tuple(d.partition("/")[2] for d in derived))  # fmt: skip


def _remove(
    store: KVStore, keys: Sequence[str], name: Callable[[str], bytes], busy: Busy,
    restore: Callable[[str], bool] = lambda k: True,
) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """Delete those of ``keys`` (backend keys ``name(key)``) that ``busy`` does not hold, check
    again, put back what became busy meanwhile (when ``restore(key)``). Returns (removed, held)."""
    if not keys:
        return [], {}
    values = store.backend.origin().get_many([name(k) for k in keys])  # not a local tier's copies
    saved = {k: bytes(v) for k, v in zip(keys, values) if v is not None}
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
    derived_of: dict[str, list[str]] = {}
    for c, k, _, _ in plan.derived:
        derived_of.setdefault(c, []).append(k)

    def busy(keys: Sequence[str], saved: Mapping[str, bytes]) -> dict[str, str]:
        # a context's use marks its last chunk, whose key it has, or one of its derived entries
        marks = {k: [k, *derived_of.get(k, ())] for k in keys}
        now = store.recorded_access([m for ms in marks.values() for m in ms])
        out = {k: "used since the plan" for k, ms in marks.items() if any(now.get(m) != plan.seen.get(m) for m in ms)}
        for k in keys:
            if k in plan.broken and k not in out and all(store.contains(c) for c in plan.chains.get(k, ())):
                out[k] = "complete again since the plan"
        return out

    return busy


def _owned_busy(store: KVStore, plan: GcPlan, used: Mapping[str, str], contexts_busy: Busy) -> Busy:
    planned = {k for k, _, _ in plan.contexts}

    def busy(ids: Sequence[str], saved: Mapping[str, bytes]) -> dict[str, str]:
        """A derived entry used since the plan, of a planned context used since, of a context gone
        at the plan and recorded (or pressed) since, or corrupt and intact again."""
        pairs = {d: d.partition("/")[::2] for d in ids}
        now = store.recorded_access([k for _, k in pairs.values()])
        late = contexts_busy(sorted({c for c, _ in pairs.values() if c in planned}), {}) if not saved else used
        out: dict[str, str] = {}
        for d, (context, key) in pairs.items():
            if now.get(key) != plan.seen.get(key):
                out[d] = "used since the plan"
            elif context in late:
                out[d] = f"its context was {late[context].replace(' since the plan', '')} since the plan"
            elif context in plan.gone and (
                store.backend.contains(record_key(context)) or set(store.owned_keys(context)) - plan.gone[context]
            ):
                out[d] = "its context was recorded since the plan"
            elif key in plan.derived_corrupt and d in saved and _intact(saved[d], key, ANY_OWNED):
                out[d] = "intact again since the plan"
        return out

    return busy


def _entries_busy(store: KVStore, plan: GcPlan) -> Busy:
    def busy(keys: Sequence[str], saved: Mapping[str, bytes]) -> dict[str, str]:
        now = store.recorded_access(keys)
        out = {k: "used since the plan" for k in keys if now.get(k) != plan.seen.get(k)}
        named = _recorded_chunks(store, plan)
        out |= {k: "named by a context recorded since the plan" for k in keys if k in named and k not in out}
        for k in keys:
            if k in plan.corrupt and k in saved and k not in out and _intact(saved[k], k):
                out[k] = "intact again since the plan"
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


def _intact(value: bytes, key: str, kind: EntryKind = CHUNK) -> bool:
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


def _batches(keys: list[str], sizes: Mapping[str, int]) -> Iterator[list[str]]:
    batch: list[str] = []
    total = 0
    for k in keys:
        if batch and (len(batch) >= BATCH_KEYS or total + sizes[k] > BATCH_BYTES):
            yield batch
            batch, total = [], 0
        batch.append(k)
        total += sizes[k]
    if batch:
        yield batch


__all__ = ["BATCH_BYTES", "BATCH_KEYS", "GcPlan", "GcReport", "execute_plan"]
