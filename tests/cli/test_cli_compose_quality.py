"""`kvstore quality --compose POLICY`: composition policies against the full prefill on passage rows."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvstore.cli.main import app

POOL = [
    "The red fox lives in the north wood and eats berries in the summer.",
    "Anna bakes bread every morning at six in her small shop.",
    "The river Tam runs past the old mill and under the stone bridge.",
    "Our team meets on Monday to plan the week and share the news.",
]


def _dataset(path):
    orders = [(0, 1, 2), (2, 0, 1), (1, 3, 0), (3, 2, 1)]
    rows = [{"id": f"q{i}", "context": [POOL[j] for j in o], "question": "Where does the fox live?"}
            for i, o in enumerate(orders)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _quality(tmp_path, model_dir, *extra):
    args = ["quality", _dataset(tmp_path / "multi.jsonl"), "--model", str(model_dir), "-n", "6", "-q", *extra]
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_quality_measures_each_policy_against_the_full_prefill(tiny_llama_dir, tmp_path):
    got = _quality(tmp_path, tiny_llama_dir, "--compose", "full", "--compose", "none", "--compose", "blend:0.3",
                   "--compose", "blend:1", "--compose", "last:8", "--format", "json")  # fmt: skip
    assert got.exit_code == 0, got.output
    rows = {r["compose"]: r for r in json.loads(got.stdout)}
    assert list(rows) == ["full", "none", "blend:0.3", "blend:1", "last:8"]
    for name in ("full", "blend:1"):  # everything recomputed: the reference itself
        assert rows[name]["identical"] == 4 and rows[name]["common_prefix"] == 1.0 and rows[name]["top1"] == 1.0
        assert abs(rows[name]["kl"]) < 1e-5 and rows[name]["recomputed"] >= 1.0
    none, blend = rows["none"], rows["blend:0.3"]
    assert none["recomputed"] == 0.0 and 0.3 <= blend["recomputed"] < 0.4
    assert none["kl"] > 1e-3  # passages that never saw each other: measurably off (scaled-up init)
    assert all(r["rows"] == 4 and r["new_tokens"] == 6 and r["kl"] >= -1e-6 for r in rows.values())
    table = _quality(tmp_path, tiny_llama_dir, "--compose", "none")
    assert table.exit_code == 0 and "against the full prefill" in table.output and "none" in table.output


def test_quality_compose_refuses_in_one_line(tiny_llama_dir, tmp_path):
    cases = [
        (("--compose", "blend:2"), "compose policy 'blend:2'"),
        (("--compose", "none", "-c", "int8"), "one of the three"),
        ((), "one of the three"),
    ]
    for extra, message in cases:
        got = _quality(tmp_path, tiny_llama_dir, *extra)
        assert got.exit_code != 0 and message in got.output, got.output
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"context": "Some text about a fox.", "question": "Who?"}) + "\n")
    args = ["quality", str(plain), "--model", str(tiny_llama_dir), "--compose", "none", "-q"]
    got = CliRunner().invoke(app, args)
    assert got.exit_code != 0 and "list of passages" in got.output and got.output.count("\n") <= 2, got.output
