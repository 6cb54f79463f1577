"""`kvstore score` through the CLI on tiny saved models: multiple choice, reference texts, bad rows."""

from __future__ import annotations

import csv
import json
import math

import pytest
from click.testing import CliRunner

from helpers.cli import run_main
from kvstore.cli.main import app
from kvstore.model.adapter import Adapter
from kvstore.store.kvstore import KVStore

DOCS = [
    "The red fox lives in the north wood and eats berries in the summer.",
    "Anna bakes bread every morning at six in her small shop.",
    "The river Tam runs past the old mill and into the grey sea.",
]
ROWS = [
    {"id": "a", "context": DOCS[0], "question": "Where does the fox live?",
     "choices": ["the north wood", "the sea", "a shop", "Paris"], "label": 0},
    {"id": "b", "context": DOCS[0], "question": "What does the fox eat?",
     "choices": ["berries", "bread"], "answer": "berries"},
    {"id": "c", "context": DOCS[1], "question": "When does Anna bake?",
     "choices": ["at six", "at noon", "never"], "label": 2},
    {"id": "d", "context": DOCS[2], "choices": ["mill", "sea", "fox"]},  # no question, no label
]  # fmt: skip


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _prompt(r):
    return f"{r['context']}\nQuestion: {r['question']}\nAnswer:" if r.get("question") else r["context"]


def _want(model_dir, rows):
    """Per-option log-likelihoods computed here with Adapter.score without a store."""
    adapter = Adapter.from_pretrained(str(model_dir), dtype="float64")
    lls = []
    for r in rows:
        options = [" " + c for c in r["choices"]]
        lls.append(adapter.score([_prompt(r)] * len(options), options, use_cache=False).logprobs)
    return lls


def test_multiple_choice_cached_equals_no_cache_and_a_second_run_computes_nothing(tiny_llama_dir, tmp_path):
    data = _write(tmp_path / "mc.jsonl", ROWS)
    store = tmp_path / "store"
    base = ["score", data, "--model", tiny_llama_dir, "--dtype", "float64", "--store", store, "--format", "json", "-q"]
    cold = _json(_run(*base, "-o", tmp_path / "cold.jsonl"))
    warm = _json(_run(*base, "-o", tmp_path / "warm.jsonl"))
    ref = _json(_run(*base, "--no-cache", "-o", tmp_path / "ref.jsonl"))
    want = _want(tiny_llama_dir, ROWS)
    per_row = {}
    for name in ("cold", "warm", "ref"):
        got = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        per_row[name] = got
        for row, w in zip(got, want):
            assert [abs(c["logprob"] - x) <= 1e-10 for c, x in zip(row["choices"], w)] == [True] * len(w)
    assert cold["rows"] == 4 and cold["options"] == 12 and cold["graded"] == 3
    # acc / acc_norm by lm-eval's definitions, recomputed from the log-likelihoods
    graded = [(r, w) for r, w in zip(ROWS, want) if "label" in r or "answer" in r]
    labels = [r["label"] if "label" in r else r["choices"].index(r["answer"]) for r, _ in graded]
    acc = sum(max(range(len(w)), key=w.__getitem__) == y for (_, w), y in zip(graded, labels)) / 3
    norm = [[x / len(c) for x, c in zip(w, r["choices"])] for r, w in graded]
    acc_norm = sum(max(range(len(n)), key=n.__getitem__) == y for n, y in zip(norm, labels)) / 3
    per_byte = [[x / len(c.encode()) for x, c in zip(w, r["choices"])] for r, w in graded]
    acc_bytes = sum(max(range(len(n)), key=n.__getitem__) == y for n, y in zip(per_byte, labels)) / 3
    for summary in (cold, warm, ref):
        assert summary["acc"] == round(acc, 4) and summary["acc_norm"] == round(acc_norm, 4)
        assert summary["acc_bytes"] == round(acc_bytes, 4)
    assert per_row["cold"][1]["label"] == 0 and per_row["cold"][3]["label"] is None
    assert "correct" not in per_row["cold"][3]
    # cold: rows a and b share a document, stored once and loaded by both prompts, which compute only
    # their question part; every other prompt is computed once for all its options. Warm: nothing.
    adapter = Adapter.from_pretrained(str(tiny_llama_dir), dtype="float64")
    sizes = [len(adapter.encode_context(_prompt(r))) for r in ROWS]
    doc = len(adapter.encode_context(DOCS[0]))
    assert [r["cached_tokens"] for r in per_row["cold"][:2]] == [doc, doc]
    assert cold["prefill_tokens_computed"] == doc + (sizes[0] - doc) + (sizes[1] - doc) + sizes[2] + sizes[3]
    no_cache_tokens = sum(s * len(r["choices"]) for s, r in zip(sizes, ROWS))
    assert cold["prefill_tokens_saved"] == no_cache_tokens - cold["prefill_tokens_computed"]
    assert warm["prefill_tokens_computed"] == 0
    assert ref["prefill_tokens_computed"] == no_cache_tokens
    assert ref["cache"] == "off" and cold["cache"] == "on"


