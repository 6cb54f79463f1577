"""The derived part of a build: pressed caches and scores stored beside each context.

For the contexts whose :class:`~kvstore.model.plan.build.ContextStep` lacks pressed caches or
scores, in batches: the dense cache is loaded (stored whole by the build's dense part, or before)
or computed (``dense=False``: in memory, never stored; a lossy codec's round trip applied, as a
stored chain would be), then each scorer's scores are computed once and stored
(:class:`~kvstore.model.press.stored.StoredScores`), and each press's kept tokens are encoded with
the store's codec and stored as a pressed entry (:func:`~kvstore.model.press.stored.encode_kept`).
A press's scores are read from the store when they are there, so ``build --score kvzip`` then
``build --press kvzip:0.5 --press kvzip:0.75`` replays each context once. Each entry is one
atomic put: an interrupted build leaves some contexts' entries written and the re-run makes the
others (its plan finds what is there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.forward import batches
from kvstore.model.compute.writer import Writer
from kvstore.model.options import BuildOptions
from kvstore.model.plan.batch import RowSet, plan_batch
from kvstore.model.press.prune import DenseRow
from kvstore.model.press.select import PressMemo, kept_masks, row_scores
from kvstore.model.press.spec import ScoringTokens
from kvstore.model.press.stored import StoredScores, encode_kept
from kvstore.model.stages.complete import complete
from kvstore.model.stages.load import load
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.plan.build import ContextStep


@dataclass(frozen=True)
class Derived:
    """What the derived part did: pressed caches and scores stored, their stored bytes, context
    tokens computed (dense caches that were not stored), contexts computed, and the scorers'
    scoring tokens."""

    pressed: int = 0
    scores: int = 0
    bytes: int = 0
    tokens: int = 0
    computed_contexts: int = 0
    scoring: ScoringTokens = ScoringTokens()


@torch.inference_mode()
def derive(
    handle: ModelHandle, store: KVStore, steps: Sequence[ContextStep], options: BuildOptions,
    progress: Progress | None = None,
) -> Derived:  # fmt: skip
    """Store the pressed caches and scores ``steps`` lack (see the module docstring)."""
    if not steps:
        return Derived()
    chains = tuple(s.chain for s in steps)
    requests = RowSet(chains, ((),) * len(chains), 0)
    writer = Writer(store) if options.dense else None  # computed dense chains are stored only with dense=True
    sizes = [c.n_tokens for c in chains]
    order = sorted(range(len(chains)), key=lambda i: sizes[i])
    assert options.batch_size is not None
    done = Derived()
    try:
        for batch in batches(order, sizes, options.batch_size, options.max_batch_tokens):
            done = _batch(handle, store, writer, [steps[i] for i in batch], _Run(requests, batch), done)
            if progress:
                progress(0, sum(sizes[i] for i in batch))
    finally:
        if writer is not None:
            writer.close()
    return done


@dataclass(frozen=True)
class _Run:
    requests: RowSet
    batch: list[int]


def _batch(
    handle: ModelHandle, store: KVStore, writer: Writer | None, steps: Sequence[ContextStep], run: _Run, done: Derived
) -> Derived:
    plan = plan_batch(run.batch, run.requests, store, writer)
    loaded = load(handle, plan, store, writer)
    completed = complete(handle, plan, loaded, store, writer)
    cache = completed.cache
    assert cache is not None
    scores = StoredScores(handle, store, plan.contexts, writable=True)
    memo = PressMemo(stored=scores)
    pressed = nbytes = 0
    for r, step in enumerate(steps):
        for scorer in step.scores:
            scores.save(scorer, step.chain.ids, row_scores(handle, cache, scorer, r, memo), force=True)
        a, b = cache.spans[r]
        layers = [(kb[r, :, a:b], vb[r, :, a:b]) for kb, vb in cache.bufs]
        for press in step.presses:
            masks = kept_masks(press, row_scores(handle, cache, press, r, memo), b - a)
            _, blob = encode_kept(handle, step.chain, press, DenseRow(layers, masks).kept_tensors(), store.codec)
            nbytes += store.put_derived(blob)
            pressed += 1
    computed = completed.computed
    return Derived(
        done.pressed + pressed, done.scores + len(scores.saved), done.bytes + nbytes + scores.saved_bytes,
        done.tokens + computed, done.computed_contexts + _computed(plan, completed.tokens_loaded),
        done.scoring + memo.tokens,
    )  # fmt: skip


def _computed(plan, loaded) -> int:
    """Contexts of ``plan`` whose dense cache was (partly) computed, not loaded whole."""
    return sum(1 for k in plan.distinct if loaded[k] < plan.context_of(k).n_tokens)


__all__ = ["Derived", "derive"]
