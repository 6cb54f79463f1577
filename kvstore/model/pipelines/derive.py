"""The derived part of a build: pressed caches and scores stored beside each context.

For the contexts whose :class:`~kvstore.model.plan.build.ContextStep` lacks pressed caches or
scores, in batches: the dense cache is prepared by the model's cache path
(:meth:`~kvstore.model.paths.base.CachePath.prepare`, as a sample's is: loaded, stored whole by the
build's dense part or before, or computed and handed to the build's writer; ``dense=False``: in
memory, never stored; a lossy codec's round trip applied, as a stored chain would be), then each
scorer's scores are computed once and stored
(:class:`~kvstore.model.press.stored.StoredScores`), and each press's kept tokens (the row pressed as
a sample presses it, :func:`~kvstore.model.press.prune.pressed_row`) are encoded with the store's
codec as a pressed entry (:func:`~kvstore.model.press.stored.encode_kept`). Both are written by
the build's writer (:meth:`~kvstore.model.io.writer.Writer.put_owned`), off the compute thread and
after the chunks and records put before them.
A press's scores are read from the store when they are there, so ``build --score kvzip`` then
``build --press kvzip:0.5 --press kvzip:0.75`` replays each context once. Each entry is one
atomic put: an interrupted build leaves some contexts' entries written and the re-run makes the
others (its plan finds what is there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.forward import Decoding, batches
from kvstore.model.io.writer import Writer
from kvstore.model.options import BuildOptions
from kvstore.model.paths.base import BatchSetup, CachePath
from kvstore.model.paths.dense import Prepared
from kvstore.model.pipelines.batches import run_batches
from kvstore.model.plan.batch import BatchPlan, RowSet, plan_batch
from kvstore.model.press.prune import pressed_row
from kvstore.model.press.select import PressMemo, row_scores
from kvstore.model.press.spec import ScoringTokens
from kvstore.model.press.stored import StoredScores, encode_kept
from kvstore.model.stages.load import Loaded, load
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

    def __add__(self, other: Derived) -> Derived:
        return Derived(
            self.pressed + other.pressed, self.scores + other.scores, self.bytes + other.bytes,
            self.tokens + other.tokens, self.computed_contexts + other.computed_contexts, self.scoring + other.scoring,
        )  # fmt: skip


@torch.inference_mode()
def derive(
    handle: ModelHandle, store: KVStore, steps: Sequence[ContextStep], options: BuildOptions,
    path: CachePath[Prepared], writer: Writer, progress: Progress | None = None,
) -> Derived:  # fmt: skip
    """Store the pressed caches and scores ``steps`` lack (see the module docstring), preparing
    their dense caches by ``path`` (the model's, which offers presses) and the build's ``writer``."""
    if not steps:
        return Derived()
    chains = tuple(s.chain for s in steps)
    work = BatchSetup(
        store, writer if options.dense else None, Decoding(), ()
    )  # dense=False: computed chains not stored
    # what the build's plan and dense part left stored: not probed again
    known = {s.chain.key: len(s.chain.keys) if options.dense else s.depth for s in steps}
    sizes = [c.n_tokens for c in chains]
    order = sorted(range(len(chains)), key=lambda i: sizes[i])
    assert options.batch_size is not None
    todo = list(batches(order, sizes, options.batch_size, options.max_batch_tokens))
    deriving = Deriving(handle, path, work, writer, tuple(steps), RowSet(chains, ((),) * len(chains), 0), known)
    report = (lambda b: progress(0, sum(sizes[i] for i in b))) if progress else None
    parts, _ = run_batches(handle, deriving, todo, progress=report)
    return sum((got for _, got in parts), Derived())


@dataclass(frozen=True)
class Deriving:
    """A build's derived part on each batch (a :class:`~kvstore.model.pipelines.batches.BatchWork`):
    the steps' contexts planned from the depths the build found (``known``), their dense caches
    prepared by ``path``, then the scores and pressed caches each row's step lacks stored."""

    handle: ModelHandle
    path: CachePath[Prepared]
    work: BatchSetup
    writer: Writer  # the build's: writes the scores and pressed caches off the compute thread
    steps: tuple[ContextStep, ...]
    requests: RowSet
    known: Mapping[str, int]

    def plan(self, rows: list[int]) -> BatchPlan:
        return plan_batch(rows, self.requests, self.work.store, self.work.writer, known=self.known)

    def load(self, plan: BatchPlan) -> Loaded:
        return load(self.handle, plan, self.work.store, self.work.writer)

    def prepare(self, plan: BatchPlan, loaded: Loaded | None) -> Prepared:
        return self.path.prepare(self.handle, plan, self.work, loaded)

    def finish(self, plan: BatchPlan, prepared: Prepared) -> Derived:
        """The scores and pressed caches of ``plan``'s rows stored; what was stored and computed."""
        handle, store = self.handle, self.work.store
        assert store is not None
        with prepared.stack:  # no variant: no pressed entry is open
            completed = prepared.completed
            cache = completed.cache
            assert cache is not None
            scores = StoredScores(handle, store, plan.contexts, writable=True, writer=self.writer)
            memo = PressMemo(stored=scores)
            pressed = nbytes = 0
            for r, i in enumerate(plan.rows):
                step = self.steps[i]
                for scorer in step.scores:
                    scores.save(scorer, step.chain.ids, row_scores(handle, cache, scorer, r, memo), force=True)
                for press in step.presses:
                    kept = pressed_row(handle, cache, r, press, memo).kept_tensors()
                    _, blob = encode_kept(handle, step.chain, press, kept, store.codec)
                    self.writer.put_owned(blob)
                    nbytes += len(blob)
                    pressed += 1
        return Derived(
            pressed, len(scores.saved), nbytes + scores.saved_bytes, completed.computed,
            _computed(plan, completed.tokens_loaded), memo.tokens,
        )  # fmt: skip


def _computed(plan, loaded) -> int:
    """Contexts of ``plan`` whose dense cache was (partly) computed, not loaded whole."""
    return sum(1 for k in plan.distinct if loaded[k] < plan.context_of(k).n_tokens)


__all__ = ["Derived", "derive"]
