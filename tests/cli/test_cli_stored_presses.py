"""`kvstore build --press/--score/--no-dense/--dry-run` and `sample` from the stored pressed caches, on a
tiny saved model: the issue's own commands, their summaries, and every bad request in one line."""

from __future__ import annotations

import json

from click.testing import CliRunner

from helpers.cli import run_main, write_dataset
from kvstore.cli.main import app
from kvstore.store.kvstore import KVStore


def _run(args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _json(args):
    result = _run(args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_build_press_then_sample_answers_from_the_pressed_caches(tiny_llama_dir, tmp_path):
    data = write_dataset(tmp_path / "qa.jsonl", range(3), questions=2)
    common = ["--model", tiny_llama_dir, "--quiet", "--format", "json", "--no-chat"]
    pressed, dense = ["--store", tmp_path / "pressed"], ["--store", tmp_path / "dense"]
    built = _json(["build", data, *common, *pressed, "--press", "kvzip:0.75", "--codec", "int8"])
    assert built["pressed_written"] == 3 and built["scoring_tokens_computed"] > 0 and built["codec"].startswith("int8")
    got = _json(["sample", data, *common, *pressed, "--press", "kvzip:0.75", "--codec", "int8", "-n", "4",
                 "-o", tmp_path / "got.jsonl"])  # fmt: skip
    assert got["prefill_tokens_computed"] == 0 and got["scoring_tokens_computed"] == 0 and got["cache_hit_rate"] == 1.0
    # pressing the dense caches of a store without pressed entries answers the same
    _json(["build", data, *common, *dense, "--codec", "int8"])
    now = _json(["sample", data, *common, *dense, "--press", "kvzip:0.75", "--codec", "int8", "-n", "4",
                 "-o", tmp_path / "now.jsonl"])  # fmt: skip
    assert now["scoring_tokens_computed"] > 0
    texts = [r["raw_output"] for r in _rows(tmp_path / "now.jsonl")]
    assert [r["raw_output"] for r in _rows(tmp_path / "got.jsonl")] == texts
    # the entries record what made them
    with KVStore(str(tmp_path / "pressed"), readonly=True) as store:
        key = store.context_keys()[0]
        kinds = {}
        for dkey in store.derived_keys(key):  # the pressed cache, and kvzip's scores stored on their first use
            with store.open_derived(key, dkey) as view:
                kinds[view.header.kind] = view.header
        assert set(kinds) == {"pressed", "scores"}
        assert kinds["pressed"].spec == "kvzip:0.75" and kinds["pressed"].press["budget"] == "global"
        assert kinds["scores"].spec == "kvzip:chunk=2048:n_sink=4:plus=false" and kinds["scores"].identity == ""


def test_no_dense_and_score_and_the_dry_run(tiny_llama_dir, tmp_path):
    data = write_dataset(tmp_path / "qa.jsonl", range(2), questions=1)
    common = ["--model", tiny_llama_dir, "--store", tmp_path / "s", "--quiet", "--format", "json", "--no-chat"]
    plan = _json(["build", data, *common, "--press", "snapkv:0.5:adakv", "--no-dense", "--dry-run"])
    assert plan["to_compute"] == 0 and plan["pressed_to_make"] == 2 and {s["action"] for s in plan["steps"]} == {"none"}
    assert not (tmp_path / "s").exists() or KVStore(str(tmp_path / "s"), readonly=True).keys() == []  # nothing written
    built = _json(["build", data, *common, "--press", "snapkv:0.5:adakv", "--score", "kvzip", "--no-dense"])
    assert built["chunks_written"] == 0 and built["pressed_written"] == 2
    assert built["scores_written"] == 4  # kvzip's (--score), and snapkv's stored on their first use by the press
    with KVStore(str(tmp_path / "s"), readonly=True) as store:
        assert store.keys() == []  # no dense chunk
    derived = ["--press", "snapkv:0.5:adakv", "--score", "kvzip", "--no-dense"]
    again = _json(["build", data, *common, *derived, "--dry-run"])
    assert again["pressed_to_make"] == 0 and again["scores_to_make"] == 0
    got = _json(["sample", data, *common, "--variant", "snapkv:0.5:adakv", "--variant", "kvzip:0.5", "-n", "3"])
    kvzip = next(v for v in got["variants"] if v["variant"] == "kvzip:0.5")
    assert got["replay_tokens_computed"] == 0  # kvzip's scores were stored by --score
    assert kvzip["kept_tokens"] > 0


def test_bad_build_requests_are_one_line(tiny_llama_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "qa.jsonl", range(1), questions=1)
    common = ["--model", tiny_llama_dir, "--store", tmp_path / "s", "--quiet", "--no-chat"]
    for extra, says in [
        (["--score", "snapkv:q"], "question-aware"),
        (["--score", "streaming_llm"], "ratio"),
        (["--press", "snapkv:0.5:q"], "question-aware"),
        (["--press", "bogus:0.5"], "unknown press"),
        (["--press", "snapkv:0.5+topk:4"], "--decode-attention"),
        (["--no-dense"], "stores nothing"),
    ]:
        code, _, err = run_main(capsys, "build", data, *common, *extra)
        assert code != 0, extra
        lines = [x for x in err.splitlines() if x.startswith("kvstore: error") or "Error" in x]
        assert len(lines) == 1 and says in lines[0], (extra, err)
