"""``kvstore quality --sweep`` on a tiny saved model: per-layer damage of keys and values, candidates
measured within the budget, and a recommended spec that parses and builds a store; the allocation's
pieces on their own."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_cli_quality import _data

from helpers.cli import run_main
from kvstore.cli.main import app
from kvstore.codec_sweep import LayerDamage, SweepOptions, allocate, plan_spec, spec_bits
from kvstore.store.codecs import get_codec


def _sweep(tiny_llama_dir, tmp_path, *extra: str):
    args = ["quality", _data(tmp_path), "--model", str(tiny_llama_dir), "--dtype", "float32", "--sweep", "-n", "3",
            "--chunk-tokens", "16", "-q", *extra]  # fmt: skip
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_the_sweep_recommends_a_spec_that_builds(tiny_llama_dir, tmp_path, capsys):
    result = _sweep(tiny_llama_dir, tmp_path, "--budget", "0.4", "--format", "json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    n_layers = len(got["damage"])
    assert n_layers >= 2 and all(d["keys"] >= -1e-9 and d["values"] >= -1e-9 for d in got["damage"])
    assert any(d["keys"] > 0 for d in got["damage"]) and any(d["values"] > 0 for d in got["damage"])
    specs = [c["codec"] for c in got["candidates"]]
    assert got["best"] in specs and 1 <= len(specs) <= 4  # one per tail, and each refitted once at most
    for c in got["candidates"][:2]:  # within the budget by kvh's accounting scaled by the probe's overhead
        assert got["bits"][c["codec"]] * got["overhead"] <= 0.4 * 32 + 1e-9
    for c in got["candidates"]:
        assert c["rows"] == 2 and get_codec(c["codec"]).spec == c["codec"]  # a plain spec, as printed
    best = next(c for c in got["candidates"] if c["codec"] == got["best"])
    fits = [c for c in got["candidates"] if c["size_vs_f32"] <= 0.4]
    assert (
        best["size_vs_f32"] <= 0.4 if fits else best["size_vs_f32"] == min(c["size_vs_f32"] for c in got["candidates"])
    )
    # the recommended spec is one build --codec takes, and the store answers from it
    data = _data(tmp_path)
    common = ["--model", str(tiny_llama_dir), "--quiet", "--format", "json", "--no-chat"]
    code, out, err = run_main(capsys, "build", data, *common, "--store", tmp_path / "s", "--codec", got["best"])
    assert code == 0, err
    assert json.loads(out)["codec"] == got["best"]


def test_the_sweep_table_and_bad_input(tiny_llama_dir, tmp_path, capsys):
    result = _sweep(tiny_llama_dir, tmp_path, "--limit", "1", "--budget", "0.4")
    assert result.exit_code == 0, result.output
    assert "KL keys only" in result.stdout and "recommended: kvh:" in result.stdout
    base = ["quality", _data(tmp_path), "--model", str(tiny_llama_dir), "-q", "-n", "2", "--limit", "1"]
    code, _, err = run_main(capsys, *base, "--sweep", "-c", "int8")
    assert code == 1 and err.count("\n") == 1 and "one of the three" in err
    code, _, err = run_main(capsys, *base)
    assert code == 1 and err.count("\n") == 1 and "--sweep" in err
    code, _, err = run_main(capsys, *base, "--sweep", "--budget", "0.05")
    assert code == 1 and err.count("\n") == 1 and "no kvh spec fits a budget of 0.05" in err


def test_spec_of_lists_the_layers_off_the_common_width():
    keys, values = [8, 5, 5, 5], [4, 8, 4, 3]
    plan = {(i, "keys"): w for i, w in enumerate(keys)} | {(i, "values"): w for i, w in enumerate(values)}
    spec = plan_spec(plan, 4, tail=32)
    assert spec == "kvh:5/4:32/32:t=32:k8=0:v8=1:v3=3"
    q = get_codec(spec).quantizer
    assert [q.width_of("keys", f"layers.{i}.keys").bits for i in range(4)] == keys
    assert [q.width_of("values", f"layers.{i}.values").bits for i in range(4)] == values


def test_allocation_spends_the_budget_where_the_damage_is():
    """Layer 2's keys and layer 0's values hurt most: they get the widest codes the budget allows;
    the spec stays within the budget by kvh's own accounting, and a larger budget never predicts
    more damage."""
    damage = [LayerDamage(0, 1e-4, 5e-2), LayerDamage(1, 1e-4, 1e-4), LayerDamage(2, 5e-2, 1e-4)]
    opts = SweepOptions(budget=0.16)
    spec = allocate(damage, opts, head_dim=64)
    q = get_codec(spec).quantizer
    assert spec_bits(spec, 64, 3) <= 0.16 * 32
    keys = [q.width_of("keys", f"layers.{i}.keys").bits for i in range(3)]
    values = [q.width_of("values", f"layers.{i}.values").bits for i in range(3)]
    assert keys[2] == max(keys) > min(keys) and values[0] == max(values) > min(values)
    wide = allocate(damage, SweepOptions(budget=0.3), head_dim=64)
    assert spec_bits(wide, 64, 3) > spec_bits(spec, 64, 3)
    with pytest.raises(Exception, match="no kvh spec fits"):
        allocate(damage, SweepOptions(budget=0.05), head_dim=64)


def test_a_candidate_over_the_budget_is_allocated_again_with_its_own_ratio(monkeypatch):
    """The gate measures a candidate 5% over its nominal bytes: the sweep allocates that tail again
    with the measured ratio (a narrower spec) and measures it; the recommendation fits the budget."""
    from kvstore import codec_sweep
    from kvstore.quality import CodecQuality

    damage = [LayerDamage(i, 1e-4 * (i + 1), 1e-4) for i in range(3)]
    monkeypatch.setattr(codec_sweep, "layer_damage", lambda *a, **k: (damage, 64, 1.0))
    calls = []

    def gate(adapter, rows, specs, **kwargs):
        calls.append(list(specs))
        return [
            CodecQuality(codec=get_codec(s).spec, rows=1, new_tokens=1, identical=1, common_prefix=1.0,
                         kl={"kv": 1e-4}, top1={"kv": 1.0}, size_vs_f32=1.05 * spec_bits(s, 64, 3) / 32)
            for s in specs
        ]  # fmt: skip

    monkeypatch.setattr(codec_sweep, "quality_gate", gate)
    opts = SweepOptions(budget=0.2, tails=(0,))
    result = codec_sweep.sweep(None, [object()], opts)  # type: ignore[list-item]
    assert len(calls) == 2 and calls[1] != calls[0]
    assert spec_bits(calls[1][0], 64, 3) * 1.05 <= 0.2 * 32 < spec_bits(calls[0][0], 64, 3) * 1.05
    assert result.best == get_codec(calls[1][0]).spec and len(result.candidates) == 2
