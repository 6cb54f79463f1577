"""Reliability: crashes, corruption, concurrency, limits, foreign caches, hostile entries.

Each section proves one claim of the reliability issue on the real ``kvstore`` commands with the
tiny saved models. The CI versions are small (a few trials); the soak (``tests/reliability/test_soak.py``,
``KVSTORE_SOAK=1``) runs the same trials (``tests/helpers/trials.py``) hundreds of times and writes
the figures down. Section 6 (bad input, Ctrl-C) is ``test_cli_errors.py``; the decoder fuzz is
``test_fuzz.py``. Commands that must run in their own process are forked from a zygote
(``tests/helpers/cli.py``).
"""

from __future__ import annotations

import json
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import (
    REPO,
    WARNING_RE,
    build_argv,
    context_keys,
    context_text,
    nonblank_lines,
    read_predictions,
    run_main,
    store_keys,
    verify_store,
    write_dataset,
    zygote,
)
from helpers.entries import hostile_entries
from helpers.trials import concurrency_run, corruption_round, damage_entries, kill_trial

# == 1. crash during build ===========================================================================


def test_kill_9_during_build_loses_nothing(tiny_llama_dir, tmp_path, capsys):
    """Three kill -9 in a row on one store (each build resuming the last), then a clean finish."""
    n_contexts = 60
    dataset = write_dataset(tmp_path / "data.jsonl", range(n_contexts), questions=1, words=(30, 90))
    store = tmp_path / "store"
    argv = build_argv(dataset, tiny_llama_dir, store, "--batch-size", "1")
    rng = random.Random(20240601)
    results = []
    # right after a commit, a little later, then at any moment (loading, prefilling, committing...)
    for trial, (mode, window) in enumerate([("after-write", 0.0), ("after-write", 0.3), ("uniform", 1.0)]):
        r = kill_trial(argv, store, tmp_path / "logs", rng, mode=mode, window=window, name=f"kill{trial}")
        results.append(r)
        if trial == 1:
            assert len(store_keys(store)) < n_contexts, results  # the build was cut short: something to resume
        assert r.lost == 0 and r.corrupt == 0, r
        assert r.exitcode == -signal.SIGKILL or (not r.killed and r.exitcode == 0), r
        if r.after:
            code, out, err = run_main(capsys, "verify", "--store", store, "--quiet")
            assert code == 0 and "all intact" in out, err
    assert results[0].killed and results[0].seen > results[0].before, results  # a kill hit a build mid-write
    present = store_keys(store)
    from kvstore.store.kvstore import KVStore

    with KVStore(str(store)):
        pass  # the store opens for writing after the kills (LMDB recovers the dead writer's lock)
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["contexts"] == n_contexts
    # skipped: the contexts with a record, plus any whose chunks were all written when a kill came
    # between its last chunk and its record (at most one per kill: the writer goes context by context)
    assert len(present) <= summary["skipped"] <= len(present) + 3, summary
    assert summary["built"] == n_contexts - summary["skipped"]
    intact, corrupt = verify_store(store)
    assert not corrupt and len(intact) == n_contexts and present <= intact
    assert (
        set(context_keys(tiny_llama_dir, [context_text(i, words=(30, 90)) for i in range(n_contexts)]).values())
        == intact
    )


# == 2. corruption ====================================================================================