def test_csv_choices_joined_or_json(tiny_neox_dir, tmp_path):
    path = tmp_path / "mc.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "context", "question", "choices", "label"])
        w.writerow(["x", DOCS[0], "Where?", "the north wood|the sea", "0"])
        w.writerow(["y", DOCS[1], "When?", json.dumps(["at six", "at | noon"]), "1"])
    out = tmp_path / "p.jsonl"
    got = _json(_run("score", path, "-m", tiny_neox_dir, "--store", tmp_path / "s", "--format=json", "-q", "-o", out))
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [c["text"] for c in rows[0]["choices"]] == ["the north wood", "the sea"]
    assert [c["text"] for c in rows[1]["choices"]] == ["at six", "at | noon"]
    assert got["graded"] == 2 and rows[1]["label"] == 1


def test_reference_mode_perplexity_and_bits_per_char(tiny_neox_dir, tmp_path):
    rows = [{"id": f"r{i}", "context": d, "question": "Say it again.", "reference": d} for i, d in enumerate(DOCS)]
    data = _write(tmp_path / "ref.jsonl", rows)
    out = tmp_path / "p.jsonl"
    base = ["score", data, "--reference", "-m", tiny_neox_dir, "--dtype", "float64", "--store", tmp_path / "s"]
    got = _json(_run(*base, "--format", "json", "-q", "-o", out))
    ref = _json(_run(*base, "--no-cache", "--format", "json", "-q"))
    adapter = Adapter.from_pretrained(str(tiny_neox_dir), dtype="float64")
    prompts = [f"{r['context']}\nQuestion: {r['question']}\nAnswer:" for r in rows]
    scored = adapter.score(prompts, [" " + r["reference"] for r in rows], use_cache=False)
    nll = -sum(scored.logprobs)
    tokens = sum(r.n_tokens for r in scored.rows)
    chars = sum(len(" " + r["reference"]) for r in rows)
    for summary in (got, ref):
        assert summary["tokens_scored"] == tokens
        assert summary["perplexity"] == round(math.exp(nll / tokens), 4)
        assert summary["bits_per_char"] == round(nll / (chars * math.log(2)), 6)
    per_row = [json.loads(x) for x in out.read_text().splitlines()]
    assert abs(per_row[0]["logprob"] - scored.logprobs[0]) <= 1e-10


def test_rolling_mode_scores_whole_documents(tiny_llama_dir, tmp_path):
    data = _write(tmp_path / "docs.jsonl", [{"id": f"d{i}", "context": d} for i, d in enumerate(DOCS)])
    base = ["score", data, "--rolling", "-m", tiny_llama_dir, "--dtype", "float64", "--store", tmp_path / "s"]
    first = _json(_run(*base, "--format", "json", "-q"))
    second = _json(_run(*base, "--format", "json", "-q"))
    adapter = Adapter.from_pretrained(str(tiny_llama_dir), dtype="float64")
    docs = adapter.score_rolling(DOCS, use_cache=False)
    nll = -sum(d.logprob for d in docs)
    assert first["perplexity"] == second["perplexity"] == round(math.exp(nll / sum(d.n_tokens for d in docs)), 4)
    assert first["prefill_tokens_computed"] == 1 and second["prefill_tokens_computed"] == 0  # the BOS, shared


def test_score_prints_the_load_wait_as_sample_does(tiny_llama_dir, tmp_path):
    """Issue 45, finding 8: the time scoring waited for the loads done ahead, in the text and JSON
    summaries (None without the cache), multiple choice and rolling; the API's fields."""
    data = _write(tmp_path / "mc.jsonl", ROWS)
    docs = _write(tmp_path / "docs.jsonl", [{"id": f"d{i}", "context": d} for i, d in enumerate(DOCS)])
    base = ["-m", tiny_llama_dir, "--store", tmp_path / "s", "-b", "1"]
    _json(_run("score", data, *base, "--format", "json", "-q"))  # stored: the next runs load every batch
    text = _run("score", data, *base, "-q")
    assert text.exit_code == 0, text.output
    lines = [x.split() for x in text.stdout.splitlines()]
    assert [float(x[3]) >= 0 for x in lines if x[:3] == ["load", "wait", "seconds"]] == [True]
    assert [0 <= float(x[2]) <= 1 for x in lines if x[:2] == ["idle", "share"]] == [True]
    for args in ((data,), (docs, "--rolling")):
        cached = _json(_run("score", *args, *base, "--format", "json", "-q"))
        ref = _json(_run("score", *args, *base, "--format", "json", "-q", "--no-cache"))
        assert cached["load_wait_seconds"] >= 0 and 0 <= cached["idle_share"] <= 1, args
        assert ref["load_wait_seconds"] is None and ref["idle_share"] is None, args
    adapter = Adapter.from_pretrained(str(tiny_llama_dir))
    with KVStore(str(tmp_path / "s")) as store:
        assert adapter.score(DOCS, [" x"] * 3, store=store, batch_size=1).load_wait_seconds >= 0
        assert adapter.score_rolling(DOCS, store=store, batch_size=1).load_wait_seconds >= 0


