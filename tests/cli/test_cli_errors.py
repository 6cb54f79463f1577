"""Bad input to ``kvstore build`` / ``sample`` (and the write commands): one line, a non-zero exit,
no traceback - and ``KVSTORE_DEBUG=1`` shows the traceback.

The conventions (``cli/main.py``, ``cli/common.py``):

* a problem with the data, the model, the store or the environment is a kvstore error: exactly one
  line ``kvstore: error: WHAT; WHAT TO DO`` on stderr, nothing on stdout, exit 1;
* an invalid option value is a click usage error: ``Usage:`` / ``Try ... for help.`` / ``Error:
  ...`` on stderr, exit 2 (the shell convention for misuse);
* Ctrl-C: ``kvstore: interrupted; everything committed so far is kept.``, exit 130 (128 + SIGINT).

Manage commands (ls/stats/verify/rm/gc) on missing, file-path and future-format stores are covered
in ``test_cli_manage.py``; here the same for build and sample, and read-only stores for every
command that writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from helpers.cli import (
    REPO,
    context_text,
    nonblank_lines,
    run_main,
    start_cli,
    store_keys,
    verify_store,
    write_dataset,
)
from helpers.data import write_rows


def assert_error_line(code: int, out: str, err: str, *expected: str) -> None:
    """One ``kvstore: error:`` line, exit 1, nothing on stdout, no traceback."""
    assert code == 1, (code, err)
    assert out == "", out
    assert "Traceback" not in err
    lines = nonblank_lines(err)
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: "), err
    for text in expected:
        assert text in err, (text, err)


def assert_usage_error(code: int, err: str, *expected: str) -> None:
    """A click usage error: exit 2, ``Error: ...`` last, no traceback."""
    assert code == 2, (code, err)
    assert "Traceback" not in err
    assert nonblank_lines(err)[-1].startswith("Error: "), err
    for text in expected:
        assert text in err, (text, err)


GOOD = {"id": "a", "context": "The fox jumps.", "question": "Who jumps?", "answers": ["the fox"]}


# -- dataset problems ----------------------------------------------------------------------------
DATASETS = {
    "malformed line": ([GOOD, '{"context": "x", "question": ', dict(GOOD, id="b")], "data.jsonl:2: not valid JSON"),
    "missing context": (
        [GOOD, {"id": "b", "question": "q?", "answers": ["a"]}],
        "data.jsonl:2: missing field 'context'",
    ),
    "missing question": ([{"id": "b", "context": "c", "answers": ["a"]}], "data.jsonl:1: missing field 'question'"),
    "empty context": ([GOOD, dict(GOOD, id="b", context="   ")], "data.jsonl:2: empty context"),
    "not UTF-8": ([GOOD, b"\xff\xfe{}".decode("latin-1")], "data.jsonl:2: not"),
    "empty file": ([], "the file is empty"),
}


@pytest.mark.parametrize(
    "case, command",
    # build needs contexts only: a row without a question is fine there
    [(case, cmd) for case in DATASETS for cmd in ("build", "sample") if (case, cmd) != ("missing question", "build")],
)
def test_bad_dataset(case, command, tmp_path, capsys):
    rows, expected = DATASETS[case]
    path = tmp_path / "data.jsonl"
    if case == "not UTF-8":
        path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe{}\n")
    else:
        write_rows(path, rows)
    store = tmp_path / "store"
    code, out, err = run_main(
        capsys, command, path, "--model", "/nonexistent/never-loaded", "--store", store, "--quiet"
    )
    assert_error_line(code, out, err, expected)
    assert "--skip-bad-rows" in err or case == "empty file"
    assert not store.exists()  # failed before touching any store


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "missing.jsonl", "missing.jsonl: no such file; check the path"),
        (lambda d: d, "is a directory"),
        (lambda d: (d / "data.txt").write_text("x") and d / "data.txt", "unknown file type '.txt'"),
    ],
    ids=["missing", "directory", "extension"],
)
def test_unreadable_dataset(make, expected, tmp_path, capsys):
    code, out, err = run_main(capsys, "build", make(tmp_path), "--store", tmp_path / "store", "--quiet")
    assert_error_line(code, out, err, expected)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_dataset_without_read_permission(tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    write_rows(path, [GOOD])
    path.chmod(0)
    try:
        code, out, err = run_main(capsys, "build", path, "--store", tmp_path / "store", "--quiet")
    finally:
        path.chmod(0o644)
    assert_error_line(code, out, err, "cannot read the file")


# -- model problems ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, expected",
    [
        ("no-such-org/no-such-model", "the hub could not provide it"),
        ("/nonexistent/model-dir", "no such file or directory"),
        ("{empty}", "without config.json"),
        ("{dataset}", "is a file but not a .gguf file"),
    ],
    ids=["hub-id", "path", "empty-dir", "not-a-model"],
)
def test_unknown_model(model, expected, tmp_path, capsys):
    dataset = write_rows(tmp_path / "data.jsonl", [GOOD])
    (tmp_path / "empty").mkdir()
    model = model.format(empty=tmp_path / "empty", dataset=dataset)
    code, out, err = run_main(capsys, "build", dataset, "--model", model, "--store", tmp_path / "store", "--quiet")
    assert_error_line(code, out, err, expected)


@pytest.mark.parametrize("command", ["build", "sample"])
def test_context_longer_than_the_model_allows(command, tiny_llama_dir, tmp_path, capsys):
    long_row = dict(GOOD, id="long", context=" ".join(context_text(i) for i in range(12)))  # ~1,500 tokens > 512
    dataset = write_rows(tmp_path / "data.jsonl", [GOOD, long_row])
    store = tmp_path / "store"
    code, out, err = run_main(capsys, command, dataset, "--model", tiny_llama_dir, "--store", store, "--quiet")
    assert_error_line(code, out, err, "row long", "tokens but at most", "--truncate")
    assert not store.exists() or not store_keys(store)  # nothing half-built


@pytest.mark.parametrize(
    "option, expected",
    [
        (["--device", "cuda:7"], "device 'cuda:7'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--codec", "zstd:99"], "zstd level"),
        (["--codec", "lz4"], "unknown codec 'lz4'"),
    ],
    ids=["cuda", "device", "codec-level", "codec"],
)
def test_invalid_values_the_library_rejects(option, expected, tiny_llama_dir, tmp_path, capsys):
    dataset = write_rows(tmp_path / "data.jsonl", [GOOD])
    code, out, err = run_main(
        capsys, "build", dataset, "--model", tiny_llama_dir, "--store", tmp_path / "store", "--quiet", *option
    )
    assert_error_line(code, out, err, expected)


@pytest.mark.parametrize(
    "command, option",
    [
        ("build", ["--batch-size", "-1"]),
        ("build", ["--batch-size", "0"]),
        ("sample", ["--max-new-tokens", "0"]),
        ("sample", ["-n", "-3"]),
        ("build", ["--max-new-tokens", "0"]),
        ("build", ["--limit", "0"]),
        ("sample", ["--dtype", "int8"]),
        ("sample", ["--format", "xml"]),
        ("build", ["--batch-size", "many"]),
    ],
    ids=lambda v: v if isinstance(v, str) else "=".join(v),
)
def test_invalid_option_values_are_usage_errors(command, option, tmp_path, capsys):
    dataset = write_rows(tmp_path / "data.jsonl", [GOOD])
    code, out, err = run_main(capsys, command, dataset, "--store", tmp_path / "store", *option)
    assert_usage_error(code, err, option[0])
    assert out == "" and not (tmp_path / "store").exists()


# -- store problems ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["build", "sample"])
def test_store_path_is_a_file(command, tiny_llama_dir, tmp_path, capsys):
    dataset = write_rows(tmp_path / "data.jsonl", [GOOD])
    f = tmp_path / "file"
    f.write_text("precious")
    code, out, err = run_main(capsys, command, dataset, "--model", tiny_llama_dir, "--store", f, "--quiet")
    assert_error_line(code, out, err, "is a file")
    assert f.read_text() == "precious"


@pytest.mark.parametrize("command", ["build", "sample"])
def test_store_from_a_newer_format(command, tiny_llama_dir, tmp_path, capsys):
    from kvstore.store.header import STORE_FORMAT
    from kvstore.store.kvstore import KVStore

    dataset = write_rows(tmp_path / "data.jsonl", [GOOD])
    store = tmp_path / "store"
    assert run_main(capsys, "build", dataset, "--model", tiny_llama_dir, "--store", store, "--quiet")[0] == 0
    with KVStore(str(store)) as s:
        s.backend.put(b"meta", json.dumps({"format": STORE_FORMAT + 1, "codec": "raw", "created": 0}).encode())
    code, out, err = run_main(capsys, command, dataset, "--model", tiny_llama_dir, "--store", store, "--quiet")
    assert_error_line(code, out, err, f"format version {STORE_FORMAT + 1}", "upgrade kvstore")


@pytest.fixture
def readonly_store(tmp_path):
    """A store with one entry that cannot be written: a read-only mount when running as root
    (root ignores file modes), a 0o555 directory otherwise."""
    from helpers.entries import make_entry, put_contexts

    root = os.geteuid() == 0
    d = tmp_path / "ro"
    d.mkdir()
    if root:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True, timeout=30
        )
        if done.returncode != 0:
            pytest.skip(
                f"running as root and cannot mount a read-only store: {done.stderr.decode(errors='replace').strip()}"
            )
    store = d / "store"
    entry = make_entry(1)
    put_contexts(str(store), [entry])
    try:
        if root:
            subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True, capture_output=True, timeout=30)
        else:
            for p in (store / "data.mdb", store / "lock.mdb", store, d):
                p.chmod(0o555 if p.is_dir() else 0o444)
        yield store, entry
    finally:
        if root:
            subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)
        else:
            for p in (d, store, store / "data.mdb", store / "lock.mdb"):
                p.chmod(0o755 if p.is_dir() else 0o644)


@pytest.mark.parametrize("command", ["build", "rm", "gc"])
def test_readonly_store_for_a_write_command(command, readonly_store, tiny_llama_dir, tmp_path, capsys):
    store, entry = readonly_store
    dataset = write_rows(tmp_path / "data.jsonl", [GOOD])
    args = {
        "build": ["build", dataset, "--model", tiny_llama_dir, "--quiet"],
        "rm": ["rm", entry.key[:12], "--yes"],
        "gc": ["gc", "--corrupt", "--yes", "--quiet"],
    }[command]
    code, out, err = run_main(capsys, *args, "--store", store)
    assert_error_line(code, out, err, f"store {store} is not writable")
    assert store_keys(store) == {entry.key}  # reading still works, nothing changed


def test_readonly_store_can_still_be_read(readonly_store, tiny_llama_dir, tmp_path, capsys):
    store, entry = readonly_store
    dataset = write_rows(tmp_path / "data.jsonl", [GOOD])
    code, out, err = run_main(
        capsys, "sample", dataset, "--model", tiny_llama_dir, "--store", store, "--readonly-store", "--quiet"
    )
    assert code == 0 and err == "", err
    code, out, err = run_main(capsys, "verify", "--store", store, "--quiet")
    assert code == 0 and "1 entry and 1 context verified" in out


# -- Ctrl-C ----------------------------------------------------------------------------------------
def test_ctrl_c_during_a_build(tiny_llama_dir, tmp_path):
    dataset = write_dataset(tmp_path / "data.jsonl", range(60), questions=1, words=(30, 90))
    store = tmp_path / "store"
    p = start_cli(
        ["build", dataset, "--model", tiny_llama_dir, "--store", store, "--batch-size", "1", "--quiet"],
        tmp_path,
        name="build",
    )
    seen: set[str] = set()
    t0 = time.monotonic()
    while p.alive() and not seen and time.monotonic() - t0 < 120:
        seen = store_keys(store, strict=False)
        time.sleep(0.005)
    assert seen and p.alive(), "the build finished before it could be interrupted"
    p.interrupt()
    code, out, err = p.wait()
    assert code == 130, err
    assert nonblank_lines(err) == ["kvstore: interrupted; everything committed so far is kept."], (
        err
    )  # click adds a blank line
    assert "Traceback" not in err and out == ""
    intact, corrupt = verify_store(store)
    assert not corrupt and seen <= intact and len(intact) < 60


# -- KVSTORE_DEBUG ---------------------------------------------------------------------------------
def test_debug_variable_shows_the_traceback(tmp_path, capsys, monkeypatch):
    from kvstore.cli.main import main
    from kvstore.errors import DatasetError

    monkeypatch.setenv("KVSTORE_DEBUG", "1")
    with pytest.raises(DatasetError, match="no such file"):
        main(["build", str(tmp_path / "missing.jsonl"), "--store", str(tmp_path / "store")])


def test_console_script_one_line_or_traceback(tmp_path):
    """The real interpreter, twice at once: the error line alone, then with KVSTORE_DEBUG=1 the
    traceback (and nothing printed at exit by threads or destructors in either)."""
    dataset = write_rows(tmp_path / "data.jsonl", [GOOD, '{"context": '])
    argv = [sys.executable, "-m", "kvstore.cli.main", "build", dataset, "--store", str(tmp_path / "store")]
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_DEBUG"}
    procs = [
        subprocess.Popen(
            argv, cwd=REPO, env=dict(env, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for extra in ({}, {"KVSTORE_DEBUG": "1"})
    ]
    (out, err), (dout, derr) = (p.communicate(timeout=300) for p in procs)
    assert procs[0].returncode == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"kvstore: error: {dataset}:2: not valid JSON"), err
    assert procs[1].returncode != 0 and dout == ""
    assert "Traceback (most recent call last)" in derr and "kvstore.errors.DatasetError" in derr, derr
