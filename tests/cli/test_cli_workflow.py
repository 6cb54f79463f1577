"""`kvstore build` and `kvstore sample` through the CLI, on tiny saved models."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from helpers.paths import REPO
from kvstore.cli.main import app, main
from kvstore.errors import StoreNotFoundError
from kvstore.store.kvstore import KVStore

TOPICS = [
    (
        "The red fox lives in the north wood and eats berries in the summer.",
        "Where does the fox live?",
        ["the north wood"],
    ),
    ("Anna bakes bread every morning at six in her small shop.", "When does Anna bake?", ["at six", "six"]),
    ("The river Tam runs past the old mill and into the grey sea.", "What does the river run past?", ["the old mill"]),
    ("Our team meets on Monday to plan the week and share news.", "When does the team meet?", ["Monday"]),
    ("The blue car was parked near the station for three days.", "Where was the car parked?", ["near the station"]),
]


def _write_dataset(path, *, questions_per_context: int = 2, extra: list[dict] | None = None):
    rows = []
    for i, (ctx, q, ans) in enumerate(TOPICS):
        for j in range(questions_per_context):
            rows.append(
                {
                    "id": f"r{i}-{j}",
                    "context": ctx,
                    "question": q if j == 0 else q.replace("?", " now?"),
                    "answers": ans,
                }
            )
    rows += extra or []
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data(tmp_path):
    return _write_dataset(tmp_path / "qa.jsonl")


def _run(args):
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    return result


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_build_then_sample_matches_no_cache(tiny_llama_dir, data, tmp_path):
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_llama_dir), "--store", store, "--quiet", "--format", "json"]
    built = _json(_run(["build", str(data), *common, "--batch-size", "2"]))
    assert (built["contexts"], built["built"], built["skipped"], built["failed"]) == (5, 5, 0, 0)
    assert built["stored_bytes"] > 0 and built["ratio"] > 0 and built["tokens_computed"] > 0
    cached = _json(_run(["sample", str(data), *common, "-n", "6", "-o", str(tmp_path / "c.jsonl")]))
    ref = _json(_run(["sample", str(data), *common, "-n", "6", "-o", str(tmp_path / "r.jsonl"), "--no-cache"]))
    assert cached["cache_hit_rate"] == 1.0 and ref["cache_hit_rate"] == 0.0
    assert cached["prefill_tokens_saved"] > 0 and cached["prefill_tokens_computed"] == 0
    c_rows = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    r_rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(c_rows) == 10
    assert [r["raw_output"] for r in c_rows] == [r["raw_output"] for r in r_rows]  # every row, all of it
    assert set(c_rows[0]) >= {"id", "question", "prediction", "answers", "correct", "cache_hit"}
    assert all(r["cache_hit"] for r in c_rows) and not any(r["cache_hit"] for r in r_rows)
    for key in ("accuracy", "exact_match", "f1", "questions_per_second"):
        assert cached[key] is not None
    assert cached["load_wait_seconds"] >= 0 and 0 <= cached["idle_share"] <= 1  # loads run ahead: their wait
    assert ref["load_wait_seconds"] is None and ref["idle_share"] is None  # no store, nothing loaded
    # make demo (experiments/demo.py) reads these summaries: every field it uses must exist

    demo = (REPO / "experiments" / "demo.py").read_text()
    for name, summary in (("built", built), ("cached", cached), ("ref", ref)):
        used = set(re.findall(rf"\b{name}\['(\w+)'\]", demo))
        assert used and used <= set(summary), f"demo.py reads {sorted(used - set(summary))} of {name}"
    assert set(re.findall(r"json.loads\(line\)\[\"(\w+)\"\]", demo)) <= set(c_rows[0])


def test_build_resumes_after_interrupt(tiny_neox_dir, data, tmp_path, monkeypatch, capsys):
    from kvstore.model.paths import dense

    store = str(tmp_path / "store")
    calls = {"n": 0}
    real_prefill, real_extend = dense.prefill, dense.extend

    def flaky(real):
        def call(adapter, batch, *args):
            calls["n"] += len(batch) > 1 or len(batch[0]) > 1  # not the one-token probe of the model's shapes
            if calls["n"] == 3:  # third forward pass: the user presses Ctrl-C
                raise KeyboardInterrupt
            return real(adapter, batch, *args)

        return call

    monkeypatch.setattr(dense, "prefill", flaky(real_prefill))  # whole contexts (the shared chat head)
    monkeypatch.setattr(dense, "extend", flaky(real_extend))  # contexts on top of a stored head
    with pytest.raises(SystemExit) as exit_info:
        main(["build", str(data), "--model", str(tiny_neox_dir), "--store", store, "--batch-size", "1", "--quiet"])
    assert exit_info.value.code == 130
    assert "interrupted" in capsys.readouterr().err
    with KVStore(store, readonly=True) as kv:
        kept = len(kv.context_keys())
        assert not kv.verify().corrupt
    assert kept >= 1  # contexts of batches finished before the interrupt were committed
    monkeypatch.setattr(dense, "prefill", real_prefill)
    monkeypatch.setattr(dense, "extend", real_extend)
    again = _json(
        _run(["build", str(data), "--model", str(tiny_neox_dir), "--store", store, "--quiet", "--format", "json"])
    )
    assert again["skipped"] == kept and again["built"] == 5 - kept
    assert again["tokens_reused"] > 0  # the shared chat head, at least, was not recomputed
    with KVStore(store, readonly=True) as kv:
        assert len(kv.context_keys()) == 5 and len(kv) == 6  # 5 contexts: their 5 documents + 1 shared head


def test_build_options(tiny_neox_dir, tmp_path):
    ds = tmp_path / "qa.csv"
    ds.write_text("doc,q,ans\n" + "".join(f'"{c}","{q}","{a[0]}"\n' for c, q, a in TOPICS))
    store = str(tmp_path / "store")
    out = _json(
        _run(
            [
                "build",
                str(ds),
                "--model",
                str(tiny_neox_dir),
                "--store",
                store,
                "--context-field",
                "doc",
                "--limit",
                "3",
                "--codec",
                "raw",
                "--dtype",
                "float64",
                "--quiet",
                "--format",
                "json",
            ]
        )
    )
    assert out["built"] == 3 and out["codec"] == "raw" and out["dtype"] == "float64"
    with KVStore(store, readonly=True) as kv:
        info = kv.scan()
    assert {e.codec for e in info.entries} == {"raw"} and {e.dtype for e in info.entries} == {"float64"}
    text = _run(
        ["build", str(ds), "--model", str(tiny_neox_dir), "--store", store, "--context-field", "doc", "--quiet"]
    )
    assert text.exit_code == 0 and "build summary" in text.stdout and "skipped" in text.stdout


def test_chat_and_template_options(tiny_llama_dir, data, tmp_path):
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_llama_dir), "--store", store, "--quiet", "--format", "json"]
    # chat mode caches other context ids than plain mode: different entries
    _json(_run(["build", str(data), *common, "--chat"]))
    _json(_run(["build", str(data), *common, "--no-chat"]))
    with KVStore(store, readonly=True) as kv:
        assert len(kv.context_keys()) == 10
    plain = _json(_run(["sample", str(data), *common, "--no-chat", "-n", "3"]))
    assert plain["cache_hit_rate"] == 1.0
    templ = ["--template", "{context}\nQ: {question}\nA:"]
    a = _json(_run(["sample", str(data), *common, "--chat", *templ, "-n", "3", "-o", str(tmp_path / "a.jsonl")]))
    b = _json(
        _run(["sample", str(data), *common, "--chat", *templ, "-n", "3", "-o", str(tmp_path / "b.jsonl"), "--no-cache"])
    )
    assert a["cache_hit_rate"] == 1.0  # the template changes the question part only
    assert (tmp_path / "a.jsonl").read_text().count("prediction") == 10
    preds = lambda p: [json.loads(x)["prediction"] for x in p.read_text().splitlines()]  # noqa: E731
    assert preds(tmp_path / "a.jsonl") == preds(tmp_path / "b.jsonl")
    assert b["mode"] == "no-cache"


def test_sample_computes_and_stores_missing(tiny_neox_dir, data, tmp_path):
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_neox_dir), "--store", store, "--quiet", "--format", "json", "-n", "2"]
    first = _json(_run(["sample", str(data), *common]))
    assert first["cache_hit_rate"] == 0.0 and first["prefill_tokens_computed"] > 0
    second = _json(_run(["sample", str(data), *common]))
    assert second["cache_hit_rate"] == 1.0
    ro_store = str(tmp_path / "ro")
    _json(
        _run(
            [
                "build",
                str(data),
                "--model",
                str(tiny_neox_dir),
                "--store",
                ro_store,
                "--limit",
                "2",
                "--quiet",
                "--format",
                "json",
            ]
        )
    )
    third = _json(
        _run(
            [
                "sample",
                str(data),
                "--model",
                str(tiny_neox_dir),
                "--store",
                ro_store,
                "--readonly-store",
                "--quiet",
                "--format",
                "json",
            ]
        )
    )
    assert third["cache_hit_rate"] == 0.2  # 2 of 10 rows have a stored context; nothing new stored
    with KVStore(ro_store, readonly=True) as kv:
        assert len(kv.context_keys()) == 1  # --limit counts rows: 2 rows, both about the first context


def test_bad_rows_named_or_skipped(tiny_neox_dir, tmp_path, capsys):
    ds = tmp_path / "bad.jsonl"
    good = _write_dataset(tmp_path / "good.jsonl").read_text()
    ds.write_text(good + '{"id": "x", "context": "", "question": "q?", "answers": ["a"]}\n{not json\n')
    store = str(tmp_path / "store")
    with pytest.raises(SystemExit) as exit_info:
        main(["build", str(ds), "--model", str(tiny_neox_dir), "--store", store, "--quiet"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:11" in err[0] and "Traceback" not in err[0]
    with pytest.raises(StoreNotFoundError):
        KVStore(store, readonly=True)  # the failed build created nothing
    out = _json(
        _run(
            [
                "build",
                str(ds),
                "--model",
                str(tiny_neox_dir),
                "--store",
                store,
                "--skip-bad-rows",
                "--quiet",
                "--format",
                "json",
            ]
        )
    )
    assert out["bad_rows_skipped"] == 2 and out["built"] == 5


def test_option_validation(tiny_neox_dir, data, tmp_path):
    for args in (["--batch-size", "0"], ["--batch-size", "-3"], ["--limit", "0"], ["--dtype", "int8"]):
        r = CliRunner().invoke(app, ["build", str(data), "--model", str(tiny_neox_dir), *args])
        assert r.exit_code == 2 and "Error" in r.output, args
    r = CliRunner().invoke(app, ["sample", str(data), "--max-new-tokens", "0"])
    assert r.exit_code == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["build", str(data), "--model", str(tiny_neox_dir), "--store", str(tmp_path / "s"), "--codec", "lz4"])
    assert exit_info.value.code == 1


def test_too_long_context_is_named(tiny_neox_dir, tmp_path, capsys):
    long_text = " ".join(["word"] * 2000)
    ds = _write_dataset(
        tmp_path / "long.jsonl", extra=[{"id": "long-1", "context": long_text, "question": "q?", "answers": ["a"]}]
    )
    store = str(tmp_path / "store")
    with pytest.raises(SystemExit) as exit_info:
        main(["build", str(ds), "--model", str(tiny_neox_dir), "--store", store, "--quiet"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "long-1" in err and "--truncate" in err
    out = _json(
        _run(
            [
                "build",
                str(ds),
                "--model",
                str(tiny_neox_dir),
                "--store",
                store,
                "--truncate",
                "--quiet",
                "--format",
                "json",
            ]
        )
    )
    assert out["built"] == 6 and out["failed"] == 0
    out = _json(
        _run(
            [
                "sample",
                str(ds),
                "--model",
                str(tiny_neox_dir),
                "--store",
                store,
                "--truncate",
                "--quiet",
                "--format",
                "json",
                "-n",
                "2",
            ]
        )
    )
    assert out["cache_hit_rate"] == 1.0


@pytest.mark.real_model
def test_demo_dataset_real_model_cli(real_model, tmp_path):
    """The bundled model through the CLI on 8 distinct demo contexts of ~70 and ~330 tokens
    (real padding): `sample` == `sample --no-cache`, the whole generated text of every row, at
    batch sizes 3 and 8."""
    from helpers.data import padded_demo_rows, write_rows

    data = write_rows(tmp_path / "padded.jsonl", padded_demo_rows(8))
    store = str(tmp_path / "store")
    common = [str(data), "--store", store, "--quiet", "--format", "json"]
    built = _json(_run(["build", *common, "-b", "3"]))
    assert built["built"] == 8
    reference = tmp_path / "reference.jsonl"
    _json(_run(["sample", *common, "-n", "12", "-o", str(reference), "--no-cache"]))
    rows = lambda p: {r["id"]: r["raw_output"] for r in map(json.loads, p.read_text().splitlines())}  # noqa: E731
    for bs in ("3", "8"):
        cached = tmp_path / f"cached-{bs}.jsonl"
        a = _json(_run(["sample", *common, "-n", "12", "-b", bs, "-o", str(cached)]))
        assert a["cache_hit_rate"] == 1.0
        assert rows(cached) == rows(reference), f"batch size {bs}"


def test_force_staging_from_the_environment_stages_on_cpu_with_the_same_answers(
    tiny_llama_dir, data, tmp_path, monkeypatch
):
    """``KVSTORE_FORCE_STAGING=1`` (issue 45, finding 8): a CLI sample stages its loads through the
    ring and its writes through the host buffers, as on an accelerator, on CPU; the answers, cold
    (computed and stored) and warm (loaded), are those of a run without it."""
    from kvstore.model.io.writer import Writer
    from kvstore.model.stages import load as load_mod

    loads: list[bool] = []  # per load: staged through a forced ring
    writes: list[bool] = []  # per put: staged through host buffers
    real_staging, real_host = load_mod.Staging, Writer._host_for

    def staging(*args, **kw):
        loads.append(bool(kw.get("force")) and kw.get("ring") is not None)
        return real_staging(*args, **kw)

    def host_for(self, handle):
        got = real_host(self, handle)
        writes.append(got is not None)
        return got

    monkeypatch.setattr(load_mod, "Staging", staging)
    monkeypatch.setattr(Writer, "_host_for", host_for)

    def runs(name):
        out = []
        for run in ("cold", "warm"):
            path = tmp_path / f"{name}-{run}.jsonl"
            summary = _json(_run(["sample", str(data), "--model", str(tiny_llama_dir), "--store", str(tmp_path / name),
                                  "--quiet", "--format", "json", "-n", "6", "-o", str(path)]))  # fmt: skip
            assert summary["cache_hit_rate"] == (1.0 if run == "warm" else 0.0)
            out.append([json.loads(x)["raw_output"] for x in path.read_text().splitlines()])
        return out

    monkeypatch.delenv("KVSTORE_FORCE_STAGING", raising=False)
    plain = runs("plain")
    assert loads and writes and not any(loads) and not any(writes)  # nothing staged on CPU by default
    loads.clear()
    writes.clear()
    monkeypatch.setenv("KVSTORE_FORCE_STAGING", "1")
    staged = runs("staged")
    assert loads and all(loads) and writes and all(writes)
    assert staged == plain