@pytest.mark.parametrize(
    "row,message",
    [
        ({"id": "e", "context": "x", "choices": [], "label": 0}, r"mc\.jsonl:2: empty choice list in field 'choices'"),
        ({"id": "e", "context": "x", "choices": ["a", "b"], "label": 2},
         r"mc\.jsonl:2: label 2 is out of range for 2 choices \(0\.\.1\)"),
        ({"id": "e", "context": "x", "choices": ["a", "b"], "answer": "c"},
         r"mc\.jsonl:2: answer 'c' is not among the choices"),
        ({"id": "e", "context": "x", "label": 0}, r"mc\.jsonl:2: missing field 'choices'"),
        ({"id": "e", "context": "x", "choices": ["a", "b"], "label": True}, r"mc\.jsonl:2: field 'label' must be"),
        # the "a|b" form is a CSV cell's; in JSON Lines it was split silently (issue 31)
        ({"id": "e", "context": "x", "choices": "a|b", "label": 0},
         r"mc\.jsonl:2: field 'choices' must be a list of strings, got a string; give a JSON list"),
    ],
)  # fmt: skip
def test_bad_rows_get_one_line_and_nothing_stored_is_lost(tiny_neox_dir, tmp_path, capsys, row, message):
    import re

    store = tmp_path / "s"
    good = _write(tmp_path / "good.jsonl", ROWS[:1])
    code, _, _ = run_main(capsys, "score", good, "-m", tiny_neox_dir, "--store", store, "-q")
    assert code == 0
    with KVStore(str(store)) as kv:
        before = sorted(kv.keys())
    assert before
    data = _write(tmp_path / "mc.jsonl", [ROWS[0], row])
    code, out, err = run_main(capsys, "score", data, "-m", tiny_neox_dir, "--store", store, "-q")
    assert code == 1
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and re.search(message, lines[0]), err
    with KVStore(str(store)) as kv:
        assert sorted(kv.keys()) == before


def test_too_long_row_is_named(tiny_neox_dir, tmp_path, capsys):
    data = _write(tmp_path / "mc.jsonl", [{"id": "long", "context": "the fox " * 400, "choices": ["a", "b"]}])
    code, _, err = run_main(capsys, "score", data, "-m", tiny_neox_dir, "--no-cache", "-q")
    assert code == 1 and "mc.jsonl:1 choice 0: context (" in err and len(err.strip().splitlines()) == 1
    args = ("score", data, "-m", tiny_neox_dir, "--no-cache", "-q", "--truncate", "--format=json")
    code, out, _ = run_main(capsys, *args)
    assert code == 0 and json.loads(out)["options"] == 2


def test_bad_template_is_a_usage_error(tiny_neox_dir, tmp_path, capsys):
    data = _write(tmp_path / "mc.jsonl", ROWS[:1])
    code, _, err = run_main(capsys, "score", data, "-m", tiny_neox_dir, "--template", "{document}", "-q")
    assert code == 2 and "--template" in err and "document" in err


def test_a_fixed_head_in_the_template_is_stored_once(tiny_llama_dir, tmp_path):
    """Text before {context} in --template (a few-shot block) is the prompts' shared prefix: stored
    once before the prompts run, then loaded by every prompt instead of computed."""
    head = "Answer with a word from the text. Example: The sky is blue. Question: What is blue? Answer: sky\n\n"
    rows = [{"id": "a", "context": DOCS[0], "question": "Who?", "choices": ["fox", "dog"], "label": 0},
            {"id": "b", "context": DOCS[1], "question": "Who?", "choices": ["Anna", "Tom"], "label": 0}]  # fmt: skip
    data = _write(tmp_path / "mc.jsonl", rows)
    out = tmp_path / "p.jsonl"
    template = head.replace("{", "{{").replace("}", "}}") + "{context}\nQuestion: {question}\nAnswer:"
    args = ["score", data, "-m", tiny_llama_dir, "--store", tmp_path / "s", "--template", template, "-b", "2"]
    _json(_run(*args, "--format", "json", "-q", "-o", out))
    got = [json.loads(x) for x in out.read_text().splitlines()]
    n_head = len(Adapter.from_pretrained(str(tiny_llama_dir)).encode_context(head))
    assert [n_head - 2 <= r["cached_tokens"] <= n_head for r in got] == [True, True]  # stored first, then loaded


