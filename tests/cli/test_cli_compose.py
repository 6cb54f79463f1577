"""`kvstore sample --compose` and `build` on rows whose context is a list of passages."""

from __future__ import annotations

import json

from click.testing import CliRunner

from helpers.cli import run_main
from kvstore.cli.main import app
from kvstore.store.kvstore import KVStore

POOL = [
    "The red fox lives in the north wood.",
    "Anna bakes bread at six.",
    "The river Tam runs past the old mill.",
    "Our team meets on Monday.",
]


def _dataset(path):
    orders = [(0, 1, 2), (2, 0, 1), (1, 3, 0), (3, 2, 1)]
    rows = [
        {
            "id": f"q{i}",
            "context": [POOL[j] for j in order],
            "question": "Where does the fox live?",
            "answers": ["wood"],
        }
        for i, order in enumerate(orders)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(args):
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_sample_composes_passages_and_full_equals_no_cache(tiny_neox_dir, tmp_path):
    data = _dataset(tmp_path / "multi.jsonl")
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_neox_dir), "--quiet", "--format", "json", "-n", "4"]
    outs = {}
    for name, extra in [("ref", ["--no-cache"]), ("full", ["--compose", "full"]), ("none", ["--compose", "none"]),
                        ("last", ["--compose", "last:8"])]:  # fmt: skip
        out = tmp_path / f"{name}.jsonl"
        summary = json.loads(_run(["sample", str(data), *common, "--store", store, *extra, "-o", str(out)]).stdout)
        outs[name] = [json.loads(line) for line in out.read_text().splitlines()]
        assert summary.get("compose") == (None if name == "ref" else outs[name][0]["compose"])
    assert [r["raw_output"] for r in outs["full"]] == [r["raw_output"] for r in outs["ref"]]
    assert {r["compose"] for r in outs["none"]} == {"none"} and {r["compose"] for r in outs["last"]} == {"last:8"}
    assert "compose" not in outs["ref"][0]
    with KVStore(store, readonly=True) as kv:
        records = [kv.context(k) for k in kv.context_keys()]
    assert sum(1 for r in records if r is not None and r.passage) == len(POOL)  # each passage once


def test_build_stores_the_composed_contexts_a_plain_sample_reads(tiny_neox_dir, tmp_path):
    data = _dataset(tmp_path / "multi.jsonl")
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_neox_dir), "--store", store, "--quiet", "--format", "json"]
    _run(["build", str(data), *common])
    summary = json.loads(_run(["sample", str(data), *common, "-n", "2"]).stdout)
    assert summary["cache_hit_rate"] == 1.0 and summary.get("compose") is None


def test_a_bad_policy_is_one_line(tiny_neox_dir, tmp_path):
    data = _dataset(tmp_path / "multi.jsonl")
    result = CliRunner().invoke(app, ["sample", str(data), "--model", str(tiny_neox_dir), "--compose", "blend"])
    assert result.exit_code != 0 and "compose policy 'blend'" in result.output


def _passage_records(path):
    with KVStore(path, readonly=True) as kv:
        return {k: r for k in kv.context_keys() if (r := kv.context(k)) is not None and r.passage}


def test_passages_are_listed_verified_synced_exported_and_removed_as_contexts(tiny_neox_dir, tmp_path):
    data = _dataset(tmp_path / "multi.jsonl")
    store = str(tmp_path / "store")
    _run(["sample", str(data), "--model", str(tiny_neox_dir), "--store", store, "-q", "-n", "2", "--compose", "none"])
    passages = _passage_records(store)
    assert len(passages) == len(POOL)
    listed = json.loads(_run(["ls", "--store", store, "--format", "json"]).stdout)
    keys = {c["key"] for c in (listed["contexts"] if isinstance(listed, dict) else listed)}
    assert set(passages) <= keys
    _run(["verify", "--store", store])
    copy = str(tmp_path / "copy")
    _run(["sync", store, copy, "--quiet"])
    assert set(_passage_records(copy)) == set(passages)  # the flag travels with the record
    out = tmp_path / "exported"
    _run(["export", "--store", store, str(out), "--quiet"])
    assert {p.stem for p in out.glob("*.safetensors")} >= set(passages)
    victim = next(iter(passages))
    _run(["rm", "--store", store, victim, "--yes"])
    _run(["gc", "--store", store, "--grace", "0s", "--yes", "--quiet"])
    assert set(_passage_records(store)) == set(passages) - {victim}
    with KVStore(store, readonly=True) as kv:
        assert not any(kv.contains(k) for k in passages[victim].chunks)
    # a later composed sample computes the removed passage again and stores it once more
    _run(["sample", str(data), "--model", str(tiny_neox_dir), "--store", store, "-q", "-n", "2", "--compose", "none"])
    assert set(_passage_records(store)) == set(passages)


