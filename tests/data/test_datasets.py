"""kvstore.data.datasets: the three file formats, bad rows, hub names, and the demo set's invariants."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest

from helpers.paths import FIXTURES, REPO
from kvstore.data.datasets import Dataset, Example, load_dataset
from kvstore.data.readers import Fields
from kvstore.errors import DatasetError, KVStoreError

ROOT = REPO
DATA = FIXTURES
DEMO = ROOT / "experiments" / "data" / "demo.jsonl"


def write_jsonl(path: Path, *rows: object) -> Path:
    """Rows given as dicts are dumped; strings are written as raw lines."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows), "utf-8")
    return path


def row(**fields: object) -> dict:
    base = {"context": "The Harrow Bridge was completed in 1874.", "question": "When?", "answers": ["1874"]}
    base.update(fields)
    return {key: value for key, value in base.items() if value is not ...}


def error_of(path: Path, **kwargs: object) -> str:
    with pytest.raises(DatasetError) as info:
        load_dataset(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------------------
# JSON Lines


def test_jsonl_rows_become_examples(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        row(id="a", answers="1874"),
        "",
        row(question="  Which year?  ", answers=[" 1874 ", "1874", "in 1874", ""]),
        row(id=7, context="Another context.", answers=[1874]),
    )
    dataset = load_dataset(path)
    assert isinstance(dataset, Dataset)
    assert dataset.format == "jsonl" and dataset.path == str(path) and dataset.skipped == 0
    assert dataset.examples == (
        Example("a", "The Harrow Bridge was completed in 1874.", "When?", ("1874",)),
        Example("qa-3", "The Harrow Bridge was completed in 1874.", "Which year?", ("1874", "in 1874")),
        Example("7", "Another context.", "When?", ("1874",)),
    )
    assert dataset.contexts() == ["The Harrow Bridge was completed in 1874.", "Another context."]
    assert len(dataset) == 3 and list(dataset) == list(dataset.examples)


def test_context_is_kept_byte_for_byte(tmp_path: Path) -> None:
    context = "  Leading spaces,\ttabs and a trailing newline.\n"
    dataset = load_dataset(write_jsonl(tmp_path / "qa.jsonl", row(context=context)))
    assert dataset.examples[0].context == context


def test_custom_field_names_and_limit(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        *({"doc": f"Document {i}.", "q": f"Question {i}?", "gold": str(i), "key": f"k{i}"} for i in range(5)),
    )
    dataset = load_dataset(path, Fields("doc", "q", "gold", "key"), limit=2)
    assert [example.id for example in dataset] == ["k0", "k1"]
    assert dataset.examples[1] == Example("k1", "Document 1.", "Question 1?", ("1",))


def test_build_mode_needs_only_a_context(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", {"context": "Only a context."}, row(question=""))
    with pytest.raises(DatasetError):
        load_dataset(path)
    dataset = load_dataset(path, require_question=False)
    assert [(e.id, e.question, e.answers) for e in dataset] == [("docs-1", None, ()), ("docs-2", None, ("1874",))]


def test_format_override_and_unknown_extension(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.txt", row())
    assert "--format" in error_of(path)
    assert load_dataset(path, format="jsonl").examples[0].answers == ("1874",)
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_dataset(path, format="parquet")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"context": "x", "question": "q", ', "not valid JSON (Expecting property name"),
        ('["a list"]', "expected a JSON object, got a list"),
        (
            json.dumps(row(question=...)),
            "missing field 'question' (fields: context, answers); "
            "name another field with --question-field, or pass --skip-bad-rows",
        ),
        (json.dumps(row(context=None)), "missing field 'context'"),
        (json.dumps(row(context=" \n ")), "empty context"),
        (json.dumps(row(context=12)), "field 'context' must be a string or a list of strings, got a number"),
        (json.dumps(row(question=["q"])), "field 'question' must be a string, got a list"),
        (json.dumps(row(answers={"x": 1})), "field 'answers' must be a string or a list of strings, got an object"),
        (
            json.dumps(row(answers=["a", None])),
            "field 'answers' must be a string or a list of strings, got null in the list",
        ),
        (json.dumps(row(answers=...)), "missing field 'answers'"),
        (json.dumps(row(id=1.5)), "field 'id' must be a string or an integer, got a number"),
        (json.dumps(row(id="first")), "duplicate id 'first' (first at "),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path: Path, line: str, expected: str) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", row(id="first"), line, row(id="third"))
    message = error_of(path)
    assert message.startswith(f"{path}:2: {expected}")
    assert message.endswith(", or pass --skip-bad-rows")

    dataset = load_dataset(path, skip_bad_rows=True)
    assert [example.id for example in dataset] == ["first", "third"]
    assert dataset.skipped == 1 and len(dataset.problems) == 1
    assert dataset.problems[0].startswith(f"{path}:2: ") and "--skip-bad-rows" not in dataset.problems[0]


def test_skipping_counts_every_bad_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", "{oops", row(id="ok"), row(context=""), "[1]")
    dataset = load_dataset(path, skip_bad_rows=True)
    assert [e.id for e in dataset] == ["ok"]
    assert dataset.skipped == 3
    assert [p.split(": ", 1)[0] for p in dataset.problems] == [f"{path}:{n}" for n in (1, 3, 4)]


def test_generated_ids_do_not_move_when_rows_are_skipped(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", row(), "{oops", row(context="Second."))
    assert [e.id for e in load_dataset(path, skip_bad_rows=True)] == ["qa-1", "qa-3"]


def test_non_utf8_line_is_a_bad_row_and_bom_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(row(id="a")).encode() + b"\n" + b'{"context": "\xff"}\n')
    assert "qa.jsonl:2: not UTF-8 text" in error_of(path)
    assert [e.id for e in load_dataset(path, skip_bad_rows=True)] == ["a"]


def test_empty_or_all_bad_files_raise(tmp_path: Path) -> None:
    assert "the file is empty" in error_of(write_jsonl(tmp_path / "empty.jsonl", "", "  "))
    many = {f"f{i}": i for i in range(12)}
    assert "(fields: f0, f1, f2, f3, f4, f5, f6, f7, ...);" in error_of(write_jsonl(tmp_path / "wide.jsonl", many))
    message = error_of(write_jsonl(tmp_path / "bad.jsonl", "{", "{"), skip_bad_rows=True)
    assert "no usable rows (2 skipped; the first: " in message and "bad.jsonl:1: not valid JSON" in message


def test_limit_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="limit"):
        load_dataset(write_jsonl(tmp_path / "qa.jsonl", row()), limit=0)


# --------------------------------------------------------------------------------------------
# Missing, unreadable and hub paths


def test_missing_file_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the optional package were absent
    missing = tmp_path / "nope.jsonl"
    assert error_of(missing) == f"{missing}: no such file; check the path"
    assert "is a directory" in error_of(tmp_path)
    monkeypatch.chdir(tmp_path)
    message = error_of(Path("squad_v9"))
    assert message.startswith("squad_v9: no such file;") and "pip install 'kvstore[hub]'" in message
    assert "hub:squad_v9" in message


def test_hub_name_without_the_datasets_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetError, match=r"^hub:squad: hub datasets need the optional 'datasets' package"):
        load_dataset("hub:squad")


def test_error_is_a_kvstore_and_value_error(tmp_path: Path) -> None:
    with pytest.raises(KVStoreError):
        load_dataset(tmp_path / "nope.csv")
    with pytest.raises(ValueError):
        load_dataset(tmp_path / "nope.csv")


def _fake_datasets(rows: list[dict] | Exception) -> types.ModuleType:
    module = types.ModuleType("datasets")
    module.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    calls: list[tuple[str, str]] = []

    def get_dataset_split_names(name: str) -> list[str]:
        return ["train", "validation"]

    def load(name: str, split: str) -> list[dict]:
        calls.append((name, split))
        if isinstance(rows, Exception):
            raise rows
        return rows

    module.get_dataset_split_names = get_dataset_split_names
    module.load_dataset = load
    module.calls = calls
    return module


def test_hub_dataset_through_the_optional_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub_rows = [
        {
            "id": "5733",
            "title": "T",
            "context": "Built in 1874.",
            "question": "When?",
            "answers": {"text": ["1874", "1874"], "answer_start": [9, 9]},
        },
        {"title": "T", "context": "Built in 1874.", "question": "Where?", "answers": {"text": [], "answer_start": []}},
    ]
    fake = _fake_datasets(hub_rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    dataset = load_dataset("hub:org/squad")
    assert dataset.format == "hub" and fake.calls == [("org/squad", "validation")]
    assert dataset.examples == (
        Example("5733", "Built in 1874.", "When?", ("1874",)),
        Example("org-squad-validation-1", "Built in 1874.", "Where?", ()),
    )
    assert load_dataset("hub:org/squad:train").examples[0].id == "5733" and fake.calls[-1] == ("org/squad", "train")
    monkeypatch.chdir(tmp_path)  # a bare name that is not a file goes to the hub too
    assert len(load_dataset("squad")) == 2


def test_hub_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(ConnectionError("offline\nmore detail")))
    with pytest.raises(
        DatasetError, match=r"^hub:squad: loading it from the Hugging Face hub failed \(ConnectionError: offline\)"
    ):
        load_dataset("hub:squad")
    monkeypatch.chdir(tmp_path)
    assert error_of(Path("squad")).startswith("squad: no such file, and loading it from the Hugging Face hub failed")


# --------------------------------------------------------------------------------------------
# CSV


def test_csv_file() -> None:
    dataset = load_dataset(DATA / "qa.csv")
    assert dataset.format == "csv"
    assert [(e.id, e.answers) for e in dataset] == [
        ("c1", ("1874",)),
        ("qa-3", ("River Leddon", "the River Leddon")),  # no id: line 3; a JSON list cell is several answers
        ("c3", ("two lines",)),
        ("c4", ("[citation needed]",)),  # bracketed but not JSON: one answer
    ]
    assert dataset.examples[2].context == "A context that spans\ntwo lines, with a comma."
    assert len(dataset.contexts()) == 3


def test_csv_line_numbers_count_multiline_cells(tmp_path: Path) -> None:
    path = tmp_path / "qa.csv"
    path.write_text('context,question,answers\n"two\nlines",q,a\n,q,a\n\nx,q\n', "utf-8")
    assert "qa.csv:4: empty context" in error_of(path)
    dataset = load_dataset(path, skip_bad_rows=True)
    assert [p.split(": ", 1)[1] for p in dataset.problems] == [
        "empty context in field 'context'",
        "2 cells where the header has 3",
    ]
    assert dataset.problems[1].startswith(f"{path}:6: ")
    assert dataset.examples[0].id == "qa-2"


def test_csv_header_must_name_the_columns(tmp_path: Path) -> None:
    path = tmp_path / "qa.csv"
    path.write_text("\ufeffdoc, q ,answers\nA context.,A question?,a\n", "utf-8")
    message = error_of(path, skip_bad_rows=True)  # a header problem is not a bad row
    assert message == (
        f"{path}:1: no column 'context' in the header (columns: doc, q, answers); name another column with "
        "--context-field"
    )
    assert load_dataset(path, Fields("doc", "q")).examples[0].question == "A question?"
    assert load_dataset(path, Fields("doc", "missing"), require_question=False)
    path.write_text("context,context\nx,y\n", "utf-8")
    assert "appears twice" in error_of(path)


# --------------------------------------------------------------------------------------------
# SQuAD-style and list JSON


def test_squad_file() -> None:
    dataset = load_dataset(DATA / "squad.json")
    assert dataset.format == "json"
    assert [(e.id, e.answers) for e in dataset] == [
        ("hb-year", ("1874", "in 1874")),
        ("hb-designer", ("Matilda Crane",)),
        ("ld-depth", ("87 metres",)),
        ("ld-impossible", ()),
    ]
    assert len(dataset.contexts()) == 2
    # Building wants every context, including paragraphs that have no questions yet.
    contexts = load_dataset(DATA / "squad.json", require_question=False).contexts()
    assert contexts[-1] == "Vessary is an island whose capital is Port Anselm."


def test_squad_bad_rows_have_a_json_path(tmp_path: Path) -> None:
    squad = json.loads((DATA / "squad.json").read_text("utf-8"))
    del squad["data"][0]["paragraphs"][1]["qas"][0]["question"]
    squad["data"][1]["paragraphs"] = "not a list"
    path = tmp_path / "train.json"
    path.write_text(json.dumps(squad), "utf-8")
    assert error_of(path).startswith(f"{path}:data[0].paragraphs[1].qas[0]: missing field 'question'")
    dataset = load_dataset(path, skip_bad_rows=True, require_question=False)
    assert dataset.problems == (f"{path}:data[1]: expected an object with a 'paragraphs' list",)
    assert dataset.examples[2].id == "ld-depth" and dataset.examples[2].question is None


def test_json_list_of_rows_and_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([row(), "nope", row(id="x")]), "utf-8")
    assert error_of(path).startswith(f"{path}:[1]: expected a JSON object, got a string")
    assert [e.id for e in load_dataset(path, skip_bad_rows=True)] == ["rows-0", "x"]
    path.write_text(json.dumps(row()) + "\n" + json.dumps(row()) + "\n", "utf-8")
    assert (
        error_of(path)
        == f"{path}:2: not valid JSON (Extra data at column 1); for one object per line, name the file .jsonl or "
        "pass --format jsonl"
    )
    path.write_text('{"version": 1}', "utf-8")
    assert "expected SQuAD-style JSON" in error_of(path)


def test_library_modules_import_nothing_heavy() -> None:
    code = (
        "import sys, kvstore.data.datasets, kvstore.data.metrics, kvstore.data.prompts\n"
        "print(sorted(m for m in ('click', 'tqdm', 'matplotlib', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# The demo set


@pytest.fixture(scope="module")
def demo() -> Dataset:
    return load_dataset(DEMO)


def test_demo_shape(demo: Dataset) -> None:
    assert demo.skipped == 0
    per_context: dict[str, list[Example]] = {}
    for example in demo:
        per_context.setdefault(example.context, []).append(example)
    assert len(per_context) >= 20
    for context, examples in per_context.items():
        assert len(examples) >= 3, examples[0].id
        assert len({e.question for e in examples}) == len(examples), examples[0].id
        for example in examples:
            assert example.answers, example.id
            for answer in example.answers:
                assert answer in context, (example.id, answer)
                assert 1 <= len(answer.split()) <= 4, (example.id, answer)


def test_demo_matches_its_generator(demo: Dataset) -> None:
    spec = importlib.util.spec_from_file_location("make_demo", DEMO.parent / "make_demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = [Example(r["id"], r["context"], r["question"], tuple(r["answers"])) for r in module.rows()]
    assert list(demo) == expected, "demo.jsonl is stale: run experiments/data/make_demo.py"


def test_demo_context_lengths(demo: Dataset, smollm2_tokenizer) -> None:  # noqa: ANN001
    lengths = [len(smollm2_tokenizer(c, add_special_tokens=False).input_ids) for c in demo.contexts()]
    assert 300 <= min(lengths) and max(lengths) <= 2000, (min(lengths), max(lengths))
    assert statistics.median(lengths) <= 600  # keeps `make demo` quick on a CPU
