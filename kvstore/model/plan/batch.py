"""A batch, planned once: which rows, which contexts, what is stored, what to load, compute and write.

A :class:`BatchPlan` is a frozen value made by :func:`plan_batch` before any tensor is touched,
and the contract the stages keep (:mod:`kvstore.model.stages`): the load reads the planned chunks
of the contexts whose dense cache the batch needs (``dense``) and reports how much it found
(``Loaded.tokens``), complete computes exactly what was not loaded and hands it to the writer,
transform presses the contexts or reads the planned pressed entries (``pressed``), answer and
score run the fed tokens. Sampling, sweeps, scoring and the lm-eval backend run the same stages
from it; loading ahead is "plan the next batch, then submit its load"; an out-of-memory batch runs
again as the plans of its two halves (:meth:`BatchPlan.part`).

The layout it fixes (exactness depends on it): contexts *left*-padded to the batch's longest ``P``
(pads are zero KV, masked), the fed tokens (questions, or scoring's continuation) in the slots from
``P`` on, then ``new_tokens`` generated ones; ``slots = P + Q + new_tokens`` (rounded up to a bucket
for fixed-shape steps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvstore.model.compute.static import bucket_slots
from kvstore.model.io.chains import Chain
from kvstore.model.press.stored import has_pressed
from kvstore.model.variants.variant import Variant
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.io.writer import Writer

_EMPTY: Mapping[str, Mapping[str, str]] = MappingProxyType({})


@dataclass(frozen=True)
class RowSet:
    """A run's rows as the planner reads them, per caller row: its context's chain, the ids fed
    after it (a question, or scoring's fed tokens), and the chain its derived entries (stored
    scores, pressed caches) are filed under: its context's (empty), or for scoring the context
    but its last token, which is what a press reads there. ``new_tokens``: generated per row."""

    chains: tuple[Chain, ...]
    fed: tuple[tuple[int, ...], ...]
    new_tokens: int
    derived: tuple[Chain, ...] = ()


@dataclass(frozen=True)
class BatchPlan:
    """One batch (see the module docstring).

    ``rows``: the caller's row numbers, in batch order; ``contexts``: each batch row's chain;
    ``fed``: each batch row's ids fed after its context (a question, or scoring's fed tokens);
    ``new_tokens``: tokens generated per row; ``fixed``: fixed-shape decode steps (slots rounded up
    to a bucket); ``slots``: KV buffer slots per row; ``stored``: per distinct context key, how many
    leading chunks the load reads (found in a local store, or waiting in the writer; the whole chain
    for a remote store, whose load finds out); ``unwritten``: chunk keys the writer held, not yet
    written, when the batch was planned (the load waits for them); ``write``: computed chunks and
    records go to the writer; ``dense``: the distinct contexts whose dense cache the batch loads or
    computes (every one but those whose every variant reads a stored pressed entry); ``pressed``:
    per variant name, ``{context key: derived key}`` of the stored pressed entries it reads;
    ``derived``: per batch row, the chain its derived entries are filed under (empty: its context's)."""

    rows: tuple[int, ...]
    contexts: tuple[Chain, ...]
    fed: tuple[tuple[int, ...], ...]
    new_tokens: int
    slots: int
    stored: Mapping[str, int]
    unwritten: frozenset[str] = frozenset()
    write: bool = False
    fixed: bool = False
    dense: frozenset[str] = field(default=frozenset())
    pressed: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: _EMPTY)
    derived: tuple[Chain, ...] = ()

    @property
    def derived_chains(self) -> tuple[Chain, ...]:
        """Per batch row, the chain its derived entries are filed under."""
        return self.derived or self.contexts

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(p.key for p in self.contexts)

    @property
    def distinct(self) -> Mapping[str, tuple[int, ...]]:
        """Each distinct context key and the batch rows that share it (first row first)."""
        out: dict[str, list[int]] = {}
        for r, p in enumerate(self.contexts):
            out.setdefault(p.key, []).append(r)
        return MappingProxyType({k: tuple(v) for k, v in out.items()})

    @property
    def context_slots(self) -> int:
        """``P``: the longest context; slots before it hold the contexts, left-padded."""
        return max(p.n_tokens for p in self.contexts)

    @property
    def fed_slots(self) -> int:
        """``Q``: the longest fed sequence."""
        return max(len(f) for f in self.fed)

    def context_of(self, key: str) -> Chain:
        return self.contexts[self.distinct[key][0]]

    def load_tokens(self, key: str) -> int:
        """Context tokens the plan expects to load for ``key`` (the end of its stored chunks)."""
        depth = self.stored.get(key, 0) if key in self.dense else 0
        return self.context_of(key).spans[depth - 1][1] if depth else 0

    def compute_tokens(self, key: str) -> int:
        """Context tokens the plan expects to compute for ``key`` (0 when its dense cache is not needed)."""
        return self.context_of(key).n_tokens - self.load_tokens(key) if key in self.dense else 0

    def entries(self, variant: str) -> Mapping[str, str]:
        """``{context key: derived key}`` of the pressed entries ``variant`` reads."""
        return self.pressed.get(variant, MappingProxyType({}))

    def with_dense(self, keys: frozenset[str]) -> BatchPlan:
        """This plan with the contexts ``keys`` loaded or computed densely instead of read from their
        pressed entries (an entry that turned out corrupt or foreign: a miss)."""
        pressed = {v: {k: d for k, d in m.items() if k not in keys} for v, m in self.pressed.items()}
        return replace(self, dense=self.dense | keys, pressed=_frozen(pressed))

    def part(self, positions: Sequence[int]) -> BatchPlan:
        """The plan of the batch rows at ``positions`` (an out-of-memory half): the same chains,
        stored depths, unwritten chunks and sources, their slots recomputed."""
        ctx = tuple(self.contexts[i] for i in positions)
        fed = tuple(self.fed[i] for i in positions)
        keys = {c.key for c in ctx}
        P, Q = max(c.n_tokens for c in ctx), max(len(f) for f in fed)
        return BatchPlan(
            rows=tuple(self.rows[i] for i in positions), contexts=ctx, fed=fed, new_tokens=self.new_tokens,
            slots=bucket_slots(P + Q + self.new_tokens, self.fixed),
            stored=MappingProxyType({k: self.stored[k] for k in keys}), unwritten=self.unwritten, write=self.write,
            fixed=self.fixed, dense=self.dense & keys,
            pressed=_frozen({v: {k: d for k, d in m.items() if k in keys} for v, m in self.pressed.items()}),
            derived=tuple(self.derived[i] for i in positions) if self.derived else (),
        )  # fmt: skip


