"""Removing from a store, plan then execute: :func:`plan_gc` chooses contexts and chunks from a
scan, :func:`kvstore.store.removal.execute_plan` removes them.

A chunk goes only when no remaining context uses it; a chunk no context uses (an *orphan*) goes
once its last use is older than a grace period (a build writes its chunks before its context
record). A derived entry (a context's scores or pressed cache) goes with its context, and one
whose context is gone is an orphan too. The plan also keeps what it saw (each named entry's
recorded last use, the contexts it keeps): execution removes only what is still as planned, so a
plan that waited at a prompt while a build reused its chunks removes none of them.
"""

from __future__ import annotations

import time
from array import array
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import EntryNotFoundError
from kvstore.store.infos import matches_model
from kvstore.store.keyspace import is_key
from kvstore.store.removal import CORRUPT, GcPlan, Planned
from kvstore.store.tables import OWNED_ONLY

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.scan import StoreInfo
    from kvstore.store.tables import ContextTable, EntryTable

DEFAULT_GRACE_SECONDS = 3600.0
# Below this a chunk a running build has written and not recorded yet may be planned for removal;
# the build then computes it again (its record checks its chunks), which costs time, not data.
SAFE_GRACE_SECONDS = 600.0


def _age_str(seconds: float) -> str:
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} minutes"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"


@dataclass(frozen=True)
class GcOptions:
    """What :func:`plan_gc` removes (the ``kvstore gc`` / ``kvstore rm`` options): ``corrupt``,
    ``model``, ``older_than`` (seconds), ``max_bytes``, ``keys`` (key prefixes), ``orphans`` and
    their ``grace`` (seconds)."""

    corrupt: bool = False
    model: str | None = None
    older_than: float | None = None
    max_bytes: int | None = None
    keys: Sequence[str] = ()
    orphans: bool = False
    grace: float = DEFAULT_GRACE_SECONDS


def plan_gc(info: StoreInfo, options: GcOptions | None = None, *, now: float | None = None) -> GcPlan:
    """Choose contexts, entries and derived entries to remove from a scan (see
    :func:`kvstore.store.removal.execute_plan`), as ``options`` (:class:`GcOptions`) say.

    ``model`` and ``keys`` narrow which contexts may go (the *scope*): contexts whose fingerprint
    starts with ``model`` or whose model name equals it, and whose key starts with one of ``keys``
    (a key prefix may also name an entry that no context uses, a chunk, a derived entry or a
    corrupt entry). Within the scope, ``older_than`` (seconds since last use) removes old contexts,
    then ``max_bytes`` removes least-recently-used contexts until the scope's chunks and derived
    entries fit in that many stored bytes. With a scope but none of
    ``older_than``/``max_bytes``/``corrupt``, the whole scope goes (``kvstore rm``). A removed
    context's chunks go when no kept context uses them, and its derived entries always. An entry
    named by key that no context uses takes with it the chunks before it in its chain that no
    context uses (found by their parent links: what an ``rm`` interrupted after removing its
    records left). ``corrupt`` removes the entries and derived entries that failed the scan
    (through a local tier: whose remote copy failed; a bad tier copy of an intact one is listed in
    ``tier_copies``, to drop from the tier only), the contexts that use a corrupt entry
    or miss a chunk, and malformed context records; ``orphans`` removes chunks no context uses and
    derived entries whose context is gone, once their last use is older than ``grace`` seconds.
    With nothing at all, nothing is removed. Entries this kvstore cannot read (``info.unknown``: a
    newer format, a kind this process does not know) are never removed, a context using or owning
    one is neither broken nor gone, and its readable entries are no orphans.

    Raises EntryNotFoundError when a key prefix matches nothing.
    """
    opts = options if options is not None else GcOptions()
    now = time.time() if now is None else now
    E, C = info.entries, info.contexts
    for k in opts.keys:
        if not _matches(info, k):
            raise EntryNotFoundError(f"no context or entry matches key {k!r} in {info.url}")
    in_keys = _KeyFilter(tuple(opts.keys))
    scope = [i for i in range(len(C)) if in_keys(C.keys[i]) and matches_model(*C.about(i), opts.model)]
    named_only = bool(opts.keys) and not _has_criterion(opts)
    # contexts: asked for, then too old, then least recently used over the budget, then broken
    drop = _asked_for(C, scope, opts) | _too_old(C, scope, opts, now)
    refs = _released(E, C, drop)
    drop |= _over_budget(E, C, scope, drop, refs, opts.max_bytes)
    remove = _chunks_of(E, C, drop, refs)
    if named_only:
        remove |= _named_unused(E, opts, remove)
    remove |= _corrupt_chunks(info, opts, in_keys, named_only)
    broken_drop, broken = _broken_contexts(info, drop, remove) if opts.corrupt else ({}, set())
    drop |= broken_drop
    if opts.orphans:  # what is already planned keeps its reason
        remove |= {k: row for k, row in _orphan_chunks(info, opts, in_keys, now).items() if k not in remove}
    owned = _plan_owned(info, opts, {C.keys[i]: why for i, why in drop.items()}, now, in_keys)
    return _assemble(info, opts, in_keys, drop, remove, broken, owned)


