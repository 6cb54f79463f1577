"""`kvstore sample` and `score` under variants, on tiny saved models: `--press` and `--decode-attention`
compose into one variant (as `press=` and `decode_attention=` do), `--variant` repeated sweeps, each
spec is parsed once at the edge, and every misuse is refused in one line."""

from __future__ import annotations

import json

import pytest
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
                   *(x for s in specs for x in ("--variant", s))])  # fmt: skip
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
                 *(x for s in specs for x in ("--variant", s))])  # fmt: skip
    assert [r["raw_output"] for r in _rows(tmp_path / "ref.jsonl")] == [r["raw_output"] for r in rows]
    assert [t["agreement_with_dense"] for t in ref["variants"]] == [t["agreement_with_dense"] for t in table]


def test_sweep_text_summary_has_a_table(tiny_neox_dir, tmp_path):
    data = write_dataset(tmp_path / "qa.jsonl", range(2), questions=1)
    result = CliRunner().invoke(
        app,
        ["sample", str(data), "--model", str(tiny_neox_dir), "--store", str(tmp_path / "s"), "--quiet", "-n", "3",
         "--variant", "dense", "--variant", "topk:4"],
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
        (["--variant", "topk:2", "--variant", "topk:2"], "named twice"),
        (["--decode-attention", "topk:2", "--compile"], "drop compile"),
        (["--variant", "topk:2", "--compile"], "drop compile"),
    ):
        code, out, err = run_main(capsys, "sample", data, *common, *extra)
        assert code == 1, (extra, err)
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("kvstore: error: ") and message in lines[0], (extra, err)
    assert not store.exists()  # refused before anything was stored (or even loaded, for the specs)


def test_press_and_decode_attention_compose_into_one_variant_as_the_keywords_do(tiny_llama_dir, tmp_path):
    """``--press P --decode-attention A`` is one variant, ``P+A``: what ``sample(press=P,
    decode_attention=A)`` answers, and what ``--variant P+A`` answers in a sweep; a sweep is
    ``--variant`` repeated, in the order given."""
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.adapter import Adapter

    data = write_dataset(tmp_path / "qa.jsonl", range(3), questions=1)
    common = ["--model", tiny_llama_dir, "--store", tmp_path / "store", "--quiet", "--format", "json", "--no-chat",
              "-n", "4"]  # fmt: skip
    one = _json(["sample", data, *common, "-o", tmp_path / "one.jsonl", "--press", "knorm:.50",
                 "--decode-attention", "topk:3"])  # fmt: skip
    assert one["variant"] == "knorm:0.5+topk:3" and "variants" not in one  # one variant, not a sweep
    assert one["window_tokens_computed"] is not None
    rows = _rows(tmp_path / "one.jsonl")
    assert len(rows) == 3 and {r["variant"] for r in rows} == {"knorm:0.5+topk:3"}
    assert all(r["kept_tokens"] > 0 for r in rows)
    # the same answers as the Python keywords, and as the composed variant in a sweep
    adapter = Adapter.from_pretrained(str(tiny_llama_dir))
    examples = [json.loads(x) for x in data.read_text().splitlines()]
    got = adapter.sample([e["context"] for e in examples], [e["question"] for e in examples],
                         prompt=PromptFormat.plain(), num_new_tokens=4, use_cache=False, press="knorm:0.5",
                         decode_attention="topk:3")  # fmt: skip
    assert [r["raw_output"] for r in rows] == [adapter.decode(t[:n]) for t, n in zip(got.tokens, got.lengths)]
    swept = _json(["sample", data, *common, "-o", tmp_path / "sweep.jsonl", "--variant", "knorm:0.5",
                   "--variant", "dense", "--variant", "knorm:0.5+topk:3"])  # fmt: skip
    order = ["knorm:0.5", "dense", "knorm:0.5+topk:3"]  # canonical names, as given
    assert [t["variant"] for t in swept["variants"]] == order
    swept_rows = _rows(tmp_path / "sweep.jsonl")
    assert [r["variant"] for r in swept_rows] == [v for v in order for _ in range(3)]
    assert [r["raw_output"] for r in swept_rows[6:]] == [r["raw_output"] for r in rows]
    pressed, dense = swept["variants"][0], swept["variants"][1]
    assert pressed["kept_tokens"] < dense["kept_tokens"] and pressed["cache_bytes"] < dense["cache_bytes"]


