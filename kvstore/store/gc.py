"""Removing from a store, plan then execute: :func:`plan_gc` chooses contexts and chunks from a
scan, :func:`kvstore.store.removal.execute_plan` removes them.

A chunk goes only when no remaining context uses it; a chunk no context uses (an *orphan*) goes
once its last use is older than a grace period (a build writes its chunks before its context
record). The plan also keeps what it saw (each named entry's recorded last use, the contexts it
keeps): execution removes only what is still as planned, so a plan that waited at a prompt while a
build reused its chunks removes none of them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import EntryNotFoundError
from kvstore.store.keyspace import is_key
from kvstore.store.removal import GcPlan

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.scan import ContextInfo, StoreInfo

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
    """Choose contexts and entries to remove from a scan (see
    :func:`kvstore.store.removal.execute_plan`), as ``options`` (:class:`GcOptions`) say.

    ``model`` and ``keys`` narrow which contexts may go (the *scope*): contexts whose fingerprint
    starts with ``model`` or whose model name equals it, and whose key starts with one of ``keys``
    (a key prefix may also name an entry that no context uses, a chunk or a corrupt entry). Within
    the scope, ``older_than`` (seconds since last use) removes old contexts, then ``max_bytes``
    removes least-recently-used contexts until the scope's chunks fit in that many stored bytes.
    With a scope but none of ``older_than``/``max_bytes``/``corrupt``, the whole scope goes
    (``kvstore rm``). A removed context's chunks go when no kept context uses them. ``corrupt``
    removes the entries that failed the scan (through a local tier: whose remote copy failed; a
    bad tier copy of an intact entry is listed in ``local``, to drop from the tier only), the
    contexts that use one or miss a chunk, and malformed context records; ``orphans`` removes
    chunks no context uses whose last use is older than ``grace`` seconds. With nothing at all,
    nothing is removed.

    Raises EntryNotFoundError when a key prefix matches nothing.
    """
    opts = options if options is not None else GcOptions()
    corrupt, model, older_than, max_bytes = opts.corrupt, opts.model, opts.older_than, opts.max_bytes
    keys, orphans, grace = opts.keys, opts.orphans, opts.grace
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
    broken: set[str] = set()
    if corrupt:  # a context that uses a removed entry, or misses a chunk, is dropped; its intact chunks stay
        gone = {bad.key for bad in info.corrupt} & set(remove)
        bad_keys = {bad.key for bad in info.corrupt}
        for c in info.contexts:
            if c.key in drop:
                continue
            if gone & set(c.chunks):
                drop[c.key] = "uses a corrupt entry"
            elif problem := _broken_by_absence(c.chunks, entries, bad_keys):
                drop[c.key] = problem  # e.g. an rm or gc killed between its two deletes, before records went first
                broken.add(c.key)
    if orphans:
        for e in info.orphans:
            if e.matches_model(model) and in_keys(e.key) and now - e.last_used > grace:
                remove.setdefault(e.key, (e.key, f"no context uses it (unused for {_age_str(now - e.last_used)})",
                                          e.stored_bytes))  # fmt: skip
    local = tuple(
        (c.key, f"local tier copy corrupt: {c.reason}", c.stored_bytes)
        for c in info.local_corrupt
        if corrupt and in_keys(c.key) and c.key not in remove
    )
    keep_bytes = sum(e.stored_bytes for e in info.entries if e.key not in remove)
    context_rows = tuple((k, why, contexts[k].stored_bytes) for k, why in drop.items())
    # context records that do not read (under a name a record can have): nothing can use them
    context_rows += tuple((b.key, b.reason, 0) for b in info.malformed if corrupt and is_key(b.key) and in_keys(b.key))
    chains = {k: contexts[k].chunks for k in drop}
    named = {*remove, *(k for chunks in chains.values() for k in chunks)}
    return GcPlan(
        tuple(remove.values()), keep_bytes, context_rows, chains,
        seen={k: t for k, t in info.recorded_access.items() if k in named},
        kept_contexts=frozenset(contexts) - set(drop),
        corrupt=frozenset(k for k, why, _ in remove.values() if why.startswith("corrupt: ")),
        broken=frozenset(broken),
        local=local,
    )  # fmt: skip


def _broken_by_absence(chunks: Sequence[str], entries: Mapping, corrupt: set[str]) -> str:
    """``chunk i of n (key) is missing`` for the first chunk neither stored intact nor corrupt."""
    for i, k in enumerate(chunks):
        if k not in entries and k not in corrupt:
            return f"chunk {i + 1} of {len(chunks)} ({k[:12]}) is missing"
    return ""


__all__ = ["DEFAULT_GRACE_SECONDS", "SAFE_GRACE_SECONDS", "GcOptions", "plan_gc"]