class _KeyFilter:
    """Whether any of some names starts with one of the ``keys`` prefixes (all do without keys)."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys

    def __call__(self, *names: str) -> bool:
        return not self.keys or any(n.startswith(k) for k in self.keys for n in names)


def _has_criterion(opts: GcOptions) -> bool:
    return opts.corrupt or opts.older_than is not None or opts.max_bytes is not None or opts.orphans


def _asked_for(C: ContextTable, scope: list[int], opts: GcOptions) -> dict[int, str]:
    """The whole scope, when a model or keys narrow it and no criterion is given (``kvstore rm``)."""
    if not (opts.model or opts.keys) or _has_criterion(opts):
        return {}
    return {i: f"model {C.about(i)[1]}" if opts.model else "asked for" for i in scope}


def _too_old(C: ContextTable, scope: list[int], opts: GcOptions, now: float) -> dict[int, str]:
    if opts.older_than is None:
        return {}
    out = {}
    for i in scope:
        used = C.last_used(i)
        if now - used > opts.older_than:
            out[i] = f"unused for {_age_str(now - used)}"
    return out


def _release(refs: array, C: ContextTable, i: int) -> None:
    for r in set(C.rows(i)):
        if r >= 0:
            refs[r] -= 1


def _released(E: EntryTable, C: ContextTable, drop: Mapping[int, str]) -> array:
    """Each chunk's count of contexts using it, less the dropped ones."""
    refs = array("i", E.refs)
    for i in drop:
        _release(refs, C, i)
    return refs


def _over_budget(E: EntryTable, C: ContextTable, scope: list[int], drop: Mapping[int, str], refs: array,
                 max_bytes: int | None) -> dict[int, str]:  # fmt: skip
    """The least recently used contexts of the scope until its chunks and derived entries fit in
    ``max_bytes`` (their chunks released from ``refs``)."""
    if max_bytes is None:
        return {}
    kept = sorted((i for i in scope if i not in drop), key=lambda i: (C.last_used(i), C.keys[i]))
    marked = bytearray(len(E))
    for i in scope:
        for r in C.rows(i):
            if r >= 0:
                marked[r] = 1
    total = sum(E.stored(r) for r in range(len(E)) if marked[r] and refs[r] > 0)
    total += sum(C.owned_bytes(i) for i in scope if i not in drop)
    out: dict[int, str] = {}
    for i in kept:
        if total <= max_bytes:
            break
        out[i] = "least recently used over the size budget"
        _release(refs, C, i)
        total -= sum(E.stored(r) for r in set(C.rows(i)) if r >= 0 and refs[r] == 0) + C.owned_bytes(i)
    return out


def _chunks_of(E: EntryTable, C: ContextTable, drop: Mapping[int, str], refs: array) -> dict[str, tuple[str, str, int]]:
    """The dropped contexts' chunks that no kept context uses."""
    remove: dict[str, tuple[str, str, int]] = {}
    for i, why in drop.items():
        for r in dict.fromkeys(C.rows(i)):
            k = E.keys[r] if r >= 0 else ""
            if r >= 0 and refs[r] <= 0 and k not in remove:
                remove[k] = (k, f"chunk of a removed context ({why})" if k != C.keys[i] else why, E.stored(r))
    return remove