def test_decode_attention_option_scores_under_it_and_a_bad_spec_is_one_line(tiny_llama_dir, tmp_path, capsys):
    data = _write(tmp_path / "mc.jsonl", ROWS[:2])
    base = ["score", data, "--model", tiny_llama_dir, "--dtype", "float64", "--format", "json", "-q"]
    runs = {}
    for name, extra in {"dense": [], "topk": ["--decode-attention", "topk:2"],
                        "ref": ["--decode-attention", "topk:2", "--no-cache"]}.items():  # fmt: skip
        out = tmp_path / f"{name}.jsonl"
        summary = _json(_run(*base, "--store", tmp_path / "store", "-o", out, *extra))
        assert summary["variant"] == ("dense" if name == "dense" else "topk:2")
        runs[name] = [c["logprob"] for line in out.read_text().splitlines() for c in json.loads(line)["choices"]]
    assert max(abs(a - b) for a, b in zip(runs["topk"], runs["ref"])) <= 1e-10
    assert max(abs(a - b) for a, b in zip(runs["topk"], runs["dense"])) > 1e-6
    code, out, err = run_main(capsys, *base, "--decode-attention", "topk:0")
    assert code != 0 and len(err.strip().splitlines()) == 1 and "topk" in err, err


def test_a_sweep_scores_every_variant_from_one_load_as_separate_runs_do(tiny_llama_dir, tmp_path):
    data = _write(tmp_path / "mc.jsonl", ROWS)
    base = ["score", data, "--model", tiny_llama_dir, "--dtype", "float64", "--format", "json", "-q",
            "--store", tmp_path / "store"]  # fmt: skip
    variants = ["dense", "topk:2", "sparq:2:3"]
    swept = _json(_run(*base, "-o", tmp_path / "sweep.jsonl", *[a for v in variants for a in ("--variant", v)]))
    rows = [json.loads(x) for x in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == [v for v in variants for _ in ROWS]
    assert [t["variant"] for t in swept["variants"]] == variants
    alone = _json(_run(*base[:-1], tmp_path / "other", "-o", tmp_path / "alone.jsonl"))  # one dense run, empty store
    assert swept["prefill_tokens_computed"] == alone["prefill_tokens_computed"] > 0  # each context computed once
    for v in variants:
        one = _json(_run(*base, "-o", tmp_path / f"{v}.jsonl", "--decode-attention", v))
        got = [json.loads(x) for x in (tmp_path / f"{v}.jsonl").read_text().splitlines()]
        mine = [r for r in rows if r["variant"] == v]
        for a, b in zip(mine, got):
            assert [c["logprob"] for c in a["choices"]] == pytest.approx(
                [c["logprob"] for c in b["choices"]], abs=1e-10
            )
        table = next(t for t in swept["variants"] if t["variant"] == v)
        assert (table["acc"], table["acc_norm"]) == (one["acc"], one["acc_norm"])
    assert next(t for t in swept["variants"] if t["variant"] == "dense")["agreement_with_dense"] == 1.0


def test_press_and_decode_attention_compose_into_one_variant(tiny_llama_dir, tmp_path):
    """``score --press P --decode-attention A`` scores under the one variant ``P+A``, as
    ``--variant P+A`` and ``Adapter.score(press=P, decode_attention=A)`` do."""
    data = _write(tmp_path / "mc.jsonl", ROWS[:2])
    base = ["score", data, "--model", tiny_llama_dir, "--dtype", "float64", "--format", "json", "-q",
            "--store", tmp_path / "store"]  # fmt: skip
    logprobs = {}
    for name, extra in {"flags": ["--press", "knorm:0.5", "--decode-attention", "topk:2"],
                        "variant": ["--variant", "knorm:0.5+topk:2"]}.items():  # fmt: skip
        out = tmp_path / f"{name}.jsonl"
        summary = _json(_run(*base, "-o", out, *extra))
        assert summary["variant"] == "knorm:0.5+topk:2" and "variants" not in summary
        logprobs[name] = [c["logprob"] for line in out.read_text().splitlines() for c in json.loads(line)["choices"]]
    assert logprobs["flags"] == logprobs["variant"]
