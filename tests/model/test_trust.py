"""No stale hit, ever: every way a cache could be served to a model it was not computed by.

Each test builds a store with a saved tiny model, changes one thing about the model (its config,
its weights in place, its tokenizer...), then answers from the same store through the real CLI:
the change must make the stored caches misses (or be shown not to change the tensors), and the
answers must equal ``--no-cache`` row for row.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from helpers.cli import read_predictions, run_main, write_dataset

N_CONTEXTS = 4


@pytest.fixture
def model_copy(request, tmp_path: Path) -> Path:
    """A private copy of a tiny saved model (``request.param``: neox or llama) we may edit."""
    src = request.getfixturevalue(f"tiny_{request.param}_dir")
    dst = tmp_path / f"model-{request.param}"
    shutil.copytree(src, dst)
    return dst


def _sample(capsys, dataset: Path, model: Path, store: Path, out: Path, *extra: str) -> dict[str, dict]:
    code, _, err = run_main(
        capsys, "sample", dataset, "--model", model, "--store", store, "--dtype", "float64",
        "--quiet", "--format", "json", "-n", "6", "-o", out, *extra,
    )  # fmt: skip
    assert code == 0, err
    return read_predictions(out)


def _build(capsys, dataset: Path, model: Path, store: Path) -> dict:
    code, out, err = run_main(
        capsys,
        "build",
        dataset,
        "--model",
        model,
        "--store",
        store,
        "--dtype",
        "float64",
        "--quiet",
        "--format",
        "json",
    )
    assert code == 0, err
    return json.loads(out)


def _edit_config(model: Path, edit) -> None:
    path = model / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def _assert_misses_and_exact(capsys, tmp_path, dataset, model, store, before: dict[str, dict]) -> None:
    cached = _sample(capsys, dataset, model, store, tmp_path / "after.jsonl")
    reference = _sample(capsys, dataset, model, store, tmp_path / "reference.jsonl", "--no-cache")
    assert not any(r["cache_hit"] for r in cached.values()), "a changed model was served the old caches"
    assert {k: r["raw_output"] for k, r in cached.items()} == {k: r["raw_output"] for k, r in reference.items()}
    # the edit matters: the model answers differently than before it (else the test proves nothing)
    assert any(reference[k]["raw_output"] != before[k]["raw_output"] for k in before)


CONFIG_EDITS = {
    "llama-rope-theta": ("llama", lambda c: c["rope_parameters"].update(rope_theta=10.0)),
    "llama-rms-norm-eps": ("llama", lambda c: c.update(rms_norm_eps=1.0)),
    "neox-layer-norm-eps": ("neox", lambda c: c.update(layer_norm_eps=1.0)),
    "neox-rotary-pct": ("neox", lambda c: c["rope_parameters"].update(partial_rotary_factor=1.0)),
}


@pytest.mark.parametrize(
    "model_copy, edit",
    [pytest.param(kind, edit, id=name) for name, (kind, edit) in CONFIG_EDITS.items()],
    indirect=["model_copy"],
)
def test_config_edit_is_a_miss(model_copy, edit, tmp_path, capsys):
    dataset = write_dataset(tmp_path / "data.jsonl", range(N_CONTEXTS))
    store = tmp_path / "store"
    _build(capsys, dataset, model_copy, store)
    before = _sample(capsys, dataset, model_copy, store, tmp_path / "before.jsonl")
    assert all(r["cache_hit"] for r in before.values())
    _edit_config(model_copy, edit)
    _assert_misses_and_exact(capsys, tmp_path, dataset, model_copy, store, before)


@pytest.mark.parametrize("model_copy", ["llama"], indirect=True)
def test_cosmetic_config_resave_still_hits(model_copy, tmp_path, capsys):
    """Same config, other key order and whitespace (and a fresh mtime): the same caches."""
    dataset = write_dataset(tmp_path / "data.jsonl", range(N_CONTEXTS))
    store = tmp_path / "store"
    _build(capsys, dataset, model_copy, store)
    path = model_copy / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(config.items()))), indent=7, sort_keys=False) + "\n\n")
    again = _sample(capsys, dataset, model_copy, store, tmp_path / "again.jsonl")
    assert all(r["cache_hit"] for r in again.values())


@pytest.mark.parametrize("model_copy", ["llama"], indirect=True)
def test_weights_edited_in_place_with_same_size_and_mtime_is_a_miss(model_copy, tmp_path, capsys):
    """A weight file rewritten in place, same size, its mtime set back: other weights, other caches."""
    dataset = write_dataset(tmp_path / "data.jsonl", range(N_CONTEXTS))
    store = tmp_path / "store"
    _build(capsys, dataset, model_copy, store)
    before = _sample(capsys, dataset, model_copy, store, tmp_path / "before.jsonl")
    weights = model_copy / "model.safetensors"
    st = weights.stat()
    blob = bytearray(weights.read_bytes())
    (n,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8 : 8 + n])
    name = next(k for k in sorted(header) if k.endswith("q_proj.weight"))
    begin, end = header[name]["data_offsets"]
    base = 8 + n
    blob[base + begin : base + end] = bytes(reversed(blob[base + begin : base + end]))  # same size, other values
    with open(weights, "r+b") as f:  # in place: same inode
        f.write(blob)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns, weights.stat().st_ino) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )
    _assert_misses_and_exact(capsys, tmp_path, dataset, model_copy, store, before)


@pytest.mark.parametrize("model_copy", ["neox"], indirect=True)
def test_tokenizer_change_that_changes_ids_is_a_miss(model_copy, tmp_path, capsys):
    """Keys hash token ids: a tokenizer that splits the contexts differently finds no cache (and
    one that gives the same ids is the same computation, so reusing its cache is exact)."""
    dataset = write_dataset(tmp_path / "data.jsonl", range(N_CONTEXTS))
    store = tmp_path / "store"
    _build(capsys, dataset, model_copy, store)
    before = _sample(capsys, dataset, model_copy, store, tmp_path / "before.jsonl")
    path = model_copy / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["model"]["merges"] = tok["model"]["merges"][: len(tok["model"]["merges"]) // 2]  # coarser splits
    path.write_text(json.dumps(tok))
    _assert_misses_and_exact(capsys, tmp_path, dataset, model_copy, store, before)


@pytest.mark.parametrize("model_copy", ["llama"], indirect=True)
def test_weights_digest_is_memoized_by_file_identity(model_copy, monkeypatch):
    """Unchanged files: the weights are hashed once; touching a file (new ctime) or editing the
    config hashes them again."""
    from kvstore.model.adapter import Adapter
    from kvstore.model.load import identity

    calls = []
    real = identity.weights_digest
    monkeypatch.setattr(identity, "weights_digest", lambda model: calls.append(1) or real(model))

    def fingerprint() -> str:
        return Adapter.from_pretrained(str(model_copy), dtype="float32").fingerprint

    first = fingerprint()
    assert fingerprint() == first and len(calls) == 1
    os.utime(model_copy / "model.safetensors")  # same bytes, new mtime and ctime: hashed again, same result
    assert fingerprint() == first and len(calls) == 2
    _edit_config(model_copy, lambda c: c.update(rms_norm_eps=0.5))
    assert fingerprint() != first and len(calls) == 3
