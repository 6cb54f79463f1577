"""Caches out and in: `kvstore export` (plain safetensors files) and `kvstore import-llminference`
(the research code's torch.save files), through the CLI on a tiny saved model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers.cli import read_predictions, run_main, write_dataset
from kvstore.model.adapter import Adapter
from kvstore.model.llminference import cache_name
from kvstore.store.kvstore import KVStore


def test_export_writes_plain_safetensors_per_context(tiny_llama_dir, tmp_path, capsys):
    dataset = write_dataset(tmp_path / "data.jsonl", range(3))
    store = tmp_path / "store"
    common = ["--model", tiny_llama_dir, "--store", store, "--quiet", "--dtype", "float64"]
    assert run_main(capsys, "build", dataset, *common)[0] == 0
    out = tmp_path / "exported"
    code, stdout, err = run_main(capsys, "export", "--store", store, str(out), "--quiet", "--format", "json")
    assert code == 0, err
    assert json.loads(stdout)["written"] == 3
    adapter = Adapter.from_pretrained(str(tiny_llama_dir), dtype="float64")
    with KVStore(str(store), readonly=True) as s:
        for c in s.scan().contexts:
            tensors = load_file(out / f"{c.key}.safetensors")
            n = c.n_tokens
            assert tensors["token_ids"].shape == (n,) and tensors["layers.0.keys"].shape == (2, n, 16)
            assert tensors["layers.1.values"].dtype == torch.float64 and "layers.0.positions" not in tensors
            # the same keys and values as computing the context now
            fresh = adapter.prefill([tensors["token_ids"].tolist()])[0]
            torch.testing.assert_close(tensors["layers.1.keys"], fresh[1][0], atol=1e-10, rtol=0)
            with safe_open(out / f"{c.key}.safetensors", "pt") as f:
                meta = f.metadata()
            assert (meta["key"], meta["model"], meta["dtype"], meta["n_tokens"]) == (c.key, c.model, "float64", str(n))
            assert json.loads(meta["chunks"]) == list(c.chunks) and json.loads(meta["numerics"])["device"] == "cpu"
    again = run_main(capsys, "export", "--store", store, str(out), "--quiet")
    assert again[0] == 0 and "0 context(s)" in again[1] and "3 already there" in again[1]


def test_export_into_an_unwritable_place_is_one_line(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """Before: a generic "OSError: [Errno 13] ..." line (issue 31, also seen)."""
    import tempfile

    dataset = write_dataset(tmp_path / "data.jsonl", range(2), questions=1)
    store = tmp_path / "store"
    assert run_main(capsys, "build", dataset, "--model", tiny_llama_dir, "--store", store, "--quiet")[0] == 0
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out, err = run_main(capsys, "export", "--store", store, str(blocker / "out"), "--quiet")
    assert code == 1 and out == ""
    assert err == (
        f"kvstore: error: cannot export into {blocker / 'out'}: Not a directory; give a directory you can write to "
        "(the store is unchanged, and files already exported there are kept)\n"
    )

    def refused(*args, **kwargs):  # a read-only directory (root writes anywhere, so it is simulated)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    code, out, err = run_main(capsys, "export", "--store", store, str(tmp_path / "ro"), "--quiet")
    assert code == 1 and err == (
        f"kvstore: error: cannot export into {tmp_path / 'ro'}: Permission denied; give a directory you can write "
        "to (the store is unchanged, and files already exported there are kept)\n"
    )
    assert list((tmp_path / "ro").iterdir()) == []


def _write_llminference_cache(adapter: Adapter, directory, contexts, limit: int, config_json: str) -> None:
    """What the research code wrote: per context, torch.save of (layers, 2, 1, heads, tokens, dim)."""
    directory.mkdir()
    for text in contexts:
        ids = adapter.encode_context(text)[-limit:]
        layers = adapter.prefill([ids])[0]
        t = torch.stack([torch.stack([k, v]) for k, v in layers]).unsqueeze(2).clone()
        torch.save(t, directory / f"{cache_name(config_json, text, limit)}.pt")


def test_import_llminference_then_sample_equals_no_cache(tiny_neox_dir, tmp_path, capsys):
    adapter = Adapter.from_pretrained(str(tiny_neox_dir), dtype="float64")
    dataset = write_dataset(tmp_path / "data.jsonl", range(4), questions=2)
    contexts = list(dict.fromkeys(json.loads(x)["context"] for x in dataset.read_text().splitlines()))
    config_json = tmp_path / "config.json"  # what transformers wrote when llminference ran
    config_json.write_text(adapter.model.config.to_json_string(use_diff=False))
    cache = tmp_path / "llminference-cache"
    _write_llminference_cache(adapter, cache, contexts[:3], 256, config_json.read_text())
    torch.save(torch.zeros(2, 2, 1, 2, 5, 16, dtype=torch.float64), cache / f"{'0' * 32}.pt")  # matches nothing
    store = tmp_path / "store"
    code, out, err = run_main(
        capsys, "import-llminference", cache, dataset, "--model", tiny_neox_dir, "--dtype", "float64",
        "--max-context-length", "256", "--config-json", config_json, "--store", store, "--quiet", "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert (report["imported"], report["missing"], report["unmatched_files"], report["checked"]) == (3, 1, 1, 3)
    assert report["max_abs_diff"] < 1e-10 and report["unmatched"] == [f"{'0' * 32}.pt"]
    common = ["--model", tiny_neox_dir, "--store", store, "--dtype", "float64", "--no-chat", "-n", "5", "--quiet"]
    assert run_main(capsys, "sample", dataset, *common, "-o", tmp_path / "a.jsonl", "--readonly-store")[0] == 0
    assert run_main(capsys, "sample", dataset, *common, "-o", tmp_path / "b.jsonl", "--no-cache")[0] == 0
    cached, reference = read_predictions(tmp_path / "a.jsonl"), read_predictions(tmp_path / "b.jsonl")
    assert {k: r["raw_output"] for k, r in cached.items()} == {k: r["raw_output"] for k, r in reference.items()}
    assert sum(r["cache_hit"] for r in cached.values()) == 6  # 3 imported contexts x 2 questions


def _cache_of(model_dir, tmp_path, n: int, limit: int):
    """A dataset of ``n`` contexts and llminference's caches of all of them: (dataset, contexts,
    config JSON, cache directory)."""
    adapter = Adapter.from_pretrained(str(model_dir), dtype="float64")
    dataset = write_dataset(tmp_path / "data.jsonl", range(n), questions=1)
    contexts = list(dict.fromkeys(json.loads(x)["context"] for x in dataset.read_text().splitlines()))
    config = adapter.model.config.to_json_string(use_diff=False)
    cache = tmp_path / "cache"
    _write_llminference_cache(adapter, cache, contexts, limit, config)
    return dataset, contexts, config, cache


@pytest.mark.parametrize("problem", ["wrong-values", "wrong-limit"])
def test_import_refuses_caches_of_another_computation(problem, tiny_neox_dir, tmp_path, capsys):
    dataset, _, _, cache = _cache_of(tiny_neox_dir, tmp_path, 2, 64)
    if problem == "wrong-values":  # e.g. computed by other weights of the same shape
        for path in cache.glob("*.pt"):
            t = torch.load(path, weights_only=True)
            torch.save(t + 0.01, path)
    limit = "64" if problem == "wrong-values" else "65"
    code, out, err = run_main(
        capsys, "import-llminference", cache, dataset, "--model", tiny_neox_dir, "--dtype", "float64",
        "--max-context-length", limit, "--store", tmp_path / "store", "--quiet",
    )  # fmt: skip
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert ("do not match this model" in err) if problem == "wrong-values" else ("matches a context" in err)
    with KVStore(str(tmp_path / "store"), readonly=True) as s:
        assert len(s) == 0  # nothing stored


class _Hostile:
    """Unpickling this would run a shell command (weights_only refuses it before anything runs)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_import_rejects_each_bad_file_in_one_line_and_imports_the_rest(tiny_neox_dir, tmp_path, capsys):
    """A raw pickle and a torch archive that would each run code (hostile), a truncated archive and
    one of the wrong shape: one rejection line each, naming the file and why (a hostile one: what its
    pickle would call, never torch's advice to load it without weights_only), the good files
    imported, exit 0 (issue 31, item 4; issue 36, item 3)."""
    import pickle

    dataset, contexts, config, cache = _cache_of(tiny_neox_dir, tmp_path, 6, 256)
    path = {i: cache / f"{cache_name(config, contexts[i], 256)}.pt" for i in range(6)}
    marker = tmp_path / "pwned"
    path[2].write_bytes(pickle.dumps(_Hostile(marker)))
    path[3].write_bytes(path[3].read_bytes()[:200])  # truncated
    torch.save(torch.zeros(2, 2, 1, 2, 3, 16, dtype=torch.float64), path[4])  # wrong shape
    torch.save(_Hostile(marker), path[5])  # a real torch archive whose pickle would run a command
    args = ["import-llminference", cache, dataset, "--model", tiny_neox_dir, "--dtype", "float64",
            "--max-context-length", "256", "--quiet"]  # fmt: skip
    code, out, err = run_main(capsys, *args, "--store", tmp_path / "store")
    assert code == 0, err
    assert not marker.exists()  # nothing ran
    rejected = [line for line in out.splitlines() if line.startswith("rejected")]
    assert {line.split()[1].rstrip(":") for line in rejected} == {path[i].name for i in (2, 3, 4, 5)}
    hostile = (
        "is not a plain tensor file (refused: its pickle would call posix.system, which could run code; nothing ran)"
    )
    for i in (2, 5):
        assert f"rejected   {path[i].name}: {hostile}" in rejected
    assert "weights_only" not in out and "Re-running" not in out  # torch's advice is not repeated
    assert "is (2, 2, 1, 2, 3, 16)" in out
    assert "is not a readable tensor file (" in out  # the truncated one
    assert out.startswith("Imported 2 context(s)") and err == ""
    with KVStore(str(tmp_path / "store"), readonly=True) as s:
        assert len(s.context_keys()) == 2 and not s.verify().corrupt
    # nothing importable at all: exit 1, still one line per file
    for i in (0, 1):
        path[i].write_bytes(b"not a tensor")
    code, out, err = run_main(capsys, *args, "--store", tmp_path / "other")
    assert code == 1 and len([line for line in out.splitlines() if line.startswith("rejected")]) == 6
    assert err == (
        f"kvstore: error: none of the 6 llminference cache(s) in {cache} that match a context of {dataset} could be "
        "imported (each is listed above with why)\n"
    )