def test_corrupt_entries_are_detected_recomputed_and_collected(tiny_llama_dir, tmp_path, capsys):
    import re

    n_contexts, n_bad = 8, 3
    contexts = [context_text(i) for i in range(n_contexts)]
    dataset = write_dataset(tmp_path / "data.jsonl", range(n_contexts))
    store = tmp_path / "store"
    common = ["--model", tiny_llama_dir, "--store", store, "--dtype", "float64", "--quiet"]
    assert run_main(capsys, "build", dataset, *common)[0] == 0
    keys = context_keys(tiny_llama_dir, contexts, dtype="float64")
    assert store_keys(store) == set(keys.values())

    rng = random.Random(7)
    bad = rng.sample(sorted(keys.values()), n_bad)
    damage_entries(store, bad, rng)

    # verify names exactly the damaged entries
    code, out, err = run_main(capsys, "verify", "--store", store, "--quiet")
    assert (
        code == 1
        and err
        == f"kvstore: error: {n_bad} of {n_contexts + 1} entries corrupt; {n_bad} of {n_contexts} contexts "
        "broken; `kvstore gc --corrupt` removes corrupt entries\n"  # + 1: the chat head, shared by every context
    )
    assert {line.split()[1] for line in out.splitlines() if line.startswith("corrupt")} == set(bad)

    # sample: misses for the damaged contexts (one warning line each), same answers as --no-cache
    code, out, err = run_main(
        capsys, "sample", dataset, *common, "--readonly-store", "--format", "json", "-o", tmp_path / "cached.jsonl"
    )
    assert code == 0, err
    warned = [re.match(WARNING_RE, line) for line in nonblank_lines(err)]
    assert all(warned), err
    assert {m.group(1) for m in warned} == {k[:16] for k in bad}
    code, _, err = run_main(
        capsys, "sample", dataset, *common, "--no-cache", "--format", "json", "-o", tmp_path / "reference.jsonl"
    )
    assert code == 0, err
    cached, reference = read_predictions(tmp_path / "cached.jsonl"), read_predictions(tmp_path / "reference.jsonl")
    assert {i: r["raw_output"] for i, r in cached.items()} == {i: r["raw_output"] for i, r in reference.items()}
    context_of = {f"c{i}-q{q}": contexts[i] for i in range(n_contexts) for q in range(2)}
    assert {i: r["cache_hit"] for i, r in cached.items()} == {i: keys[context_of[i]] not in bad for i in cached}

    # gc removes exactly the damaged entries
    code, out, err = run_main(capsys, "gc", "--corrupt", "--yes", "--store", store, "--quiet")
    assert code == 0 and f"Removed {n_bad} contexts and {n_bad} entries" in out, err
    intact, corrupt = verify_store(store)
    assert not corrupt and intact == set(keys.values()) - set(bad)

    # a writable sample recomputes what is missing and repairs a damaged entry in place
    damage_entries(store, [sorted(intact)[0]], rng)
    code, out, err = run_main(capsys, "sample", dataset, *common, "--format", "json", "-o", tmp_path / "repaired.jsonl")
    assert code == 0 and len(nonblank_lines(err)) == 1 and re.match(WARNING_RE, err.strip()), err
    repaired = read_predictions(tmp_path / "repaired.jsonl")
    assert {i: r["raw_output"] for i, r in repaired.items()} == {i: r["raw_output"] for i, r in reference.items()}
    intact, corrupt = verify_store(store)
    assert not corrupt and intact == set(keys.values())


def test_random_corruptions_are_all_detected(tiny_llama_dir, tmp_path, capsys):
    """A few rounds of what the soak script does >= 1000 times."""
    dataset = write_dataset(tmp_path / "data.jsonl", range(12), questions=1)
    store = tmp_path / "store"
    assert run_main(capsys, "build", dataset, "--model", tiny_llama_dir, "--store", store, "--quiet")[0] == 0
    rng = random.Random(11)
    total = {"damaged": 0, "detected": 0, "false_alarms": 0}
    for _ in range(10):
        r = corruption_round(store, rng, rng.randint(1, 5))
        assert not r["missed"], r
        for k in total:
            total[k] += r[k]
    assert total["detected"] == total["damaged"] and total["false_alarms"] == 0
    intact, corrupt = verify_store(store)  # every round undid its damage
    assert len(intact) == 12 and not corrupt


# == 3. concurrency ===================================================================================


def test_concurrent_builders_and_samplers(tiny_llama_dir, tmp_path, capsys):
    n = 40
    run = concurrency_run(tiny_llama_dir, tmp_path, n_contexts=n)
    for name, (code, _out, err) in run["results"].items():
        assert code == 0, (name, err)
        assert "Traceback" not in err and "corrupt" not in err and "error" not in err, (name, err)
    store = run["store"]
    intact, corrupt = verify_store(store)
    expected = set(context_keys(tiny_llama_dir, [context_text(i) for i in range(n)], dtype="float64").values())
    assert not corrupt and intact == expected  # every context, once (keys are content addresses)
    assert store_keys(store) == expected  # nothing else (no stray or duplicate records)
    # readers saw only complete entries: their answers are the reference's
    union = write_dataset(tmp_path / "union.jsonl", range(n))
    code, _, err = run_main(
        capsys,
        "sample",
        union,
        "--model",
        tiny_llama_dir,
        "--dtype",
        "float64",
        "--no-cache",
        "--quiet",
        "--format",
        "json",
        "-o",
        tmp_path / "reference.jsonl",
    )
    assert code == 0, err
    reference = read_predictions(tmp_path / "reference.jsonl")
    for i in range(2):
        got = read_predictions(tmp_path / f"sample{i}.preds.jsonl")
        assert {k: r["raw_output"] for k, r in got.items()} == {k: reference[k]["raw_output"] for k in got}


