"""The one batch loop (kvstore/model/pipelines/batches.py) run by a toy pipeline written here:
each batch planned once, the next one's load submitted once this one is prepared and run on the
loader thread, an out-of-memory batch run again as its halves with the load done ahead dropped."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvstore.model.pipelines.batches import BatchRunner, run_batches


@dataclass(frozen=True)
class ToyPlan:
    rows: tuple[int, ...]

    def part(self, positions):
        return ToyPlan(tuple(self.rows[i] for i in positions))


@dataclass
class Toy:
    """Per batch: plan, load (squares of the rows), prepare, finish (the rows' loaded squares).
    A prepared part of more than ``fits`` rows runs out of memory."""

    fits: int = 99
    events: list = field(default_factory=list)
    load_threads: set = field(default_factory=set)

    def plan(self, rows):
        self.events.append(("plan", tuple(rows)))
        return ToyPlan(tuple(rows))

    def load(self, plan):
        self.load_threads.add(threading.current_thread().name)
        self.events.append(("load", plan.rows))
        return {r: r * r for r in plan.rows}

    def prepare(self, plan, loaded):
        self.events.append(("prepare", plan.rows, loaded is not None))
        if len(plan.rows) > self.fits:
            raise torch.OutOfMemoryError("toy: out of memory")
        return loaded if loaded is not None else {r: r * r for r in plan.rows}

    def finish(self, plan, prepared):
        self.events.append(("finish", plan.rows))
        return [prepared[r] for r in plan.rows]


HANDLE = SimpleNamespace(device=torch.device("cpu"))


def _results(done):
    return {r: v for plan, got in done for r, v in zip(plan.rows, got)}


def test_a_toy_pipeline_loads_ahead_through_the_runner():
    toy = Toy()
    todo = [[0, 1], [2, 3], [4]]
    seen = []
    done, waited = run_batches(HANDLE, toy, todo, ahead=True, upcoming=seen.append)
    assert _results(done) == {r: r * r for r in range(5)} and waited >= 0
    assert seen == [[2, 3], [4]]  # told of each next batch before this one runs
    assert [e[0] for e in toy.events if e[0] == "plan"] == ["plan"] * 3  # each batch planned once
    assert toy.load_threads == {"kvstore-load_0"}  # the next batches' loads ran on the loader
    # batch 2 is planned and its load submitted after batch 1 is prepared, before it finishes
    order = [e[:2] for e in toy.events if e[0] in ("plan", "prepare", "finish")]
    assert order[:4] == [("plan", (0, 1)), ("prepare", (0, 1)), ("plan", (2, 3)), ("finish", (0, 1))]
    assert ("prepare", (2, 3), True) in toy.events and ("prepare", (4,), True) in toy.events


def test_an_out_of_memory_batch_runs_as_its_halves_and_drops_its_load_ahead():
    toy = Toy(fits=1)
    runner = BatchRunner(HANDLE, toy, ahead=True)
    done = runner.run([[0], [1, 2, 3, 4]])
    assert _results(done) == {r: r * r for r in range(5)}
    assert [p.rows for p, _ in done] == [(0,), (1,), (2,), (3,), (4,)]  # halved down to rows that fit
    prepares = [e for e in toy.events if e[0] == "prepare"]
    assert prepares[1] == ("prepare", (1, 2, 3, 4), True)  # the whole batch got its load done ahead
    assert all(not got for _, rows, got in prepares[2:])  # its halves load themselves: the load was dropped
    assert runner.held is None and runner.pending is None


def test_without_loading_ahead_every_batch_is_planned_and_loaded_in_turn():
    toy = Toy()
    done, waited = run_batches(HANDLE, toy, [[0], [1]], ahead=False)
    assert _results(done) == {0: 0, 1: 1} and waited == 0.0
    assert not toy.load_threads and all(not e[2] for e in toy.events if e[0] == "prepare")


def test_an_error_that_is_not_out_of_memory_stops_the_loop():
    class Broken(Toy):
        def finish(self, plan, prepared):
            raise ValueError("toy: broken")

    runner = BatchRunner(HANDLE, Broken(), ahead=True)
    with pytest.raises(ValueError, match="broken"):
        runner.run([[0, 1], [2]])
    assert runner.loader is not None and runner.loader._shutdown  # the loader was shut down
