"""The benchmark runner (``python -m experiments``): a script writing its results through
benchlib, a run committing them as they are, failures, and adopting files in the older layouts.
Fast: fake suites whose scripts import benchlib (no torch), no model."""

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
from experiments import benchlib  # noqa: E402
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
    """Register a suite whose script writes ``payload`` (``rows`` and ``notes``) with
    ``benchlib.write_result``, its arguments as params, then exits ``rc``; ``payload=None``: writes
    nothing; ``own_shape=True``: writes the payload as JSON itself, as scripts did before."""

    def make(name: str, payload: dict | None, rc: int = 0, own_shape: bool = False, **kw) -> suites.Suite:
        script = tmp_path / f"{name}.py"
        if own_shape:
            write = f"open(os.environ['KVSTORE_BENCH_RAW'] + '/{name}.json', 'w').write(json.dumps(payload))"
        else:
            write = f"bl.write_result('{name}', params={{'argv': sys.argv[1:]}}, **payload)"
        script.write_text(
            "import json, os, sys\n"
            f"sys.path.insert(0, {str(ROOT / 'experiments')!r})\n"
            "import benchlib as bl\n"
            f"payload = json.loads({json.dumps(payload)!r})\n"
            "if payload is not None:\n"
            f"    {write}\n"
            f"sys.exit({rc})\n"
        )
        suite = suites.Suite(name, "a fake suite", (str(script),), (name,), **kw)
        all_suites = (*suites.SUITES, suite)
        monkeypatch.setattr(suites, "SUITES", all_suites)
        monkeypatch.setattr(runner, "SUITES", all_suites)
        monkeypatch.setattr(runner, "RAW", tmp_path / "raw")
        return suite

    return make


def test_a_run_commits_what_the_script_wrote_through_benchlib(fake, tmp_path):
    rows = [{"n": 1, "seconds": 0.25}, {"n": 2, "seconds": 0.5}]
    fake("fakebench", {"rows": rows, "notes": {"total": 7}})
    out = tmp_path / "out"
    assert runner.main(["run", "fakebench", "--out", str(out), "--size", "9"]) == 0
    doc = schema.load(out / "fakebench.json")
    assert doc == json.loads((tmp_path / "raw" / "fakebench" / "fakebench.json").read_text())  # as written
    assert doc["suite"] == "fakebench" and doc["part"] is None and doc["version"] == schema.VERSION
    assert doc["rows"] == rows and doc["params"] == {"argv": ["--size", "9"]} and doc["notes"] == {"total": 7}
    assert doc["command"] == "python -m experiments run fakebench --size 9"  # the runner's, through benchlib
    assert doc["git_sha"] == schema.git_sha()
    machine = doc["machine"]  # recorded by benchlib, not by the script
    assert machine["cores"] and machine["python"] and len(machine["load_before"]) == len(machine["load_after"]) == 3
    assert "torch_threads" not in machine  # the script never imported torch


def test_quick_runs_write_apart_from_the_results(fake, tmp_path, monkeypatch):
    fake("fakequick", {"rows": [{"a": 1}]})
    monkeypatch.setattr(runner, "QUICK", tmp_path / "quick")
    assert runner.main(["run", "fakequick", "--quick"]) == 0
    doc = schema.load(tmp_path / "quick" / "fakequick.json")
    assert doc["params"]["argv"] == ["--quick"]
    assert not (schema.RESULTS / "fakequick.json").exists()


def test_a_failed_run_writes_nothing(fake, tmp_path, capsys):
    fake("fakefail", {"rows": [{"a": 1}]}, rc=3)
    assert runner.main(["run", "fakefail", "--out", str(tmp_path / "out")]) == 3
    assert not (tmp_path / "out").exists()
    assert "exited with 3; no result written" in capsys.readouterr().err


def test_a_run_without_output_is_an_error(fake, tmp_path, capsys):
    fake("fakeempty", None)
    assert runner.main(["run", "fakeempty", "--out", str(tmp_path / "out")]) == 1
    assert "wrote none of fakeempty.json" in capsys.readouterr().err


