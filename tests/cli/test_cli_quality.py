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
