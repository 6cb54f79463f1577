"""Removing from a store, plan then execute: :func:`plan_gc` chooses contexts and chunks from a
scan, :func:`execute_plan` removes them.

A chunk goes only when no remaining context uses it; a chunk no context uses (an *orphan*) goes
once its last use is older than a grace period, so that a build running meanwhile, which writes its
chunks first and its context record last, and marks the chunks it reuses as used, never loses one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import EntryNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.kvstore import KVStore
    from kvstore.store.scan import ContextInfo, StoreInfo

DEFAULT_GRACE_SECONDS = 3600.0


@dataclass(frozen=True)
class GcPlan:
    """What to remove and why; nothing is removed until :func:`execute_plan`. ``contexts``:
    context records ``(key, reason, logical bytes)``; ``remove``: entries ``(key, reason, stored
    bytes)`` (chunks no kept context uses, format-1 entries, corrupt entries)."""

    remove: tuple[tuple[str, str, int], ...]
    keep_bytes: int  # stored bytes of the intact entries left afterwards
    contexts: tuple[tuple[str, str, int], ...] = ()

    @property
    def n(self) -> int:
        return len(self.remove) + len([c for c in self.contexts if c[0] not in {r[0] for r in self.remove}])

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
    orphans: bool = False,
    grace: float = DEFAULT_GRACE_SECONDS,
    now: float | None = None,
) -> GcPlan:
    """Choose contexts and entries to remove from a scan (see :func:`execute_plan`).

    ``model`` and ``keys`` narrow which contexts may go (the *scope*): contexts whose fingerprint
    starts with ``model`` or whose model name equals it, and whose key starts with one of ``keys``
    (a key prefix may also name an entry that no context uses, a chunk or a corrupt entry). Within
    the scope, ``older_than`` (seconds since last use) removes old contexts, then ``max_bytes``
    removes least-recently-used contexts until the scope's chunks fit in that many stored bytes.
    With a scope but none of ``older_than``/``max_bytes``/``corrupt``, the whole scope goes
    (``kvstore rm``). A removed context's chunks go when no kept context uses them. ``corrupt``
    removes the entries that failed the scan; ``orphans`` removes chunks no context uses whose last
    use is older than ``grace`` seconds. With nothing at all, nothing is removed.

    Raises EntryNotFoundError when a key prefix matches nothing.
    """
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
    if corrupt:  # a context that uses a removed entry is dropped; its intact chunks stay for a rebuild
        gone = {bad.key for bad in info.corrupt} & set(remove)
        for c in info.contexts:
            if c.key not in drop and gone & set(c.chunks):
                drop[c.key] = "uses a corrupt entry"
    if orphans:
        for e in info.orphans:
            if e.matches_model(model) and in_keys(e.key) and now - e.last_used > grace:
                remove.setdefault(e.key, (e.key, f"no context uses it (unused for {_age_str(now - e.last_used)})",
                                          e.stored_bytes))  # fmt: skip
    keep_bytes = sum(e.stored_bytes for e in info.entries if e.key not in remove)
    context_rows = tuple((k, why, contexts[k].stored_bytes) for k, why in drop.items())
    return GcPlan(tuple(remove.values()), keep_bytes, context_rows)


def execute_plan(store: KVStore, plan: GcPlan) -> int:
    """Remove the planned context records and entries; returns how many entries were removed."""
    return store.delete_many((r[0] for r in plan.remove), contexts=(c[0] for c in plan.contexts))


__all__ = ["DEFAULT_GRACE_SECONDS", "GcPlan", "execute_plan", "plan_gc"]