# == 4. limits ========================================================================================
def test_lmdb_map_filling_up_grows_during_a_build(tiny_llama, tmp_path):
    """A store whose map starts at 64 KiB takes a whole build (~1 MB) through the writer thread."""
    from kvstore.model.adapter import Adapter
    from kvstore.store.kvstore import KVStore

    adapter = Adapter(*tiny_llama, name="tiny")
    contexts = [context_text(i) for i in range(24)]
    with KVStore(str(tmp_path / "store"), map_size=1 << 16) as s:
        report = adapter.generate_kv_cache(contexts, s, batch_size=4)
        grown = s.backend.env.info()["map_size"]
    assert report.built == 24 and report.stored_bytes > 4 * (1 << 16) and grown >= report.stored_bytes
    intact, corrupt = verify_store(tmp_path / "store")
    assert len(intact) == 24 and not corrupt


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (a disk that really fills up). Needs permission to mount: skipped otherwise."""
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a small tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_disk_full_is_one_clear_line_and_keeps_earlier_entries(tiny_llama_dir, small_fs, tmp_path, capsys):
    store = small_fs / "store"
    first = write_dataset(tmp_path / "first.jsonl", range(4), questions=1)
    common = ["--model", tiny_llama_dir, "--store", store, "--quiet", "--format", "json"]
    assert run_main(capsys, "build", first, *common)[0] == 0
    before = store_keys(store)
    assert len(before) == 4
    big = write_dataset(tmp_path / "big.jsonl", range(60), questions=1)  # ~2 MB of entries
    code, out, err = run_main(capsys, "build", big, *common)
    assert code == 1 and out == ""
    assert (
        err == f"kvstore: error: disk full while writing to {store}; the entries stored before are intact - free space "
        "and re-run\n"
    )
    intact, corrupt = verify_store(store)
    assert not corrupt and before <= intact and len(intact) < 60
    # free space and re-run: the build resumes
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_fs)], check=True, capture_output=True, timeout=30)
    code, out, err = run_main(capsys, "build", big, *common)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["skipped"] == len(intact) and summary["built"] == 60 - len(intact)
    intact, corrupt = verify_store(store)
    assert not corrupt and len(intact) == 60  # the first 4 contexts are among the 60


class _FailingEnv:
    """An LMDB environment whose write transactions fail to commit with ``error`` after
    ``ok_commits`` successful ones (a disk that fills up, simulated)."""

    def __init__(self, env, error: Exception, ok_commits: int):
        self._env, self._error, self._left = env, error, ok_commits

    def begin(self, *args, write: bool = False, **kwargs):
        txn = self._env.begin(*args, write=write, **kwargs)
        if not write:
            return txn
        if self._left > 0:
            self._left -= 1
            return txn
        env_error = self._error

        class Failing:
            def __enter__(self):
                return txn

            def __exit__(self, *exc):
                txn.abort()
                if exc[0] is None:
                    raise env_error
                return False

        return Failing()

    def __getattr__(self, name):
        return getattr(self._env, name)


def fail_lmdb_writes(monkeypatch, error: Exception, ok_commits: int = 0) -> None:
    import lmdb

    real_open = lmdb.open
    monkeypatch.setattr(lmdb, "open", lambda *a, **kw: _FailingEnv(real_open(*a, **kw), error, ok_commits))


@pytest.mark.parametrize(
    "message, free, expected",
    [
        ("mdb_txn_commit: No space left on device", 10 << 30, "StoreFullError"),
        ("mdb_txn_commit: Input/output error", 4096, "StoreFullError"),  # LMDB's word for a short write
        ("mdb_txn_commit: Input/output error", 10 << 30, "StoreError"),  # a real I/O error is not "disk full"
    ],
)
def test_simulated_write_failures(monkeypatch, tmp_path, message, free, expected):
    import types

    import lmdb

    import kvstore.errors as errors
    from helpers.entries import make_entry  # noqa: E402 - a small real entry
    from kvstore.store.backends import lmdb as lmdb_backend
    from kvstore.store.kvstore import KVStore

    entries = [make_entry(i) for i in range(3)]
    fail_lmdb_writes(monkeypatch, lmdb.Error(message), ok_commits=3)  # meta + 2 entries
    monkeypatch.setattr(
        lmdb_backend.shutil, "disk_usage", lambda p: types.SimpleNamespace(total=100 << 30, used=0, free=free)
    )
    with KVStore(str(tmp_path / "s")) as s:
        s.put(entries[0])
        s.put(entries[1])
        with pytest.raises(errors.StoreError) as exc:
            s.put(entries[2])
    assert type(exc.value).__name__ == expected
    if expected == "StoreFullError":
        assert str(exc.value).startswith("disk full while writing to") and "intact" in str(exc.value)
    monkeypatch.undo()
    with KVStore(str(tmp_path / "s"), readonly=True) as s:
        info = s.verify()
    assert {e.key for e in info.entries} == {entries[0].key, entries[1].key} and not info.corrupt


def test_simulated_disk_full_during_a_cli_build(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    import lmdb

    dataset = write_dataset(tmp_path / "data.jsonl", range(10), questions=1)
    store = tmp_path / "store"
    # meta, the shared chat head, then (chunk, context record) twice
    fail_lmdb_writes(monkeypatch, lmdb.Error("mdb_txn_commit: No space left on device"), ok_commits=6)
    code, out, err = run_main(
        capsys, "build", dataset, "--model", tiny_llama_dir, "--store", store, "--quiet", "--batch-size", "2"
    )
    monkeypatch.undo()
    assert code == 1 and out == "" and "Traceback" not in err
    assert (
        err == f"kvstore: error: disk full while writing to {store}; the entries stored before are intact - free space "
        "and re-run\n"
    )
    intact, corrupt = verify_store(store)
    assert len(intact) == 2 and not corrupt


# == 5. foreign caches =================================================================================
@pytest.fixture
def other_weights_dir(tiny_llama_dir, tmp_path):
    """The tiny llama with one weight changed: same architecture and tokenizer, other fingerprint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 0.5
    out = tmp_path / "other-weights"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(out)
    return out


