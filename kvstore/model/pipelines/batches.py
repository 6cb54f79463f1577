"""The one batch loop of sampling, scoring and a build's pressed caches and scores.

A pipeline hands :func:`run_batches` its batches (lists of row indices, in the order they run)
and the per-batch work (:class:`BatchWork`: plan a batch, load a plan, prepare it, finish it); the
runner owns the rest:

* **planning**: each batch is planned once, when it starts, or ahead when its load runs ahead;
* **loading ahead**: once a batch is prepared (its new chunks handed to the writer, so the next
  plan sees and waits for them instead of computing them again), the next batch is planned and its
  load submitted to a worker while this batch answers or scores; the time spent waiting for such a
  load is the accelerator's idle time between batches (:attr:`BatchRunner.waited`);
* **out-of-memory halving**: a batch that runs out of memory runs again as its two halves' plans
  (:func:`kvstore.model.compute.forward.in_halves`; results do not depend on the batch), and the load
  done ahead for it is dropped first, so the retry has its memory back;
* the state between batches: the load held for the running batch and the one pending for the next,
  fields of the runner.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from kvstore.model.compute.forward import in_halves, loaded_ahead
from kvstore.model.plan.batch import BatchPlan
from kvstore.model.stages.load import Loaded

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

PreparedT = TypeVar("PreparedT")
ResultT = TypeVar("ResultT")
ResultT_co = TypeVar("ResultT_co", covariant=True)


class BatchWork(Protocol[PreparedT, ResultT_co]):
    """What one pipeline does with a batch; the runner calls these in order for each batch:
    ``plan`` (its rows), ``load`` (on the loader thread, when the batch is loaded ahead),
    ``prepare`` (the plan and what was loaded ahead, or None: load what is left, complete, hand new
    chunks to the writer), then ``finish`` (answer, score or store under every variant)."""

    def plan(self, rows: list[int]) -> BatchPlan: ...
    def load(self, plan: BatchPlan) -> Loaded: ...
    def prepare(self, plan: BatchPlan, loaded: Loaded | None) -> PreparedT: ...
    def finish(self, plan: BatchPlan, prepared: PreparedT) -> ResultT_co: ...


class BatchRunner(Generic[PreparedT, ResultT]):
    """Runs ``work``'s batches (see the module docstring): ``ahead``: load each next batch on a
    worker thread while this one finishes; ``upcoming``: told each next batch's rows before this
    one runs (a remote store prefetches their chunks)."""

    def __init__(
        self, handle: ModelHandle, work: BatchWork[PreparedT, ResultT], *, ahead: bool = False,
        upcoming: Callable[[list[int]], None] | None = None,
    ) -> None:  # fmt: skip
        self.handle, self.work, self.upcoming = handle, work, upcoming
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load") if ahead else None
        self.held: Loaded | None = None  # the running batch's load done ahead: dropped on first use
        self.following: list[int] | None = None  # the next batch's rows, until its load is submitted
        self.pending: tuple[BatchPlan, Future[Loaded]] | None = None  # the next batch, planned and loading
        self.waited = 0.0  # seconds spent waiting for loads done ahead

    def run(
        self, todo: Sequence[list[int]], progress: Callable[[list[int]], None] | None = None
    ) -> list[tuple[BatchPlan, ResultT]]:
        """Every batch of ``todo`` run; per batch part (a whole batch, or the halves an
        out-of-memory error split it into), its plan and result, in the order they ran.
        ``progress(rows)`` after each batch. The loader is shut down on the way out."""
        parts: list[tuple[BatchPlan, ResultT]] = []
        try:
            for b, batch in enumerate(todo):
                plan = self._start(batch)
                nxt = todo[b + 1] if b + 1 < len(todo) else None
                if nxt is not None and self.upcoming is not None:
                    self.upcoming(nxt)
                self.following = nxt if self.loader is not None else None
                parts += in_halves(functools.partial(self._part, plan), list(range(len(plan.rows))), self.handle)
                self._submit()
                if progress is not None:
                    progress(batch)
        finally:
            self.held = self.pending = None
            if self.loader is not None:
                self.loader.shutdown(wait=True, cancel_futures=True)
        return parts

    def _start(self, batch: list[int]) -> BatchPlan:
        """This batch's plan: the one it was loaded ahead with (its load then held), else made now
        (a context split over batches waits for the writer)."""
        if self.pending is None:
            self.held = None
            return self.work.plan(batch)
        (plan, future), self.pending = self.pending, None
        t0 = time.perf_counter()
        self.held = loaded_ahead(future)
        self.waited += time.perf_counter() - t0
        return plan

    def _part(self, plan: BatchPlan, positions: list[int]) -> list[tuple[BatchPlan, ResultT]]:
        """``positions`` of ``plan`` prepared, the next batch's load submitted, then finished."""
        part = plan if len(positions) == len(plan.rows) else plan.part(positions)
        loaded, self.held = (self.held if part is plan else None), None  # an out-of-memory retry frees it
        prepared = self.work.prepare(part, loaded)
        del loaded
        self._submit()  # once this batch's new chunks are with the writer
        return [(part, self.work.finish(part, prepared))]

    def _submit(self) -> None:
        """The next batch planned and its load submitted, once."""
        if self.following is None or self.loader is None:
            return
        plan = self.work.plan(self.following)
        self.following = None
        self.pending = (plan, self.loader.submit(self.work.load, plan))


def run_batches(
    handle: ModelHandle, work: BatchWork[PreparedT, ResultT], todo: Sequence[list[int]], *, ahead: bool = False,
    upcoming: Callable[[list[int]], None] | None = None, progress: Callable[[list[int]], None] | None = None,
) -> tuple[list[tuple[BatchPlan, ResultT]], float]:  # fmt: skip
    """``todo``'s batches through ``work`` (see :class:`BatchRunner`): the parts run, with their
    plans and results, and the seconds spent waiting for loads done ahead."""
    runner = BatchRunner(handle, work, ahead=ahead and len(todo) > 1, upcoming=upcoming)
    parts = runner.run(todo, progress)
    return parts, runner.waited


__all__ = ["BatchRunner", "BatchWork", "run_batches"]