def _frozen(pressed: Mapping[str, Mapping[str, str]]) -> Mapping[str, Mapping[str, str]]:
    return MappingProxyType({v: MappingProxyType(dict(m)) for v, m in pressed.items() if m})


def stored_depth(chain: Chain, store: KVStore | None, unwritten: frozenset[str]) -> int:
    """Leading chunks of ``chain`` a load should find: present in a local store or held by
    the writer (``unwritten``); every chunk for a remote store (the load stops at the first it does not find)."""
    if store is None:
        return 0
    if not store.backend.local:
        return len(chain.keys)
    depth = 0
    for k in chain.keys:
        if k not in unwritten and not store.contains(k):
            break
        depth += 1
    return depth


def plan_batch(
    rows: Sequence[int], requests: RowSet, store: KVStore | None, writer: Writer | None, fixed_slots: bool = False,
    variants: Sequence[Variant] = (), *, known: Mapping[str, int] | None = None,
) -> BatchPlan:  # fmt: skip
    """Plan a batch of the caller's ``rows`` of ``requests`` for ``store`` (None: nothing is
    loaded, as the reference runs), the chunks the writer holds included; a context is read from a
    stored pressed entry by a press variant when ``store`` holds one, and its dense cache is loaded
    (or computed) only if some variant needs it. ``known``: stored depths the caller already has
    (a build's plan), by context key, used instead of probing the store again (a chunk gone since is
    found by the load, and computed)."""
    ctx = tuple(requests.chains[i] for i in rows)
    feds = tuple(tuple(requests.fed[i]) for i in rows)
    derived = tuple(requests.derived[i] for i in rows) if requests.derived else ()
    new_tokens = requests.new_tokens
    chunk_keys = {k for p in ctx for k in p.keys}
    unwritten = writer.unwritten(chunk_keys) if writer is not None else frozenset()
    distinct = list({p.key: p for p in ctx}.values())
    known = known or {}
    stored = {p.key: known[p.key] if p.key in known else stored_depth(p, store, unwritten) for p in distinct}
    filed = {c.key: d for c, d in zip(ctx, derived or ctx)}  # context key -> the chain its entries are under
    pressed: dict[str, Mapping[str, str]] = {}
    needed: set[str] = set()
    for v in variants or ():
        if store is None or v.press is None or v.press.question or v.press.ratio == 0:
            needed.update(p.key for p in distinct)
            continue
        pressed[v.name] = {
            k: d for k, d in has_pressed(store, [filed[p.key] for p in distinct], v.press, distinct).items()
        }
        needed.update(p.key for p in distinct if p.key not in pressed[v.name])
    if not variants:
        needed = {p.key for p in distinct}
    P, Q = max(p.n_tokens for p in ctx), max(len(f) for f in feds)
    return BatchPlan(
        rows=tuple(rows), contexts=ctx, fed=feds, new_tokens=new_tokens,
        slots=bucket_slots(P + Q + new_tokens, fixed_slots), stored=MappingProxyType(stored), unwritten=unwritten,
        write=writer is not None, fixed=fixed_slots,
        dense=frozenset(needed), pressed=_frozen(pressed), derived=derived,
    )  # fmt: skip


__all__ = ["BatchPlan", "RowSet", "plan_batch", "stored_depth"]
