"""`kvstore sample --compose` and `build` on rows whose context is a list of passages."""

from __future__ import annotations

import json

from click.testing import CliRunner

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
