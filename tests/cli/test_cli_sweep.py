"""`kvstore sample --decode-attention`: one variant, sweeps, and refusals, on tiny saved models."""

from __future__ import annotations

import json

from click.testing import CliRunner

from helpers.cli import run_main, write_dataset
from kvstore.cli.main import app


def _json(args):
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sweep_rows_and_summary(tiny_llama_dir, tmp_path):
    data = write_dataset(tmp_path / "qa.jsonl", range(3), questions=2)
    store = tmp_path / "store"
    common = ["--model", tiny_llama_dir, "--store", store, "--quiet", "--format", "json", "--no-chat"]
    _json(["build", data, *common])
    common += ["-n", "5"]
    plain = _json(["sample", data, *common, "-o", tmp_path / "plain.jsonl"])
    specs = ["dense", "topk:2", "sparq:4:3"]
    swept = _json(["sample", data, *common, "-o", tmp_path / "sweep.jsonl",
                   *(x for s in specs for x in ("--decode-attention", s))])  # fmt: skip
    rows = _rows(tmp_path / "sweep.jsonl")
    assert len(rows) == 6 * len(specs)
    assert [r["variant"] for r in rows] == [s for s in specs for _ in range(6)]
    plain_rows = _rows(tmp_path / "plain.jsonl")
    assert "variant" not in plain_rows[0]
    assert [r["raw_output"] for r in rows[:6]] == [r["raw_output"] for r in plain_rows]
    table = swept["variants"]
    assert [t["variant"] for t in table] == specs
    assert table[0]["agreement_with_dense"] == 1.0
    assert table[0]["accuracy"] == plain["accuracy"] and table[0]["f1"] == plain["f1"]
    for t in table:
        assert set(t) >= {"accuracy", "contains", "f1", "tokens_per_second", "agreement_with_dense"}
        assert t["tokens_per_second"] > 0
    agree = sum(a["raw_output"] == b["raw_output"] for a, b in zip(rows[6:12], rows[:6]))  # tokens equal => text equal
    assert table[1]["agreement_with_dense"] <= round(agree / 6, 4)
    assert swept["prefill_tokens_computed"] == 0 and swept["cache_hit_rate"] == 1.0
    # the no-cache reference sweeps too, with the same answers
    ref = _json(["sample", data, *common, "--no-cache", "-o", tmp_path / "ref.jsonl",
                 *(x for s in specs for x in ("--decode-attention", s))])  # fmt: skip
    assert [r["raw_output"] for r in _rows(tmp_path / "ref.jsonl")] == [r["raw_output"] for r in rows]
    assert [t["agreement_with_dense"] for t in ref["variants"]] == [t["agreement_with_dense"] for t in table]


def test_sweep_text_summary_has_a_table(tiny_neox_dir, tmp_path):
    data = write_dataset(tmp_path / "qa.jsonl", range(2), questions=1)
    result = CliRunner().invoke(
        app,
        ["sample", str(data), "--model", str(tiny_neox_dir), "--store", str(tmp_path / "s"), "--quiet", "-n", "3",
         "--decode-attention", "dense", "--decode-attention", "topk:4"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    at = lines.index("variants:")
    assert "agreement with dense" in lines[at + 1]
    assert lines[at + 2].split()[0] == "dense" and lines[at + 3].split()[0] == "topk:4"


def test_bad_spec_and_compile_are_one_line(tiny_neox_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "qa.jsonl", range(2), questions=1)
    store = tmp_path / "s"
    common = ["--model", tiny_neox_dir, "--store", store, "--quiet"]
    for extra, message in (
        (["--decode-attention", "topk:zero"], "expected topk:N"),
        (["--decode-attention", "nosuch_module_x:fn"], "cannot load it"),
        (["--decode-attention", "topk:2", "--decode-attention", "topk:2"], "named twice"),
        (["--decode-attention", "topk:2", "--compile"], "drop compile"),
    ):
        code, out, err = run_main(capsys, "sample", data, *common, *extra)
        assert code == 1, (extra, err)
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("kvstore: error: ") and message in lines[0], (extra, err)
    assert not store.exists()  # refused before anything was stored (or even loaded, for the specs)


def test_press_variant_and_decode_attention_are_one_option_in_the_order_given(tiny_llama_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "qa.jsonl", range(3), questions=1)
    common = ["--model", tiny_llama_dir, "--store", tmp_path / "store", "--quiet", "--format", "json", "--no-chat",
              "-n", "4"]  # fmt: skip
    out = tmp_path / "o.jsonl"
    swept = _json(["sample", data, *common, "-o", out, "--press", "knorm:.50", "--variant", "dense",
                   "--decode-attention", "topk:3", "--press", "snapkv:0.5+topk:3"])  # fmt: skip
    order = ["knorm:0.5", "dense", "topk:3", "snapkv:0.5+topk:3"]  # canonical names, as given
    assert [t["variant"] for t in swept["variants"]] == order
    rows = _rows(out)
    assert [r["variant"] for r in rows] == [v for v in order for _ in range(3)]
    dense = swept["variants"][1]
    pressed = swept["variants"][0]
    assert pressed["kept_tokens"] < dense["kept_tokens"] and pressed["cache_bytes"] < dense["cache_bytes"]
    assert swept["window_tokens_computed"] > 0  # snapkv's observation windows, not prefill
    for bad, text in (("--press", "knorm:1.5"), ("--press", "nope:0.5"), ("--variant", "topk:2+knorm:0.5")):
        code, _, err = run_main(capsys, "sample", data, *common, bad, text)
        assert code == 1 and len(err.strip().splitlines()) == 1, err


def test_score_refuses_a_question_aware_press_in_one_line(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "mc.jsonl"
    data.write_text(json.dumps({"context": "The fox runs.", "question": "Who?", "choices": ["fox", "dog"],
                                "label": 0}) + "\n")  # fmt: skip
    code, _, err = run_main(capsys, "score", data, "--model", tiny_llama_dir, "--store", tmp_path / "s",
                            "--press", "snapkv:0.5:q", "-q")  # fmt: skip
    assert code == 1 and len(err.strip().splitlines()) == 1 and "question-aware" in err, err
