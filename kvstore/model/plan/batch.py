"""A batch, planned once: which rows, which contexts, what is stored, what to compute and write.

A :class:`BatchPlan` is a frozen value made by :func:`plan_batch` before any tensor is touched;
the stages take it (:mod:`kvstore.model.stages`): load copies each distinct context's stored
prefix, complete computes the rest and hands it to the writer, transform presses the contexts,
answer and score run the fed tokens. Sampling, sweeps, scoring and the lm-eval backend run the same
stages from it; loading ahead is "plan the next batch, then submit its load".

The layout it fixes (exactness depends on it): contexts *left*-padded to the batch's longest ``P``
(pads are zero KV, masked), the fed tokens (questions, or scoring's continuation) in the slots from
``P`` on, then ``new_tokens`` generated ones; ``slots = P + Q + new_tokens`` (rounded up to a bucket
for fixed-shape steps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvstore.model.compute.static import bucket_slots
from kvstore.model.plan.chains import Chain
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.compute.writer import Writer


@dataclass(frozen=True)
class BatchPlan:
    """One batch (see the module docstring).

    ``rows``: the caller's row numbers, in batch order; ``contexts``: each batch row's context
    chain; ``fed``: each batch row's ids fed after its context (a question, or scoring's fed
    tokens); ``new_tokens``: tokens generated per row; ``slots``: KV buffer slots per row;
    ``stored``: per distinct context key, how many leading chunks the plan expects to load (found in
    a local store, or waiting in the writer; the whole chain for a remote store, whose load finds
    out); ``pending``: chunk keys the writer held, not yet written, when the batch was planned (the
    load waits for them); ``write``: computed chunks and records go to the writer."""

    rows: tuple[int, ...]
    contexts: tuple[Chain, ...]
    fed: tuple[tuple[int, ...], ...]
    new_tokens: int
    slots: int
    stored: Mapping[str, int]
    pending: frozenset[str] = frozenset()
    write: bool = False

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
        depth = self.stored.get(key, 0)
        return self.context_of(key).spans[depth - 1][1] if depth else 0

    def compute_tokens(self, key: str) -> int:
        """Context tokens the plan expects to compute for ``key``."""
        return self.context_of(key).n_tokens - self.load_tokens(key)


def stored_depth(plan: Chain, store: KVStore | None, pending: frozenset[str]) -> int:
    """Leading chunks of ``plan`` a load should find: present in a local store or ``pending`` in
    the writer; every chunk for a remote store (the load stops at the first it does not find)."""
    if store is None:
        return 0
    if not store.backend.local:
        return len(plan.keys)
    depth = 0
    for k in plan.keys:
        if k not in pending and not store.contains(k):
            break
        depth += 1
    return depth


def plan_batch(
    rows: Sequence[int], contexts: Sequence[Chain], fed: Sequence[Sequence[int]], new_tokens: int,
    store: KVStore | None, writer: Writer | None, fixed_slots: bool = False,
) -> BatchPlan:  # fmt: skip
    """Plan a batch of ``rows`` (``contexts[i]`` and ``fed[i]`` per caller row ``i``) for ``store``
    (None: nothing is loaded, as the reference runs), the writer's pending chunks included."""
    ctx = tuple(contexts[i] for i in rows)
    feds = tuple(tuple(fed[i]) for i in rows)
    chunk_keys = {k for p in ctx for k in p.keys}
    pending = writer.pending(chunk_keys) if writer is not None else frozenset()
    stored = {p.key: stored_depth(p, store, pending) for p in {p.key: p for p in ctx}.values()}
    P, Q = max(p.n_tokens for p in ctx), max(len(f) for f in feds)
    return BatchPlan(
        tuple(rows), ctx, feds, new_tokens, bucket_slots(P + Q + new_tokens, fixed_slots),
        MappingProxyType(stored), pending, writer is not None,
    )  # fmt: skip


__all__ = ["BatchPlan", "plan_batch", "stored_depth"]
