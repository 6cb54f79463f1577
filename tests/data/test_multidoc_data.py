"""experiments/data/multidoc.jsonl: the demo's questions among distractor passages (make_multidoc.py)."""

from __future__ import annotations

import importlib.util
import json
from collections import defaultdict

from helpers.paths import REPO
from kvstore.data.datasets import load_dataset
from kvstore.model.compose.spec import Passages

DATA = REPO / "experiments" / "data"


def _generator():
    spec = importlib.util.spec_from_file_location("make_multidoc", DATA / "make_multidoc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_multidoc_is_its_generators_output():
    rows = [json.loads(line) for line in (DATA / "multidoc.jsonl").read_text("utf-8").splitlines()]
    assert rows == _generator().rows(), "multidoc.jsonl is stale: run experiments/data/make_multidoc.py"


def test_each_question_has_its_gold_passage_and_each_passage_moves():
    rows = _generator().rows()
    positions: dict[str, set[int]] = defaultdict(set)
    for row in rows:
        assert len(row["context"]) == 4 and len(set(row["context"])) == 4
        gold = row["context"][row["gold"]]
        assert all(a in gold for a in row["answers"])
        for i, passage in enumerate(row["context"]):
            positions[passage].add(i)
    assert len(positions) == 22 and all(len(p) >= 3 for p in positions.values())


def test_the_context_field_loads_as_passages():
    data = load_dataset(DATA / "multidoc.jsonl", limit=3)
    for ex, row in zip(data, _generator().rows()):
        assert ex.passages == tuple(row["context"])
        assert ex.model_context == Passages(tuple(row["context"]))
        assert ex.context == Passages(ex.passages).joined()