def test_build_compose_stores_each_passage_once_and_a_composed_sample_computes_none(tiny_neox_dir, tmp_path):
    data = _dataset(tmp_path / "multi.jsonl")
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_neox_dir), "--store", store, "--quiet", "--format", "json"]
    plan = json.loads(_run(["build", str(data), *common, "--compose", "--dry-run"]).stdout)
    assert plan["compose"] is True and plan["distinct"] == len(POOL) + 1  # the passages and the chat head
    assert plan["to_compute"] == len(POOL) + 1 and plan["tokens_to_compute"] == sum(s["tokens"] for s in plan["steps"])
    built = json.loads(_run(["build", str(data), *common, "--compose"]).stdout)
    assert built["compose"] is True and built["built"] == len(POOL) + 1
    assert built["tokens_computed"] == plan["tokens_to_compute"]
    with KVStore(store, readonly=True) as kv:
        records = [kv.context(k) for k in kv.context_keys()]
    assert len(records) == len(POOL) + 1 and sum(1 for r in records if r is not None and r.passage) == len(POOL)
    again = json.loads(_run(["build", str(data), *common, "--compose", "--dry-run"]).stdout)
    assert again["to_skip"] == len(POOL) + 1 and again["tokens_to_compute"] == 0
    summary = json.loads(_run(["sample", str(data), *common, "-n", "2", "--compose", "blend:0.2"]).stdout)
    assert summary["cache_hit_rate"] == 1.0
    none = json.loads(_run(["sample", str(data), *common, "-n", "2", "--compose", "none"]).stdout)
    assert none["prefill_tokens_computed"] == 0  # every passage and the head read from the build
    plain = json.loads(_run(["sample", str(data), *common, "-n", "2"]).stdout)
    assert plain["cache_hit_rate"] == 0.0  # the exact prefix chains are a plain build's, not --compose's


def test_build_compose_refuses_what_it_cannot_store(tiny_neox_dir, tmp_path, capsys):
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"context": "Some text.", "question": "Who?", "answers": ["x"]}) + "\n")
    multi = _dataset(tmp_path / "multi.jsonl")
    common = ["--model", str(tiny_neox_dir), "--store", str(tmp_path / "s"), "-q", "--compose"]
    for data, extra, message in [(plain, [], "is for contexts given as passages"),
                                 (multi, ["--press", "knorm:0.5"], "passages are stored dense")]:  # fmt: skip
        code, _, err = run_main(capsys, "build", data, *common, *extra)
        assert code != 0 and message in err and err.count("\n") == 1, err


def test_ls_marks_passages_and_a_converted_passage_stays_one(tiny_neox_dir, tmp_path):
    data = _dataset(tmp_path / "multi.jsonl")
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_neox_dir), "--store", store, "--quiet"]
    _run(["build", str(data), *common, "--compose"])
    listed = json.loads(_run(["ls", "--store", store, "--format", "json"]).stdout)
    rows = listed["contexts"] if isinstance(listed, dict) else listed
    assert sorted(r["passage"] for r in rows) == [False] + [True] * len(POOL)
    table = _run(["ls", "--store", store]).stdout
    assert "PASSAGE" in table and table.count(" passage") == len(POOL)
    _run(["sync", store, store, "--codec", "int8", "--quiet"])  # int8 copies beside the lossless ones, in place
    with KVStore(store, readonly=True) as kv:
        records = [r for k in kv.context_keys() if (r := kv.context(k)) is not None]
    assert len(records) == 2 * (len(POOL) + 1) and sum(r.passage for r in records) == 2 * len(POOL)
    # the converted passages are where a composed sample in that codec looks: it computes none
    got = json.loads(_run(["sample", str(data), *common, "-n", "2", "--compose", "none", "--codec", "int8",
                           "--format", "json"]).stdout)  # fmt: skip
    assert got["prefill_tokens_computed"] == 0 and got["cache_hit_rate"] == 1.0
