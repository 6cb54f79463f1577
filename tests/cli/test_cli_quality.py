"""`kvstore quality` (the lossy codecs' quality gate) through the CLI on a tiny saved model, and the
library function behind it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers.cli import run_main
from kvstore.cli.main import app

ROWS = [
    {"id": "a", "context": "The red fox lives in the north wood and eats berries in the summer. " * 3,
     "question": "Where does the fox live?"},
    {"id": "b", "context": "Anna bakes bread every morning at six in her small shop, and the river runs by."},
]  # fmt: skip


def _data(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def test_quality_reports_every_codec_against_the_lossless_cache(tiny_llama_dir, tmp_path):
    args = ["quality", _data(tmp_path), "--model", str(tiny_llama_dir), "--dtype", "float64", "-c", "int8",
            "-c", "int4h", "-n", "4", "--chunk-tokens", "16", "--format", "json", "-q"]  # fmt: skip
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = {r["codec"]: r for r in json.loads(result.stdout)}
    assert set(rows) == {"int8:128/64", "int4h:32/64+zstd:1"}
    for r in rows.values():
        assert r["rows"] == 2 and r["new_tokens"] == 4 and 0 <= r["identical"] <= 2
        assert 0 <= r["common_prefix"] <= 1
        for mode in ("kv", "keys", "values"):
            assert r[f"kl_{mode}"] >= -1e-9 and 0 <= r[f"top1_{mode}"] <= 1
    # 8-bit codes are 16x finer than 4-bit ones: far less damage, and more bytes
    int8, int4h = rows["int8:128/64"], rows["int4h:32/64+zstd:1"]
    assert int8["kl_kv"] < int4h["kl_kv"] / 10
    assert int8["kl_keys"] < int4h["kl_keys"] and int8["kl_values"] < int4h["kl_values"]
    assert int4h["size_vs_f32"] < int8["size_vs_f32"]
    # a float64 model: bytes vs its own dtype are half those vs float32
    assert int8["size_vs_dtype"] == pytest.approx(int8["size_vs_f32"] / 2)


def test_quality_table_and_bad_codecs(tiny_llama_dir, tmp_path, capsys):
    data = _data(tmp_path)
    base = ["quality", data, "--model", str(tiny_llama_dir), "-n", "2", "-q", "--limit", "1"]
    result = CliRunner().invoke(app, [*base, "-c", "int4"])
    assert result.exit_code == 0, result.output
    assert "1 rows, 2 new tokens" in result.stdout and "int4:32/64" in result.stdout and "KL K only" in result.stdout
    code, _, err = run_main(capsys, *base, "-c", "int8", "-c", "zstd:1")
    assert code == 1 and err.count("\n") == 1 and "zstd:1 is lossless" in err
    code, _, err = run_main(capsys, *base, "-c", "int3")
    assert code == 1 and err.count("\n") == 1 and "unknown codec 'int3'" in err


def test_keys_only_and_values_only_damage_are_measured_apart(tiny_llama):
    """With only the keys quantized the values are the lossless ones, and the other way round."""
    import torch

    from kvstore.model.adapter import Adapter
    from kvstore.quality import quality_gate, rows_of

    adapter = Adapter(*tiny_llama)
    rows = rows_of(adapter, [ROWS[0]["context"]], [ROWS[0]["question"]])
    (q,) = quality_gate(adapter, rows, ["int4"], new_tokens=3, chunk_tokens=8)
    assert q.kl["keys"] > 0 and q.kl["values"] > 0 and q.kl["kv"] > 0
    # keys-only damage does not depend on the values' codes, nor values-only damage on the keys':
    # int4 with other value groups (32/2) or other key groups (4/64) than int4:32/64
    (a,) = quality_gate(adapter, rows, ["int4:32/64"], new_tokens=3, chunk_tokens=8)
    (v,) = quality_gate(adapter, rows, ["int4:32/2"], new_tokens=3, chunk_tokens=8)
    (k,) = quality_gate(adapter, rows, ["int4:4/64"], new_tokens=3, chunk_tokens=8)
    assert v.kl["keys"] == pytest.approx(a.kl["keys"], rel=1e-9, abs=1e-12)
    assert v.kl["values"] != pytest.approx(a.kl["values"], rel=1e-3)
    assert k.kl["values"] == pytest.approx(a.kl["values"], rel=1e-9, abs=1e-12)
    assert k.kl["keys"] != pytest.approx(a.kl["keys"], rel=1e-3)
    assert torch.isfinite(torch.tensor(list(q.kl.values()))).all()


# -- a codec given twice, the reference path's floor, KL never negative (issue 45, finding 5) --------
def test_a_codec_given_twice_is_measured_once(tiny_llama_dir, tmp_path, capsys):
    """``-c int4h -c int4h:32/64`` (one canonical spec) and ``-c int8 -c int8`` are measured once each,
    with a one-line note per repeat: not "4/2 identical" and double the bytes."""
    base = ["quality", _data(tmp_path), "--model", str(tiny_llama_dir), "-n", "2", "-q", "--format", "json",
            "--chunk-tokens", "16"]  # fmt: skip
    code, out, err = run_main(capsys, *base, "-c", "int4h", "-c", "int8", "-c", "int4h:32/64", "-c", "int8")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["codec"] for r in rows] == ["int4h:32/64+zstd:1", "int8:128/64"]
    assert all(r["identical"] <= r["rows"] == 2 for r in rows)
    assert err.count("\n") == 2
    assert "--codec int4h:32/64 is int4h:32/64+zstd:1, given already: measured once" in err
    assert "--codec int8 is int8:128/64, given already: measured once" in err
    code, once, _ = run_main(capsys, *base, "-c", "int4h", "-c", "int8")
    assert code == 0 and json.loads(once) == rows  # the same figures as each codec given once


def test_kl_is_never_negative_and_never_hides_a_real_difference():
    """float32 log-probabilities sum to 1 only to within their rounding: the old ``sum(p (a - b))``
    gave a negative mean KL for two copies of one distribution. Now float64 on both renormalized,
    0 for the same distribution, positive for another."""
    import torch

    from kvstore.quality import _kl_top1

    ref = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    same = ref + 1e-6  # the same distribution, not normalized in float32
    assert float((ref.exp() * (ref - same)).sum(-1).mean()) < 0  # what the gate printed before
    kl, top1 = _kl_top1(ref, same)
    assert 0 <= kl < 1e-12 and top1 == 1
    other = ref + 1e-2 * torch.randn(6, 1000, generator=torch.Generator().manual_seed(1))
    assert _kl_top1(ref, other)[0] > 1e-6


def test_the_floor_is_the_reference_path_against_itself(tiny_llama_dir, tmp_path, capsys):
    """Every result carries ``kl_floor``, the lossless cache through the path the codecs take; the
    table prints it. In float64 it is float64 rounding (< 1e-12)."""
    base = ["quality", _data(tmp_path), "--model", str(tiny_llama_dir), "--dtype", "float64", "-n", "3", "-q",
            "-c", "int8", "-c", "int4"]  # fmt: skip
    code, out, err = run_main(capsys, *base, "--format", "json")
    assert code == 0, err
    rows = json.loads(out)
    assert len({r["kl_floor"] for r in rows}) == 1 and 0 <= rows[0]["kl_floor"] < 1e-12
    assert all(r["kl_kv"] > 1e3 * rows[0]["kl_floor"] for r in rows)
    code, out, _ = run_main(capsys, *base)
    assert code == 0 and "KL floor 0.00000: the lossless cache itself through the gate's path" in out


def test_in_bfloat16_the_floor_is_reported(real_model, tmp_path, capsys):
    """SmolLM2 in bfloat16: teacher-forcing the lossless cache (the codecs' path) moves the
    next-token distributions against the step-by-step reference by a KL far above float32's (7.4e-4
    on two rows here, with int8 at 1.3e-3): the floor a codec's KL is read against."""
    base = ["quality", _data(tmp_path), "--model", "default", "--dtype", "bfloat16", "-n", "4", "-q", "--limit", "1",
            "-c", "int8", "--format", "json"]  # fmt: skip
    code, out, err = run_main(capsys, *base)
    assert code == 0, err
    (row,) = json.loads(out)
    assert row["kl_floor"] > 1e-6 and row["kl_kv"] >= 0


# -- int4h:k8=L / v8=L naming a layer the model lacks (issue 45, finding 6) --------------------------------
def test_a_layer_the_model_lacks_is_refused_in_one_line(tiny_llama_dir, tmp_path, capsys):
    base = ["quality", _data(tmp_path), "--model", str(tiny_llama_dir), "-n", "2", "-q", "--limit", "1"]
    for spec, layer in (("int4h:k8=99", 99), ("int4h:k8=1:v8=0.2", 2)):
        code, _, err = run_main(capsys, *base, "-c", "int8", "-c", spec)
        assert code == 1 and err.count("\n") == 1, err
        assert f"names layer {layer}, but the model has 2 layers (0 to 1)" in err
    code, _, err = run_main(capsys, *base, "-c", "int4h:k8=1:v8=0")
    assert code == 0, err
