"""The codec a new store gets when ``build`` names none: chosen by the device the caches are
computed on (``raw`` on CUDA, the lossless default on a CPU), recorded in the store with its
reason, printed once by ``build`` and shown by ``stats``. No GPU here: the device ``build`` sees
is replaced (``cli.flags.build_device``), the seam between the model's device and the store."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvstore.cli import flags
from kvstore.cli.main import app
from kvstore.store.codecs import DEFAULT_CODEC
from kvstore.store.codecs import choice as codec_choice
from kvstore.store.codecs.choice import CodecChoice, choose_codec
from kvstore.store.kvstore import KVStore


def test_the_choice_by_device():
    assert choose_codec("cpu") == CodecChoice(DEFAULT_CODEC)
    for decoder in (False, True):
        got = choose_codec("cuda", device_decoder=decoder)
        assert got.spec == "raw" and "CUDA" in got.reason and "docs/gpu.md" in got.reason


def test_a_measurement_showing_device_decoding_faster_switches_cuda_to_the_default(monkeypatch):
    monkeypatch.setattr(codec_choice, "DEVICE_DECODED_FASTER", True)
    assert choose_codec("cuda", device_decoder=True).spec == DEFAULT_CODEC
    assert choose_codec("cuda", device_decoder=False).spec == "raw"  # without nvCOMP the CPU would decode


def test_the_choice_is_recorded_by_a_new_store_only(tmp_path):
    path = str(tmp_path / "s")
    why = CodecChoice("raw", "built on CUDA: a reason")
    with KVStore(path, default_codec=why) as store:
        assert store.meta.new and store.codec.spec == "raw" and store.meta.codec_reason == why.reason
    with KVStore(path, default_codec=CodecChoice(DEFAULT_CODEC, "another")) as store:  # an existing store keeps its own
        assert not store.meta.new and store.codec.spec == "raw" and store.meta.codec_reason == why.reason
        assert store.scan().codec_reason == why.reason
    with KVStore(str(tmp_path / "named"), codec="zstd:1", default_codec=why) as store:  # a named codec wins
        assert store.codec.spec == "zstd:1" and store.meta.codec_reason == ""
    with KVStore(str(tmp_path / "plain")) as store:  # no reason: the description keeps its old keys
        assert set(json.loads(store.meta.record())) == {"format", "codec", "chunk_tokens", "created"}


@pytest.fixture
def data(tmp_path):
    rows = [{"id": f"r{i}", "context": f"Room {i} has a red door and {i} chairs.", "question": "What colour?",
             "answers": ["red"]} for i in range(2)]  # fmt: skip
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _invoke(args):
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_build_chooses_prints_once_and_stats_shows(tiny_llama_dir, data, tmp_path, monkeypatch, device):
    monkeypatch.setattr(flags, "build_device", lambda adapter: device)
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_llama_dir), "--store", store, "--quiet", "--format", "json"]
    first = _invoke(["build", str(data), *common])
    again = _invoke(["build", str(data), *common])
    stats = json.loads(_invoke(["stats", "--store", store, "--format", "json"]).stdout)
    text = _invoke(["stats", "--store", store]).stdout
    if device == "cuda":
        assert first.stderr.count("codec raw (built on CUDA") == 1 and "codec raw" not in again.stderr
        assert json.loads(first.stdout)["codec"] == "raw"
        assert stats["codec"] == "raw" and stats["codec_reason"].startswith("built on CUDA")
        assert "Codec raw: built on CUDA" in text
    else:
        assert "new store" not in first.stderr
        assert json.loads(first.stdout)["codec"] == DEFAULT_CODEC
        assert stats["codec"] == DEFAULT_CODEC and stats["codec_reason"] == "" and "Codec " not in text


def test_a_named_codec_on_cuda_is_used_as_given(tiny_llama_dir, data, tmp_path, monkeypatch):
    monkeypatch.setattr(flags, "build_device", lambda adapter: "cuda")
    store = str(tmp_path / "store")
    built = _invoke(["build", str(data), "--model", str(tiny_llama_dir), "--store", store, "--quiet", "--format",
                     "json", "--codec", "zstd-split:1:16"])  # fmt: skip
    assert json.loads(built.stdout)["codec"] == "zstd-split:1:16" and "new store" not in built.stderr
    assert json.loads(_invoke(["stats", "--store", store, "--format", "json"]).stdout)["codec_reason"] == ""