@pytest.mark.parametrize("command", ["sample", "score"])
def test_variant_flags_misused_are_refused_in_one_line(command, tiny_llama_dir, tmp_path, capsys):
    """Each misuse: one ``kvstore: error:`` line naming what was typed and what to do, exit 1,
    before the model loads (nothing stored)."""
    data = tmp_path / "qa.jsonl"
    if command == "sample":
        write_dataset(data, range(2), questions=1)
    else:
        data.write_text(json.dumps({"context": "The fox runs.", "question": "Who?", "choices": ["fox", "dog"],
                                    "label": 0}) + "\n")  # fmt: skip
    store = tmp_path / "s"
    cases = (
        (["--press", "knorm:0.5", "--press", "snapkv:0.5"], ["--press given 2 times", "--variant knorm:0.5 --variant"]),
        (["--decode-attention", "topk:2", "--decode-attention", "topk:3"], ["--decode-attention given 2", "--variant"]),
        (["--variant", "dense", "--press", "knorm:0.5"], ["not both", "--variant PRESS+ATTENTION"]),
        (["--variant", "topk:2", "--decode-attention", "topk:3"], ["not both"]),
        (["--press", "bogus:0.5"], ["unknown press 'bogus'", "knorm, streaming_llm"]),  # the press parser's message
        (["--press", "snapkv:0.5+topk:4"], ["--press snapkv:0.5+topk:4 is a press and a decode attention",
                                            "--decode-attention topk:4", "--variant snapkv:0.5+topk:4"]),
        (["--decode-attention", "snapkv:0.5"], ["--decode-attention snapkv:0.5 names a press", "--press snapkv:0.5"]),
        (["--decode-attention", "topk:zero"], ["expected topk:N"]),
        (["--variant", "topk:2+knorm:0.5"], ["only a press may come before '+'"]),
    )  # fmt: skip
    for extra, expected in cases:
        code, out, err = run_main(capsys, command, data, "--model", tiny_llama_dir, "--store", store, "-q", *extra)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 1 and len(lines) == 1 and lines[0].startswith("kvstore: error: "), (extra, err)
        assert all(text in lines[0] for text in expected), (extra, lines[0])
    assert not store.exists()


def test_each_spec_is_parsed_once_at_the_edge(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """The CLI parses each value once with the library's parsers and hands down the typed values:
    the options take the Press and Attention as they are, and the sweep the Variants (no re-parse)."""
    from kvstore.model import options
    from kvstore.model.variants import variant

    calls: list[str] = []

    def counted(module, name):
        real = getattr(module, name)

        def spy(spec, *args):
            calls.append(f"{name}({spec})")
            return real(spec, *args)

        monkeypatch.setattr(module, name, spy)

    counted(options, "parse_press")
    counted(variant, "parse_press")
    counted(variant, "parse_attention")
    data = write_dataset(tmp_path / "qa.jsonl", range(2), questions=1)
    common = ["--model", tiny_llama_dir, "--store", tmp_path / "s", "-q", "--no-chat", "-n", "2", "--format", "json"]
    code, _, err = run_main(capsys, "sample", data, *common, "--press", "knorm:0.5", "--decode-attention", "topk:2")
    assert code == 0, err
    assert calls == ["parse_press(knorm:0.5)", "parse_attention(topk:2)"]
    calls.clear()
    code, _, err = run_main(capsys, "sample", data, *common, "--variant", "snapkv:0.5+topk:2", "--variant", "dense")
    assert code == 0, err
    # "dense" is the attention parser's word: read there, once
    assert calls == ["parse_press(snapkv:0.5)", "parse_attention(topk:2)", "parse_attention(dense)"]


def test_score_refuses_a_question_aware_press_in_one_line(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "mc.jsonl"
    data.write_text(json.dumps({"context": "The fox runs.", "question": "Who?", "choices": ["fox", "dog"],
                                "label": 0}) + "\n")  # fmt: skip
    code, _, err = run_main(capsys, "score", data, "--model", tiny_llama_dir, "--store", tmp_path / "s",
                            "--press", "snapkv:0.5:q", "-q")  # fmt: skip
    assert code == 1 and len(err.strip().splitlines()) == 1 and "question-aware" in err, err


@pytest.mark.parametrize("command", ["sample", "score"])
def test_the_help_says_how_the_variant_flags_combine(command):
    """Each flag's help says what it means: --press and --decode-attention compose into one variant
    and are given once; --variant is repeated to sweep and not mixed with them."""
    out = CliRunner().invoke(app, [command, "--help"], terminal_width=400).output
    lines = {flag: next(x for x in out.splitlines() if x.strip().startswith(flag)) for flag in
             ("--press", "--decode-attention", "--variant")}  # fmt: skip
    assert "Composes with --decode-attention into one variant" in lines["--press"] and "repeat --variant" in out
    from kvstore.model.press.registry import budget_names, press_names

    assert ", ".join(press_names()) in lines["--press"]  # the registry
    assert ", ".join(budget_names()) in lines["--press"]
    assert "Composes with --press into one variant" in lines["--decode-attention"]
    assert "Repeat to sweep" in lines["--variant"] and "Not with --press/--decode-attention" in lines["--variant"]
