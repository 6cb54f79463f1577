"""The benchmark runner (``python -m experiments``): a run, its conversion into the result schema,
failures, and the converters of the older output shapes. Fast: fake suites, no model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `experiments` is a folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

from experiments import __main__ as runner  # noqa: E402
from experiments.runner import schema, suites  # noqa: E402

MACHINE = {"cpu": "test cpu", "cores": 2, "load_before": [0.5, 0.5, 0.5], "load_after": [0.6, 0.6, 0.6]}


def leaves(x, out: list) -> list:
    if isinstance(x, dict):
        for v in x.values():
            leaves(v, out)
    elif isinstance(x, list):
        for v in x:
            leaves(v, out)
    else:
        out.append(json.dumps(x))
    return out


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Register a suite whose script writes ``payload`` (JSON) as its raw output, then exits ``rc``."""

    def make(name: str, payload: dict | None, rc: int = 0, **kw) -> suites.Suite:
        script = tmp_path / f"{name}.py"
        script.write_text(
            "import json, os, sys\n"
            f"payload = {json.dumps(payload)!r}\n"
            "args = sys.argv[1:]\n"
            "if payload != 'null':\n"
            "    doc = json.loads(payload)\n"
            "    doc.setdefault('args', {})['argv'] = args\n"
            f"    stem = {name!r} + ('_quick' if '--quick' in args else '')\n"
            "    out = os.path.join(os.environ['KVSTORE_BENCH_RAW'], stem + '.json')\n"
            "    open(out, 'w').write(json.dumps(doc))\n"
            f"sys.exit({rc})\n"
        )
        suite = suites.Suite(name, "a fake suite", (str(script),), (name,), **kw)
        all_suites = (*suites.SUITES, suite)
        monkeypatch.setattr(suites, "SUITES", all_suites)
        monkeypatch.setattr(runner, "SUITES", all_suites)
        monkeypatch.setattr(runner, "RAW", tmp_path / "raw")
        return suite

    return make


def test_run_converts_the_scripts_output_into_the_schema(fake, tmp_path):
    rows = [{"n": 1, "seconds": 0.25}, {"n": 2, "seconds": 0.5}]
    fake("fakebench", {"machine": MACHINE, "rows": rows, "repeats": 3, "total": 7})
    out = tmp_path / "out"
    assert runner.main(["run", "fakebench", "--out", str(out), "--size", "9"]) == 0
    doc = schema.load(out / "fakebench.json")
    assert doc["suite"] == "fakebench" and doc["part"] is None and doc["version"] == schema.VERSION
    assert doc["rows"] == rows
    assert doc["params"] == {"argv": ["--size", "9"], "repeats": 3}  # the script's own options
    assert doc["notes"] == {"total": 7}
    assert doc["machine"]["cpu"] == "test cpu" and doc["machine"]["load_after"] == [0.6, 0.6, 0.6]
    assert doc["command"] == "python -m experiments run fakebench --size 9"
    assert doc["git_sha"] != "" and doc["git_sha"] == schema.git_sha()


def test_quick_runs_write_apart_from_the_results(fake, tmp_path, monkeypatch):
    fake("fakequick", {"machine": MACHINE, "rows": [{"a": 1}]})
    monkeypatch.setattr(runner, "QUICK", tmp_path / "quick")
    assert runner.main(["run", "fakequick", "--quick"]) == 0
    doc = schema.load(tmp_path / "quick" / "fakequick.json")  # from the script's fakequick_quick.json
    assert doc["params"]["argv"] == ["--quick"]
    assert not (schema.RESULTS / "fakequick.json").exists()


def test_a_failed_run_writes_nothing(fake, tmp_path, capsys):
    fake("fakefail", {"machine": MACHINE, "rows": [{"a": 1}]}, rc=3)
    assert runner.main(["run", "fakefail", "--out", str(tmp_path / "out")]) == 3
    assert not (tmp_path / "out").exists()
    assert "exited with 3; no result written" in capsys.readouterr().err


def test_a_run_without_output_is_an_error(fake, tmp_path, capsys):
    fake("fakeempty", None)
    assert runner.main(["run", "fakeempty", "--out", str(tmp_path / "out")]) == 1
    assert "wrote none of fakeempty.json" in capsys.readouterr().err


def test_a_suite_without_quick_mode_refuses_quick(fake, capsys):
    fake("fakenoquick", {"machine": MACHINE, "rows": []}, quick=None)
    assert runner.main(["run", "fakenoquick", "--quick"]) == 2
    assert "has no quick mode" in capsys.readouterr().err