def test_caches_of_another_model_or_dtype_are_misses(tiny_llama_dir, other_weights_dir, tmp_path, capsys):
    n = 6
    dataset = write_dataset(tmp_path / "data.jsonl", range(n))
    fp64, fp32 = tmp_path / "a-fp64", tmp_path / "a-fp32"
    for store, dtype in ((fp64, "float64"), (fp32, "float32")):
        assert (
            run_main(
                capsys, "build", dataset, "--model", tiny_llama_dir, "--dtype", dtype, "--store", store, "--quiet"
            )[0]
            == 0
        )

    def sample(model, store, *extra) -> dict[str, dict]:
        out = tmp_path / f"preds-{len(list(tmp_path.glob('preds-*')))}.jsonl"
        args = [
            "sample",
            dataset,
            "--model",
            model,
            "--dtype",
            "float64",
            "--quiet",
            "--format",
            "json",
            "-o",
            out,
            *extra,
        ]
        code, _, err = run_main(capsys, *args, *(["--store", store, "--readonly-store"] if store else ["--no-cache"]))
        assert code == 0 and err == "", err
        return read_predictions(out)

    # the same model and dtype hits (so the misses below are not a broken lookup)
    assert all(r["cache_hit"] for r in sample(tiny_llama_dir, fp64).values())
    for model, store in ((other_weights_dir, fp64), (tiny_llama_dir, fp32)):  # other weights; other dtype
        before = store_keys(store)
        got, reference = sample(model, store), sample(model, None)
        assert not any(r["cache_hit"] for r in got.values())
        assert {k: r["raw_output"] for k, r in got.items()} == {k: r["raw_output"] for k, r in reference.items()}
        assert store_keys(store) == before


