"""``kvstore sync`` and :mod:`kvstore.store.transfer`: byte-identical copies across backends
(LMDB -> S3 -> LMDB), resumption after a kill -9, verification of every entry, the description
record's rules, and the command's output."""

from __future__ import annotations

import json
import os
import signal

import pytest
from click.testing import CliRunner

from helpers.cli import run_main, zygote
from helpers.entries import encode, kv_layers
from kvstore.cli.main import app
from kvstore.errors import FormatVersionError
from kvstore.store.backends import open_backend
from kvstore.store.header import STORE_FORMAT
from kvstore.store.kvstore import KVStore
from kvstore.store.transfer import execute_sync, plan_sync, sync


def _make_store(path, n: int = 6, *, tokens: int = 64) -> dict[bytes, bytes]:
    """An LMDB store of ``n`` entries (with access records); returns every record it holds."""
    with KVStore(str(path)) as kv:
        for i in range(n):
            key = f"{i:02x}" * 32
            kv.put_bytes(key, encode(kv_layers(2, 2, tokens, 16, seed=i, extremes=False), key=key))
            with kv.open_entry(key):  # records an access time at close
                pass
    return _records(str(path))


def _records(url: str) -> dict[bytes, bytes]:
    b = open_backend(url, readonly=True)
    try:
        return {k: bytes(b.get(k)) for k in b.keys()}
    finally:
        b.close()


def test_lmdb_to_s3_to_lmdb_is_byte_identical(tmp_path, s3_url):
    original = _make_store(tmp_path / "a")
    up = sync(str(tmp_path / "a"), s3_url)
    assert (up.copied, up.copied_entries, up.present, up.meta) == (12, 6, 0, "copy")
    down = sync(s3_url, str(tmp_path / "b"))
    assert (down.copied, down.copied_entries, down.meta) == (12, 6, "copy")
    assert _records(s3_url) == original
    assert _records(str(tmp_path / "b")) == original  # meta, entries and access records alike
    again = sync(s3_url, str(tmp_path / "b"))
    assert (again.copied, again.present) == (0, 12)
    with KVStore(str(tmp_path / "b"), readonly=True) as kv:
        assert not kv.verify().corrupt and len(kv) == 6


def _sync_killed_after(src: str, dst: str, copies: int, env: dict[str, str]) -> None:
    """Child process: ``kvstore sync SRC DST --jobs 1`` that SIGKILLs itself once ``copies``
    records are copied (a real kill -9 at a known point, in the middle of the run): one record a
    batch, killed as it reads the next one."""
    os.environ.update(env)
    from kvstore.cli.main import main
    from kvstore.store import transfer

    real, done = transfer._read, []

    def read(src_backend, key):
        if len(done) == copies:
            os.kill(os.getpid(), signal.SIGKILL)
        done.append(key)
        return real(src_backend, key)

    transfer._read = read
    transfer.BATCH_RECORDS = 1
    main(["sync", src, dst, "--jobs", "1", "--quiet"])


def test_sync_killed_midway_resumes_with_the_rest(tmp_path, s3_url, s3_env):
    original = _make_store(tmp_path / "a", 8)
    p = zygote().Process(target=_sync_killed_after, args=(str(tmp_path / "a"), s3_url, 5, s3_env))
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL
    copied = _records(s3_url)
    assert len(copied) == 1 + 5  # the description, then five records
    assert all(original[k] == v for k, v in copied.items())
    rest = sync(str(tmp_path / "a"), s3_url)
    assert (rest.copied, rest.present, rest.meta) == (16 - 5, 5, "keep")
    assert _records(s3_url) == original


def test_corrupt_entries_are_reported_not_copied(tmp_path):
    _make_store(tmp_path / "a", 3)
    src = open_backend(str(tmp_path / "a"))
    key = b"e/" + b"01" * 32
    blob = bytearray(src.get(key))
    blob[len(blob) // 2] ^= 0xFF
    src.put(key, bytes(blob))
    src.close()
    report = sync(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [k for k, _ in report.corrupt] == ["01" * 32] and "checksum" in report.corrupt[0][1]
    assert report.copied_entries == 2
    assert key not in _records(str(tmp_path / "b"))


def test_description_rules(tmp_path):
    _make_store(tmp_path / "a", 1)
    src = open_backend(str(tmp_path / "a"), readonly=True)
    older = open_backend(str(tmp_path / "older"))
    try:
        older.put(b"meta", json.dumps({"format": 0, "codec": "raw"}).encode())
        with pytest.raises(FormatVersionError, match="sync into a new store"):
            plan_sync(src, older)
        older.put(b"meta", json.dumps({"format": STORE_FORMAT, "codec": "raw"}).encode())
        plan = plan_sync(src, older)
        assert plan.meta == "keep" and len(plan.missing) == 2
        execute_sync(plan, src, older)
        assert json.loads(older.get(b"meta"))["codec"] == "raw"  # DST keeps its own description
        older.put(b"meta", json.dumps({"format": STORE_FORMAT + 1}).encode())
        with pytest.raises(FormatVersionError, match="upgrade kvstore"):
            plan_sync(src, older)
    finally:
        src.close()
        older.close()


def test_cli_sync(tmp_path, s3_url, capsys):
    _make_store(tmp_path / "a", 4)
    runner = CliRunner()
    dry = runner.invoke(app, ["sync", str(tmp_path / "a"), s3_url, "--dry-run"], catch_exceptions=False)
    assert dry.exit_code == 0, dry.output
    assert "8 records to copy (4 entries, 4 other), 0 already there" in dry.output
    assert "Dry run: nothing copied." in dry.output
    code, _, err = run_main(capsys, "stats", "--store", s3_url)
    assert code == 1 and "no store at" in err  # the dry run created nothing
    out = runner.invoke(app, ["sync", str(tmp_path / "a"), s3_url, "-q", "--format", "json"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout)
    assert (summary["copied"], summary["copied_entries"], summary["corrupt"]) == (8, 4, 0)
    assert summary["copied_bytes"] == sum(len(v) for k, v in _records(s3_url).items() if k != b"meta")
    again = runner.invoke(app, ["sync", str(tmp_path / "a"), s3_url, "-q"], catch_exceptions=False)
    assert "Copied 0 records" in again.output and "8 were already there" in again.output
    code, _, err = run_main(capsys, "sync", str(tmp_path / "nope"), s3_url)
    assert code == 1 and err.startswith("kvstore: error:") and len(err.strip().splitlines()) == 1