def test_a_run_of_some_parts_keeps_the_other_parts_rows(fake, tmp_path):
    fake("fakeparts", {"machine": MACHINE, "rows": [{"part": "b", "x": 20}]}, merge_rows_by="part")
    out = tmp_path / "out"
    old = schema.make("fakeparts", None, "old", {}, MACHINE, [{"part": "a", "x": 1}, {"part": "b", "x": 2}], {}, "abc")
    schema.write(out / "fakeparts.json", old)
    assert runner.main(["run", "fakeparts", "--out", str(out)]) == 0
    doc = schema.load(out / "fakeparts.json")
    assert doc["rows"] == [{"part": "a", "x": 1}, {"part": "b", "x": 20}]
    assert doc["notes"]["earlier_parts"]["parts"] == ["a"] and doc["notes"]["earlier_parts"]["git_sha"] == "abc"


def test_schema_check_names_what_is_wrong():
    good = schema.make("s", None, "c", {}, {}, [], {}, "sha")
    schema.check(good)
    for key, value, message in [
        ("version", 2, "schema version"),
        ("rows", [1], "rows must be a list of objects"),
        ("machine", {"cpu": "x"}, "machine lacks"),
        ("command", "", "command must be"),
    ]:
        with pytest.raises(schema.SchemaError, match=message):
            schema.check(good | {key: value})
    with pytest.raises(schema.SchemaError, match="keys"):
        schema.check({k: v for k, v in good.items() if k != "notes"})


def test_e2e_parts_become_one_result_each_and_keep_every_value():
    raw = {
        "main": {"machine": MACHINE, "build": {"seconds": 78.2}, "sample_cached": [{"seconds": 12.8}],
                 "sample_nocache": [{"seconds": 160.9}, {"seconds": 158.6}], "speedup": 12.55},
        "sweep": {"machine": MACHINE, "rows": [{"max_new_tokens": 1, "speedup": 22.2}]},
        "loadahead": {"machine": MACHINE, "ahead": [18.39, 13.54], "sequential": [14.82, 14.47]},
    }  # fmt: skip
    out = suites.e2e("e2e", raw)
    assert sorted(out) == ["e2e_loadahead", "e2e_main", "e2e_sweep"]
    assert [r["command"] for r in out["e2e_main"]["rows"]] == ["build", "sample", "sample --no-cache"] + [
        "sample --no-cache"
    ]
    assert out["e2e_loadahead"]["notes"] == {"ahead": [18.39, 13.54], "sequential": [14.82, 14.47]}
    kept = sorted(leaves([f for f in out.values()], []))
    assert all(kept.count(v) >= n for v, n in ((v, leaves(raw, []).count(v)) for v in set(leaves(raw, []))))


PROFILE = """\
# {'cpu': 'AMD EPYC', 'cores': 2, 'load_before': [0.87, 1.55, 1.55]}
# batch 8, 10 steps each

## eager: 110.2 ms per step (profiled)

-------------------------  ------------  ------------
                     Name    Self CPU %      Self CPU
-------------------------  ------------  ------------
                 aten::mm        66.82%     627.968ms
    aten::scaled_dot_prod         0.54%       5.101ms
-------------------------  ------------  ------------
Self CPU time total: 939.849ms
"""


def test_a_profiler_printout_becomes_rows():
    out = suites.profile("profile_x", PROFILE)["profile_x"]
    assert out["machine"]["load_before"] == [0.87, 1.55, 1.55]
    assert out["rows"] == [
        {"section": "eager", "Name": "aten::mm", "Self CPU %": "66.82%", "Self CPU": "627.968ms"},
        {"section": "eager", "Name": "aten::scaled_dot_prod", "Self CPU %": "0.54%", "Self CPU": "5.101ms"},
    ]
    assert "Self CPU time total: 939.849ms" in out["notes"]["lines"]
    assert "## eager: 110.2 ms per step (profiled)" in out["notes"]["lines"]


def test_every_suite_names_an_existing_script_and_unique_outputs():
    outputs = [o for s in suites.SUITES for o in s.outputs]
    assert len(outputs) == len(set(outputs))
    for s in suites.SUITES:
        if s.script.endswith(".py"):
            assert (ROOT / s.script).exists(), s.script


def test_list_runs_from_the_repository_root():
    out = subprocess.run([sys.executable, "-m", "experiments", "list"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert {line.split()[0] for line in out.stdout.splitlines()} == {s.name for s in suites.SUITES}