FORGERIES = ["more-layers", "kv-heads", "head-dim", "fewer-tokens", "dtype", "model", "token-ids"]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_entry_that_does_not_fit_the_model_is_a_miss(forgery, tmp_path):
    """An entry stored under the right key whose tensors do not fit the model (a bug, a hash
    collision or tampering) is never used: the row is computed, and the entry replaced."""
    import torch

    from helpers.tiny import make_tiny_model
    from kvstore.model.adapter import Adapter
    from kvstore.store.entry import Entry
    from kvstore.store.kvstore import KVStore

    adapter = Adapter(*make_tiny_model("llama", dtype=torch.float64), name="tiny")
    ctx = adapter.encode_context(context_text(0))
    question = adapter.encode_question("What does it say?")
    reference = adapter.greedy_sample([ctx], [question], 8, use_cache=False)
    key = adapter.key(ctx)
    layers = [(1.5 * k, 1.5 * v) for k, v in adapter.prefill([ctx])[0]]  # a hit would change the answer
    ids, fingerprint = torch.tensor(ctx), adapter.fingerprint
    if forgery == "more-layers":
        layers.append(layers[0])
    elif forgery == "kv-heads":
        layers = [(torch.cat([k, k]), torch.cat([v, v])) for k, v in layers]
    elif forgery == "head-dim":
        layers = [(k[..., :4].contiguous(), v[..., :4].contiguous()) for k, v in layers]
    elif forgery == "fewer-tokens":
        layers, ids = [(k[:, 1:].contiguous(), v[:, 1:].contiguous()) for k, v in layers], ids[1:]
    elif forgery == "dtype":
        layers = [(k.float(), v.float()) for k, v in layers]
    elif forgery == "model":
        fingerprint = "0" * 64
    elif forgery == "token-ids":
        ids = ids.flip(0)
    with KVStore(str(tmp_path / "store")) as s:
        s.put(Entry(key, fingerprint, "forged", ids, tuple(layers)))
        result = adapter.greedy_sample([ctx], [question], 8, store=s, return_details=True)
    assert result.cache_hit == [False]
    assert torch.equal(result.tokens, reference)
    with KVStore(str(tmp_path / "store"), readonly=True) as s:
        assert s.get(key).model == adapter.fingerprint  # replaced by the real thing


# == 7. hostile entries ===============================================================================
def _decode_all_child(blobs: dict[str, bytes], result_path: str, control_mib: int) -> None:
    """Decode each blob, recording the outcome and how much the peak RSS grew (KiB)."""
    from kvstore.errors import KVStoreError
    from kvstore.store.entry import decode_entry

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    base = peak()
    outcomes = {}
    for name, blob in blobs.items():
        try:
            decode_entry(blob, threads=4)
            outcomes[name] = "decoded"
        except KVStoreError as exc:
            outcomes[name] = type(exc).__name__
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcomes[name] = f"{type(exc).__name__}: {exc}"
    hostile = peak() - base
    control = b"\1" * (control_mib << 20)  # the measurement must see an allocation this size
    Path(result_path).write_text(
        json.dumps({"outcomes": outcomes, "hostile_kib": hostile, "control_kib": peak() - base, "n": len(control)})
    )


FORBIDDEN_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "cloudpickle",
    "dill",
    "joblib",
    "shelve",
    "marshal",
    "pickletools",
}
FORBIDDEN_CALLS = {"eval", "exec", "__import__", "compile"}
FORBIDDEN_ATTRS = {"torch.load", "torch.serialization", "numpy.load", "np.load", "torch.jit.load", "torch.package"}
FORBIDDEN_KEYWORDS = {("weights_only", False), ("allow_pickle", True), ("trust_remote_code", True)}