def _named_unused(E: EntryTable, opts: GcOptions, remove: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
    """Entries named by key that no context uses, with their unused ancestors."""
    out: dict[str, tuple[str, str, int]] = {}
    for r in sorted({r for k in opts.keys for r in E.rows_with_prefix(k)}):
        p = E.profile(r)
        if E.refs[r] or not matches_model(p.model, p.model_name, opts.model):
            continue
        if E.keys[r] not in remove and E.keys[r] not in out:
            for a in _unused_ancestors(E, r, ChainMap(out, remove)):
                out[E.keys[a]] = (E.keys[a], "chunk of a removed context (asked for)", E.stored(a))
            out[E.keys[r]] = (E.keys[r], "asked for", E.stored(r))
    return out


def _corrupt_chunks(info: StoreInfo, opts: GcOptions, in_keys: _KeyFilter, named_only: bool
                    ) -> dict[str, tuple[str, str, int]]:  # fmt: skip
    return {
        bad.key: (bad.key, CORRUPT + bad.reason, bad.stored_bytes)
        for bad in info.corrupt
        if not bad.context and (opts.corrupt or named_only) and in_keys(bad.key)
    }


def _broken_contexts(info: StoreInfo, drop: Mapping[int, str], remove: Mapping[str, Any]
                     ) -> tuple[dict[int, str], set[str]]:  # fmt: skip
    """Contexts that use a removed corrupt entry, or miss a chunk (their intact chunks stay), and
    the keys of the latter."""
    E, C = info.entries, info.contexts
    bad_keys = {bad.key for bad in info.corrupt if not bad.context}
    gone = bad_keys & set(remove)
    present = bad_keys | info.unknown_chunks  # a newer writer's chunk is there, not missing
    out: dict[int, str] = {}
    broken: set[str] = set()
    for i in range(len(C)):
        if i in drop:
            continue
        chunks = C.chunk_keys(i)
        if gone & set(chunks):
            out[i] = "uses a corrupt entry"
        elif problem := _broken_by_absence(chunks, E, present):
            out[i] = problem  # e.g. an rm or gc killed between its two deletes, before records went first
            broken.add(C.keys[i])
    return out, broken


def _orphan_chunks(info: StoreInfo, opts: GcOptions, in_keys: _KeyFilter, now: float
                   ) -> dict[str, tuple[str, str, int]]:  # fmt: skip
    E = info.entries
    out = {}
    for r in info.orphan_rows():
        p, used = E.profile(r), E.last_used(r)
        if matches_model(p.model, p.model_name, opts.model) and in_keys(E.keys[r]) and now - used > opts.grace:
            out[E.keys[r]] = (E.keys[r], f"no context uses it (unused for {_age_str(now - used)})", E.stored(r))
    return out


def _assemble(
    info: StoreInfo, opts: GcOptions, in_keys: _KeyFilter, drop: Mapping[int, str],
    remove: Mapping[str, tuple[str, str, int]], broken: set[str], owned: tuple[Planned, ...],
) -> GcPlan:  # fmt: skip
    """The plan from what each criterion chose: what stays, the local tier's bad copies, what the
    plan saw of each named entry (execution removes only what is still so)."""
    E, C = info.entries, info.contexts
    chunks = tuple(Planned(k, why, size) for k, why, size in remove.values())
    planned = {(r.owner, r.key) for r in (*chunks, *owned)}
    tier_copies = tuple(
        Planned(c.key, f"local tier copy corrupt: {c.reason}", c.stored_bytes, c.context, "" if c.context else "chunk")
        for c in info.local_corrupt
        if opts.corrupt and in_keys(c.context or c.key, c.key) and (c.context, c.key) not in planned
    )
    keep_bytes = sum(E.stored(r) for r in range(len(E)) if E.keys[r] not in remove)
    keep_bytes += sum(d.stored_bytes for d in info.owned if (d.context, d.key) not in planned)
    context_rows = tuple((C.keys[i], why, C.stored(i) + C.owned_bytes(i)) for i, why in drop.items())
    # context records that do not read (under a name a record can have): nothing can use them
    context_rows += tuple(
        (b.key, b.reason, 0) for b in info.malformed if opts.corrupt and is_key(b.key) and in_keys(b.key)
    )
    chains = {C.keys[i]: C.chunk_keys(i) for i in drop}
    named = {*remove, *(k for ks in chains.values() for k in ks), *(r.key for r in owned)}
    seen = {k: t for k in named if (t := E.recorded_of(k)) is not None}
    return GcPlan(
        (*owned, *chunks), keep_bytes, context_rows, tier_copies, chains, seen=seen,
        kept_contexts=frozenset(C.keys) - set(chains), broken=frozenset(broken),
        owned_only=frozenset(C.keys[i] for i in drop if C.kind[i] == OWNED_ONLY),
        gone=_gone(info, {r.owner for r in owned}),
    )  # fmt: skip


def _gone(info: StoreInfo, contexts: set[str]) -> dict[str, frozenset[str]]:
    """Of ``contexts``, those the scan saw gone (neither recorded nor pressed), with the derived
    keys it saw of each: execution keeps their derived entries if one comes back meanwhile."""
    live = set(info.contexts.keys)
    seen: dict[str, set[str]] = {c: set() for c in contexts - live}
    for d in info.owned:
        if d.context in seen:
            seen[d.context].add(d.key)
    for bad in (*info.corrupt, *info.unknown):
        if bad.context in seen:
            seen[bad.context].add(bad.key)
    return {c: frozenset(keys) for c, keys in seen.items()}


def _plan_owned(info: StoreInfo, opts: GcOptions, dropped: Mapping[str, str], now: float,
                in_keys: Callable[..., bool]) -> tuple[Planned, ...]:  # fmt: skip
    """The entries contexts own to remove, those that stand for their context (pressed caches)
    last (so that a context known by them alone stays one until its last goes): those of the
    ``dropped`` contexts, those named by key (or by the key of a context that is gone), the orphans
    past the grace, the corrupt."""
    live = set(info.contexts.keys) | info.unknown_contexts  # a newer writer's context is no orphan's
    keys, model, criterion = opts.keys, opts.model, opts.corrupt or opts.orphans
    criterion = criterion or opts.older_than is not None or opts.max_bytes is not None
    out: dict[tuple[str, str], Planned] = {}
    for d in info.owned:
        why = ""
        if d.context in dropped:
            why = f"derived entry of a removed context ({dropped[d.context]})"
        elif (
            keys
            and not criterion
            and d.matches_model(model)
            and (in_keys(d.key) or (d.context not in live and in_keys(d.context)))
        ):
            why = "asked for"
        elif opts.orphans and d.context not in live and d.matches_model(model) and in_keys(d.context, d.key):
            if now - d.last_used > opts.grace:
                why = f"no context uses it (unused for {_age_str(now - d.last_used)})"
        if why:
            out[d.context, d.key] = Planned(d.key, why, d.stored_bytes, d.context, d.kind)
    for bad in info.corrupt:
        if bad.context and (opts.corrupt or (keys and not criterion)) and in_keys(bad.context, bad.key):
            out[bad.context, bad.key] = Planned(bad.key, CORRUPT + bad.reason, bad.stored_bytes, bad.context, "")
    return tuple(sorted(out.values(), key=lambda row: row.phase))


def _matches(info: StoreInfo, prefix: str) -> bool:
    """Whether a key prefix names anything: a context, a chunk, a derived entry or a corrupt entry."""
    return (
        bool(info.entries.rows_with_prefix(prefix))
        or any(k.startswith(prefix) for k in info.contexts.keys)
        or any(d.key.startswith(prefix) or d.context.startswith(prefix) for d in info.owned)
        or any(c.key.startswith(prefix) or c.context.startswith(prefix) for c in info.corrupt)
    )


def _unused_ancestors(entries: EntryTable, row: int, remove: Mapping[str, Any]) -> list[int]:
    """The chunks before ``row`` in its chain (by their parent links) that no context uses, the
    first of the chain first: a context whose record went keeps its chunks linked."""
    out: list[int] = []
    parent = entries.parent(row)
    while parent:
        r = entries.row(parent)
        if r < 0 or entries.refs[r] or r in out or parent in remove:
            break
        out.append(r)
        parent = entries.parent(r)
    return out[::-1]


def _broken_by_absence(chunks: Sequence[str], entries: EntryTable, present: set[str]) -> str:
    """``chunk i of n (key) is missing`` for the first chunk neither stored intact nor ``present``
    (corrupt, or of a format newer than this kvstore's)."""
    for i, k in enumerate(chunks):
        if entries.row(k) < 0 and k not in present:
            return f"chunk {i + 1} of {len(chunks)} ({k[:12]}) is missing"
    return ""


__all__ = ["DEFAULT_GRACE_SECONDS", "SAFE_GRACE_SECONDS", "GcOptions", "plan_gc"]