def test_a_script_writing_its_own_shape_is_refused(fake, tmp_path, capsys):
    fake("fakeown", {"machine": MACHINE, "rows": [{"a": 1}]}, own_shape=True)
    assert runner.main(["run", "fakeown", "--out", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()
    assert "keys ['machine', 'rows']" in capsys.readouterr().err


def test_a_suite_without_quick_mode_refuses_quick(fake, capsys):
    fake("fakenoquick", {"rows": []}, quick=None)
    assert runner.main(["run", "fakenoquick", "--quick"]) == 2
    assert "has no quick mode" in capsys.readouterr().err


def test_a_run_of_some_parts_keeps_the_other_parts_rows(fake, tmp_path):
    fake("fakeparts", {"rows": [{"part": "b", "x": 20}]}, merge_rows_by="part")
    out = tmp_path / "out"
    old = schema.make("fakeparts", None, "old", {}, MACHINE, [{"part": "a", "x": 1}, {"part": "b", "x": 2}], {}, "abc")
    schema.write(out / "fakeparts.json", old)
    assert runner.main(["run", "fakeparts", "--out", str(out)]) == 0
    doc = schema.load(out / "fakeparts.json")
    assert doc["rows"] == [{"part": "a", "x": 1}, {"part": "b", "x": 20}]
    assert doc["notes"]["earlier_parts"]["parts"] == ["a"] and doc["notes"]["earlier_parts"]["git_sha"] == "abc"


def test_a_full_run_puts_the_suites_images_in_docs_img(tmp_path, monkeypatch):
    """Plots the docs show (``Suite.images``): a full run copies them to docs/img/, a smoke run
    leaves them beside its results."""
    script = tmp_path / "fakeimg.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'experiments')!r})\n"
        "import benchlib as bl\n"
        "bl.write_result('fakeimg', params={}, rows=[{'a': 1}])\n"
        "open(os.path.join(os.environ['KVSTORE_BENCH_RAW'], 'fakeimg.png'), 'wb').write(b'png')\n"
    )
    suite = suites.Suite("fakeimg", "a fake suite", (str(script),), ("fakeimg",), quick=(), images=("fakeimg.png",))
    monkeypatch.setattr(runner, "SUITES", (*suites.SUITES, suite))
    monkeypatch.setattr(suites, "SUITES", (*suites.SUITES, suite))
    for name, where in (("RAW", "raw"), ("QUICK", "quick"), ("IMAGES", "img")):
        monkeypatch.setattr(runner, name, tmp_path / where)
    monkeypatch.setattr(schema, "RESULTS", tmp_path / "results")
    assert runner.main(["run", "fakeimg", "--quick"]) == 0
    assert (tmp_path / "quick" / "fakeimg.png").read_bytes() == b"png" and not (tmp_path / "img").exists()
    assert runner.main(["run", "fakeimg"]) == 0
    assert (tmp_path / "img" / "fakeimg.png").read_bytes() == b"png"
    assert (tmp_path / "results" / "fakeimg.json").exists() and not (tmp_path / "results" / "fakeimg.png").exists()


def test_write_result_names_the_suite_and_part_of_its_output(tmp_path, monkeypatch):
    monkeypatch.setattr(benchlib, "RESULTS", tmp_path)
    monkeypatch.setenv("KVSTORE_BENCH_COMMAND", "python -m experiments run quant_ecq --dtypes bfloat16")
    doc = schema.load(benchlib.write_result("quant_ecq_bf16", params={"dtypes": "bfloat16"}, rows=[{"size": 0.3}]))
    assert (doc["suite"], doc["part"], doc["command"]) == ("quant_ecq", "bf16", "python -m experiments run "
                                                           "quant_ecq --dtypes bfloat16")  # fmt: skip
    assert (doc["params"], doc["rows"], doc["notes"]) == ({"dtypes": "bfloat16"}, [{"size": 0.3}], {})
    assert schema.load(benchlib.write_result("quant_ecq", params={}, rows=[]))["part"] == ""  # named like the suite
    assert schema.load(benchlib.write_result("ttft", params={}, rows=[]))["part"] is None  # a suite of one output
    monkeypatch.delenv("KVSTORE_BENCH_COMMAND")
    doc = schema.load(benchlib.write_result("mine", params={}, rows=[], machine={"server": "x"}))
    assert (doc["suite"], doc["part"], doc["machine"]["server"]) == ("mine", None, "x")  # no suite lists it
    assert doc["command"].startswith("python ")  # this process's command line
    with pytest.raises(schema.SchemaError, match="rows must be a list of objects"):
        benchlib.write_result("ttft", params={}, rows=[1])  # type: ignore[list-item]


def test_adopt_converts_a_file_in_the_old_layout(tmp_path):
    old = tmp_path / "throughput_quick.json"
    rows = [{"codec": "raw", "mb_per_s": 3309.1}]
    old.write_text(json.dumps({"machine": {**MACHINE, "cpus": 2}, "repeats": 7, "rows": rows}))
    soak = tmp_path / "results.json"  # the soak's own file name: a suite of one output names the result
    soak.write_text(json.dumps({"machine": {"loadavg_at_start": [1.0, 1.0, 1.0]}, "seed": 5, "kill": {"lost": 0}}))
    out = tmp_path / "out"
    assert runner.main(["adopt", "throughput", str(old), "--out", str(out)]) == 0
    assert runner.main(["adopt", "reliability", str(soak), "--out", str(out)]) == 0
    doc = schema.load(out / "throughput.json")
    assert (doc["suite"], doc["part"], doc["rows"], doc["params"]) == ("throughput", None, rows, {"repeats": 7})
    assert doc["machine"]["cpu"] == "test cpu" and doc["command"] == "python experiments/bench_throughput.py"
    assert doc["notes"]["converted_from"].startswith(old.as_posix() + " at ")
    doc = schema.load(out / "reliability.json")
    assert doc["params"] == {"seed": 5} and doc["notes"]["kill"] == {"lost": 0}
    assert doc["machine"]["load_before"] == [1.0, 1.0, 1.0]  # the old machine spelling, renamed


def test_adopt_copies_a_result_and_refuses_another_suites(tmp_path, capsys):
    result = schema.make("ttft", None, "python experiments/bench_ttft.py", {}, MACHINE, [{"a": 1}], {}, "abc")
    schema.write(tmp_path / "ttft.json", result)
    assert runner.main(["adopt", "ttft", str(tmp_path / "ttft.json"), "--out", str(tmp_path / "out")]) == 0
    assert schema.load(tmp_path / "out" / "ttft.json") == result
    assert runner.main(["adopt", "codecs", str(tmp_path / "ttft.json"), "--out", str(tmp_path / "other")]) == 1
    assert "not an output of the suite codecs" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_every_adopted_result_comes_again_from_its_old_file(tmp_path):
    """The converters kept for adopting are the ones the committed results need: each result
    converted from an older file (``notes.converted_from``) is what adopting that file, as git
    holds it, gives now (its measurements, params, machine and notes; the commit and command are
    where adoption found them)."""
    adopted = [(p, schema.load(p)) for p in sorted(schema.RESULTS.glob("*.json"))]
    adopted = [(p, d) for p, d in adopted if "converted_from" in d["notes"]]
    assert len(adopted) > 30
    for path, doc in adopted:
        source, sha = doc["notes"]["converted_from"].split(" at ")
        shown = subprocess.run(["git", "show", f"{sha}:{source}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode != 0:
            pytest.skip(f"commit {sha} is not in this clone (shallow?)")
        old = tmp_path / "old" / sha / Path(source).name
        old.parent.mkdir(parents=True, exist_ok=True)
        old.write_text(shown.stdout)
        assert runner.main(["adopt", doc["suite"], str(old), "--out", str(tmp_path / "new")]) == 0
        again = schema.load(tmp_path / "new" / path.name)
        for d in (doc, again):
            d["notes"].pop("converted_from")
        keep = ("suite", "part", "params", "machine", "rows", "notes")
        assert {k: again[k] for k in keep} == {k: doc[k] for k in keep}, path.name


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


def test_adopting_the_old_e2e_file_gives_one_result_per_part_and_keeps_every_value():
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


# scripts allowed their own preamble: none (the kvpress comparison starts through benchlib too)
OWN_PREAMBLE: set[str] = set()


def test_every_benchmark_takes_the_shared_run_options_and_times_through_benchlib():
    """No script keeps its own copy of the preamble (argparse set-up, --threads/--wait/--quick, torch
    threads, waiting for a quiet machine) or its own clock: ``bl.parser``/``bl.start`` and
    ``bl.timed`` (``repeat`` is built on it) are the one place."""
    import ast

    scripts = sorted({s.script for s in suites.SUITES if s.script.endswith(".py")} - OWN_PREAMBLE)
    assert len(scripts) > 25
    found = []
    for script in scripts:
        tree = ast.parse((ROOT / script).read_text())
        called = {
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
        }
        if not {"parser", "start"} <= called:
            found.append(f"{script}: does not start through benchlib.parser/start")
        for node in ast.walk(tree):
            dotted = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
            if dotted in ("argparse.ArgumentParser", "time.perf_counter", "time.monotonic", "bl.setup"):
                found.append(f"{script}:{node.lineno}: {dotted}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("add_argument"):
                flag = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                if flag in ("--threads", "--wait", "--quick"):
                    found.append(f"{script}:{node.lineno}: its own {flag}")
    assert not found, "\n".join(found)


def test_start_applies_quick_settings_and_keeps_unknown_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(benchlib, "setup", lambda threads: calls.append(("setup", threads)))
    monkeypatch.setattr(benchlib, "wait_for_quiet", lambda max_wait_s: calls.append(("wait", max_wait_s)))
    ap = benchlib.parser("doc", batch_size=4)
    ap.add_argument("--tokens", type=int, default=2048)
    monkeypatch.setattr(sys, "argv", ["x", "--quick", "--threads", "3", "--wait", "9"])
    args = benchlib.start(ap, quick={"tokens": 256})
    assert (args.tokens, args.batch_size, args.quick) == (256, 4, True)
    assert calls == [("setup", 3), ("wait", 9.0)]
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["x", "--soak-option", "1"])
    args = benchlib.start(benchlib.parser("doc", quick=False), wait=False, rest=True)
    assert args.rest == ["--soak-option", "1"] and not hasattr(args, "quick")
    assert calls == [("setup", benchlib.THREADS)]


def test_timed_measures_blocks_and_laps():
    import time

    with benchlib.timed() as t:
        time.sleep(0.01)
    assert 0.009 < t.seconds < 5
    clock = benchlib.timed()
    time.sleep(0.01)
    first = clock.lap()
    second = clock.lap()
    assert first >= 0.009 and 0 <= second < first and clock.elapsed() >= first
    assert len(benchlib.repeat(lambda: None, 3, warmup=1)) == 3