def _dotted(node) -> str:
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def code_execution_risks(source: str, filename: str = "<source>") -> list[str]:
    """Uses of pickle-family modules, torch.load & co, eval/exec, and the keyword arguments that
    switch loaders into executing code, found in the syntax tree (docstrings saying "never
    pickle" are not uses)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{where}: from {mod} import ...")
            found += [
                f"{where}: from {mod} import {a.name}" for a in node.names if f"{mod}.{a.name}" in FORBIDDEN_ATTRS
            ]
        elif isinstance(node, ast.Attribute) and _dotted(node) in FORBIDDEN_ATTRS:
            found.append(f"{where}: {_dotted(node)}")
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
                found.append(f"{where}: {node.func.id}()")
            for kw in node.keywords:
                if isinstance(kw.value, ast.Constant) and (kw.arg, kw.value.value) in FORBIDDEN_KEYWORDS:
                    found.append(f"{where}: {kw.arg}={kw.value.value}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_MODULES:
            found.append(f"{where}: {node.id}")
    return found


def test_hostile_entries_are_rejected_with_bounded_memory(tmp_path):
    blobs = hostile_entries()
    result = tmp_path / "result.json"
    p = zygote().Process(target=_decode_all_child, args=(blobs, str(result), 256))
    p.start()
    p.join(300)
    assert p.exitcode == 0
    r = json.loads(result.read_text())
    assert r["outcomes"] == {name: "CorruptEntryError" for name in blobs}
    assert r["hostile_kib"] < 64 << 10, r  # peak RSS grew by less than 64 MiB over all of them
    assert r["control_kib"] > 200 << 10, r  # while a 256 MiB allocation does show


def test_the_risk_scanner_finds_what_it_looks_for():
    for bad in (
        "import pickle",
        "from pickle import loads",
        "import torch\ntorch.load(f)",
        "from torch import load",
        "x = eval('1')",
        "load_file(p, weights_only=False)",
        "np.load(f, allow_pickle=True)",
        "import dill as d",
        "AutoModel.from_pretrained(p, trust_remote_code=True)",
        "torch.serialization.load(f)",
        "import marshal",
    ):
        assert code_execution_risks(bad), bad
    assert not code_execution_risks('"""Never pickle, never torch.load."""\nimport json\njson.loads("1")\n')


def test_no_pickle_or_code_execution_in_the_library():
    """Everything under kvstore/ and cli/ (the store, entry, codecs, backends, adapter, decoding,
    the commands... and every module they import from kvstore) is free of pickle, torch.load,
    eval/exec and the like."""
    import kvstore.cli.manage  # noqa: F401 - the commands that read stores
    import kvstore.cli.workflow  # noqa: F401
    import kvstore.model.adapter  # noqa: F401 - the load path and what it imports
    import kvstore.store.kvstore  # noqa: F401

    files = sorted([*(REPO / "kvstore").rglob("*.py"), *(REPO / "cli").rglob("*.py")])
    loaded = {
        Path(m.__file__).resolve()
        for name, m in sys.modules.items()
        if name.startswith("kvstore") and getattr(m, "__file__", None)
    }
    assert loaded <= set(files)  # the scan covers every kvstore module the load path imports
    names = {str(f.relative_to(REPO)) for f in files}
    assert {
        "kvstore/store/kvstore.py",
        "kvstore/store/entry.py",
        "kvstore/store/codecs/zstd.py",
        "kvstore/model/pipelines/sample.py",
        "kvstore/store/backends/lmdb.py",
        "cli/manage.py",
        "cli/workflow.py",
    } <= names
    risks = [r for f in files for r in code_execution_risks(f.read_text(), str(f.relative_to(REPO)))]
    # The one exception, named: importing llminference's torch.save files, tensors only
    # (weights_only=True), in a module of its own that no load path imports.
    # And there, pickletools: it walks a refused file's opcodes to name what it would call (never unpickles).
    mine = [r for r in risks if r.startswith("kvstore/model/llminference.py:")]
    exception = [r for r in mine if r.endswith((": torch.load", ": import pickletools", ": pickletools"))]
    assert len([r for r in exception if r.endswith(": torch.load")]) == 1
    importers = {str(f.relative_to(REPO)) for f in files if "kvstore.model.llminference import" in f.read_text()}
    assert importers == {"cli/exchange.py"}  # only the import command reaches it
    assert "weights_only=True" in (REPO / "kvstore/model/llminference.py").read_text()
    assert not [r for r in risks if r not in exception], risks


def test_load_path_runs_with_pickle_and_torch_load_disabled(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """Every unpickler raises: putting, verifying, loading and sampling from a store still work."""
    import pickle

    import numpy
    import torch

    from kvstore.model.adapter import Adapter
    from kvstore.store.kvstore import KVStore

    dataset = write_dataset(tmp_path / "data.jsonl", range(3))
    store = tmp_path / "store"
    adapter = Adapter.from_pretrained(str(tiny_llama_dir))
    contexts = [context_text(i) for i in range(3)]

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling on the kvstore load path")

    for obj, name in (
        (pickle, "load"),
        (pickle, "loads"),
        (pickle, "Unpickler"),
        (torch, "load"),
        (torch.serialization, "load"),
        (numpy, "load"),
    ):
        monkeypatch.setattr(obj, name, refuse)
    with KVStore(str(store)) as s:
        adapter.generate_kv_cache(contexts, s)
        tokens = adapter.greedy_sample(contexts, ["What?"] * 3, 4, store=s, return_details=True)
        assert all(tokens.cache_hit)
        assert all(s.get(k) is not None for k in s.keys())
        assert not s.verify().corrupt
    code, _, err = run_main(
        capsys, "sample", dataset, "--model", tiny_llama_dir, "--store", store, "--quiet", "--readonly-store"
    )
    assert code == 0, err
