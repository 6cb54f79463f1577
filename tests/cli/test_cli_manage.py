"""`kvstore ls / stats / verify / rm / gc` through click's CliRunner, and the one-line error path
through ``kvstore.cli.main.main`` (which CliRunner bypasses)."""

from __future__ import annotations

import csv
import io
import json
import struct
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

import kvstore.cli.common
from helpers.entries import FP_TINY, make_entry, put_contexts
from helpers.paths import REPO
from kvstore.cli.common import emit, parse_duration, parse_size, progress_bar, render_table
from kvstore.cli.main import app, main
from kvstore.store.backends import open_backend
from kvstore.store.codecs import DEFAULT_CODEC, get_codec
from kvstore.store.entry import Entry
from kvstore.store.header import STORE_FORMAT
from kvstore.store.kvstore import KVStore

FP_OTHER = "2" * 64
DAY = 86400.0
ROOT = REPO


@pytest.fixture
def store(tmp_path) -> tuple[str, list[Entry]]:
    """A store of 4 entries: tiny fp32 (used 1 day ago, 8 tokens), tiny bf16 (40 days, 16 tokens),
    other fp16 (10 days, 24 tokens), other fp16 (100 days, 32 tokens)."""
    now = time.time()
    entries = [
        make_entry(1, created=now - 1 * DAY),
        make_entry(2, dtype=torch.bfloat16, n_tokens=16, created=now - 40 * DAY),
        make_entry(3, fp=FP_OTHER, name="other", dtype=torch.float16, n_tokens=24, created=now - 10 * DAY),
        make_entry(4, fp=FP_OTHER, name="other", dtype=torch.float16, n_tokens=32, created=now - 100 * DAY),
    ]
    path = str(tmp_path / "store")
    put_contexts(path, entries)
    return path, entries


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def keys_in(path: str) -> set[str]:
    with KVStore(path, readonly=True) as s:
        return set(s.keys())


def damage(path: str, key: str, pos: int = -20) -> None:
    with KVStore(path) as s:
        raw = bytearray(s.backend.get(b"e/" + key.encode()))
        raw[pos] ^= 0xFF
        s.backend.put(b"e/" + key.encode(), bytes(raw))


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """Run the real entry point (with its error handling); returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
        raise SystemExit(0)  # main() returns normally on success
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


# -- ls -------------------------------------------------------------------------------------------
def test_ls_table(store):
    path, entries = store
    r = invoke("ls", "--store", path)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == [
        "KEY", "MODEL", "FINGERPRINT", "DTYPE", "TOKENS", "CHUNKS", "CODEC", "SIZE", "KV-RATIO", "CREATED", "LAST",
        "USED", "NUMERICS",
    ]  # fmt: skip
    assert all(e.key[:12] in r.stdout and e.key not in r.stdout for e in entries)
    assert "4 contexts" in lines[-1] and "cpu/sdpa" in lines[1]
    # default order: most recently used first
    assert [line.split()[0] for line in lines[1:5]] == [
        e.key[:12] for e in entries[:1] + entries[2:3] + entries[1:2] + entries[3:]
    ]
    full = invoke("ls", "--store", path, "--full-keys")
    assert all(e.key in full.stdout for e in entries) and FP_TINY in full.stdout


def test_ls_json_filter_and_sort(store):
    path, entries = store
    r = invoke("ls", "--store", path, "--format", "json", "--sort", "tokens")
    assert r.exit_code == 0 and r.stderr == ""
    rows = json.loads(r.stdout)
    assert [row["key"] for row in rows] == [e.key for e in reversed(entries)]  # largest first
    row = rows[-1]
    assert row["model"] == FP_TINY and row["model_name"] == "tiny" and row["dtype"] == "float32"
    fmt = get_codec(DEFAULT_CODEC).entry_format  # zstd-split: format 3
    assert (row["n_tokens"], row["chunks"], row["complete"], row["format"]) == (8, 1, True, fmt)
    assert row["codec"] == DEFAULT_CODEC and row["stored_bytes"] > 0 and row["raw_bytes"] > 0
    assert row["numerics"] == {"device": "cpu", "attn": "sdpa"}
    chunk = json.loads(invoke("ls", "--store", path, "--chunks", "--format", "json", "--sort", "tokens").stdout)[-1]
    assert (chunk["n_layers"], chunk["kv_heads"], chunk["head_dim"], chunk["start"]) == (2, 2, 4, 0)
    assert row["last_access"] is None and abs(row["created"] - entries[0].created) < 1e-3
    rows = json.loads(
        invoke("ls", "--store", path, "--format", "json", "--model", "other", "--sort", "tokens", "--reverse").stdout
    )
    assert [row["key"] for row in rows] == [entries[2].key, entries[3].key]
    rows = json.loads(invoke("ls", "--store", path, "--format", "json", "--model", "1111").stdout)  # fingerprint prefix
    assert {row["key"] for row in rows} == {entries[0].key, entries[1].key}


def test_ls_csv(store):
    path, entries = store
    r = invoke("ls", "--store", path, "--format", "csv", "--sort", "key")
    assert r.exit_code == 0
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [row["key"] for row in rows] == sorted(e.key for e in entries)
    assert {row["dtype"] for row in rows} == {"float32", "bfloat16", "float16"}
    assert all(int(row["stored_bytes"]) > 0 for row in rows)


def test_ls_empty_store_and_env_default(tmp_path, monkeypatch):
    path = str(tmp_path / "empty")
    KVStore(path).close()
    monkeypatch.setenv("KVSTORE_STORE", path)
    r = invoke("ls")  # no --store: the environment names it
    assert r.exit_code == 0 and "No contexts" in r.stdout and path in r.stdout
    assert json.loads(invoke("ls", "--format", "json").stdout) == []
    assert "$KVSTORE_STORE or cache/store" in " ".join(invoke("ls", "--help").stdout.split())


def test_ls_skips_unreadable_entries_with_a_warning(store):
    path, entries = store
    damage(path, entries[1].key, pos=30)  # inside the header
    r = invoke("ls", "--store", path, "--format", "json")
    assert r.exit_code == 0
    complete = {row["key"]: row["complete"] for row in json.loads(r.stdout)}
    assert complete == {entries[0].key: True, entries[1].key: False, entries[2].key: True, entries[3].key: True}
    assert f"kvstore: warning: skipped entry {entries[1].key[:12]}" in r.stderr
    assert "gc --corrupt" in r.stderr
    assert keys_in(path) == {e.key for e in entries}  # listing never removes anything


def test_ls_and_stats_check_sizes_against_the_header(store):
    """A forged header (a valid checksum around it) claiming 4096 PiB uncompressed: ls and stats
    showed that size; now the header's sizes are checked against its shapes and the stored bytes
    first, and the entry is listed as unreadable instead (issue 31, also seen)."""
    from helpers.entries import assemble, split

    path, entries = store
    with KVStore(path) as s:
        header, payload = split(bytes(s.backend.get(b"e/" + entries[0].key.encode())))
        s.backend.put(b"e/" + entries[0].key.encode(), assemble(dict(header, raw_bytes=1 << 62), payload))
    for cmd in (["ls"], ["ls", "--chunks"], ["stats"]):
        r = invoke(*cmd, "--store", path)
        assert r.exit_code == 0 and "PiB" not in r.stdout and "EiB" not in r.stdout, (cmd, r.stdout)
        assert f"skipped entry {entries[0].key[:12]}: entry declares a size that does not match its shape" in r.stderr
    doc = json.loads(invoke("stats", "--store", path, "--format", "json").stdout)
    assert doc["totals"]["corrupt"] == 1 and doc["totals"]["raw_bytes"] < 1 << 20


# -- stats ----------------------------------------------------------------------------------------
def test_stats(store):
    path, entries = store
    r = invoke("stats", "--store", path)
    assert r.exit_code == 0, r.output
    assert "never shrink" in r.stdout and "On disk:" in r.stdout
    assert "Total: 4 contexts, 80 tokens; 4 chunks" in r.stdout and "dedupe 1.00x" in r.stdout
    table = [line.split() for line in r.stdout.splitlines() if line.startswith(("tiny", "other"))]
    assert [(t[0], t[2], t[3], t[4], t[5]) for t in table] == [
        ("other", "float16", DEFAULT_CODEC, "2", "56"),
        ("tiny", "bfloat16", DEFAULT_CODEC, "1", "16"),
        ("tiny", "float32", DEFAULT_CODEC, "1", "8"),
    ]
    doc = json.loads(invoke("stats", "--store", path, "--format", "json").stdout)
    assert doc["format"] == STORE_FORMAT and doc["codec"] == DEFAULT_CODEC
    totals = doc["totals"]
    assert totals["contexts"] == totals["entries"] == 4 and totals["n_tokens"] == 80 and totals["corrupt"] == 0
    assert totals["logical_bytes"] == totals["stored_bytes"] and totals["dedupe_ratio"] == 1.0
    assert (
        totals["stored_bytes"] == sum(g["stored_bytes"] for g in doc["groups"])
        and totals["disk_bytes"] >= totals["stored_bytes"]
    )
    other = next(g for g in doc["groups"] if g["model_name"] == "other")
    assert other["model"] == FP_OTHER and other["contexts"] == 2 and other["n_tokens"] == 56
    assert other["physical_bytes"] == other["stored_bytes"] and doc["chunk_tokens"] == 512
    assert other["bytes_per_token"] == pytest.approx(other["stored_bytes"] / 56, abs=0.1)
    assert other["ratio"] == pytest.approx(other["stored_bytes"] / other["raw_bytes"], abs=1e-4)
    rows = list(csv.DictReader(io.StringIO(invoke("stats", "--store", path, "--format", "csv").stdout)))
    assert len(rows) == 3 and {r["dtype"] for r in rows} == {"float32", "bfloat16", "float16"}


# -- verify ---------------------------------------------------------------------------------------
def test_verify_clean(store):
    path, _ = store
    r = invoke("verify", "--store", path)
    assert r.exit_code == 0
    assert r.stdout.strip() == "4 entries and 4 contexts verified, all intact."
    assert "verify" in r.stderr  # the progress bar, on stderr
    quiet = invoke("verify", "--store", path, "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_verify_corrupt(store):
    path, entries = store
    damage(path, entries[2].key)  # payload damage: only a full check sees it
    assert invoke("ls", "--store", path).exit_code == 0
    r = invoke("verify", "--store", path, "-q")
    assert r.exit_code == 1
    assert r.stdout.splitlines() == [
        f"corrupt  {entries[2].key}  entry checksum mismatch (flipped or truncated bytes)",
        f"broken   {entries[2].key}  chunk 1 of 1 ({entries[2].key[:12]}) is missing or corrupt",
    ]
    assert r.stderr.strip() == (
        "kvstore: error: 1 of 4 entries corrupt; 1 of 4 contexts broken; `kvstore gc --corrupt` removes corrupt entries"
    )
    assert keys_in(path) == {e.key for e in entries}  # verify changes nothing


def test_verify_reports_malformed_context_records_and_gc_corrupt_removes_them(store):
    """A context record that does not read was skipped in silence: verify said all was intact
    (issue 31, also seen). Now it names each one, exits 1, and gc --corrupt removes them."""
    path, entries = store
    bad = {"0" * 64: b"not json", "1" * 64: json.dumps({"chunks": ["2" * 64], "n_tokens": 3, "created": 0}).encode()}
    with KVStore(path) as s:
        s.backend.put_many([(b"r/" + k.encode(), v) for k, v in bad.items()])
    r = invoke("verify", "--store", path, "-q")
    assert r.exit_code == 1
    assert r.stdout.splitlines() == [
        f"malformed  {'0' * 64}  malformed context record: unreadable: not a JSON object with chunks, n_tokens, "
        "created",
        f"malformed  {'1' * 64}  malformed context record: its last chunk is not its own key",
    ]
    assert "2 of 6 context records malformed" in r.stderr
    assert "skipped context 000000000000: malformed context record" in invoke("ls", "--store", path).stderr
    r = invoke("gc", "--store", path, "--corrupt", "--yes", "-q")
    assert r.exit_code == 0 and "Removed 2 contexts and 0 entries" in r.stdout
    v = invoke("verify", "--store", path, "-q")
    assert v.exit_code == 0 and "4 entries and 4 contexts verified, all intact." in v.stdout


# -- rm -------------------------------------------------------------------------------------------
def test_rm_by_key_prefix(store):
    path, entries = store
    r = invoke("rm", "--store", path, entries[0].key[:8], "--yes")
    assert r.exit_code == 0, r.output
    assert entries[0].key[:12] in r.stdout and "Removed 1 context and 1 entry, freed" in r.stdout
    assert "never shrink" in r.stdout
    assert keys_in(path) == {e.key for e in entries[1:]}


def test_rm_by_model(store):
    path, entries = store
    r = invoke("rm", "--store", path, "--model", "other", "-y")
    assert r.exit_code == 0 and "Removed 2 contexts and 2 entries" in r.stdout
    assert keys_in(path) == {entries[0].key, entries[1].key}


def test_rm_model_and_age_narrow_each_other(store):
    path, entries = store
    r = invoke("rm", "--store", path, "--model", "other", "--older-than", "30d", "--yes")
    assert r.exit_code == 0
    assert keys_in(path) == {e.key for e in entries[:3]}


def test_rm_dry_run_changes_nothing(store):
    path, entries = store
    r = invoke("rm", "--store", path, "--model", "tiny", "--dry-run")
    assert r.exit_code == 0
    assert entries[0].key[:12] in r.stdout and entries[1].key[:12] in r.stdout
    assert "2 contexts and 2 entries to remove" in r.stdout and "Dry run: nothing removed." in r.stdout
    assert keys_in(path) == {e.key for e in entries}


def test_rm_without_yes_and_without_terminal_refuses(store):
    path, entries = store
    r = invoke("rm", "--store", path, entries[0].key[:6])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "kvstore: error: no terminal to ask for confirmation on; pass --yes to go ahead (or --dry-run to see the plan)"
    )
    assert keys_in(path) == {e.key for e in entries}


def test_rm_asks_on_a_terminal(store, monkeypatch):
    path, entries = store
    monkeypatch.setattr(kvstore.cli.common, "stdin_is_tty", lambda: True)
    r = invoke("rm", "--store", path, entries[0].key[:6], input="n\n")
    assert r.exit_code == 0 and "Nothing changed." in r.stderr
    assert keys_in(path) == {e.key for e in entries}
    r = invoke("rm", "--store", path, entries[0].key[:6], input="y\n")
    assert r.exit_code == 0 and "Remove 1 context and 1 entry" in r.stderr and "Removed 1 context" in r.stdout
    assert keys_in(path) == {e.key for e in entries[1:]}


def test_rm_unknown_key_and_no_selection(store, capsys):
    path, entries = store
    code, out, err = run_main(capsys, "rm", "--store", path, "ffffzz", "--yes")
    assert code == 1 and err == f"kvstore: error: no context or entry matches key 'ffffzz' in {path}\n"
    r = invoke("rm", "--store", path)
    assert r.exit_code == 2 and "say what to remove" in r.stderr
    r = invoke("rm", "--store", path, "--older-than", "30")  # a unit is required
    assert r.exit_code == 2 and "'30' is not a duration" in r.stderr
    assert keys_in(path) == {e.key for e in entries}


def test_rm_corrupt_entry_by_key(store):
    path, entries = store
    damage(path, entries[1].key, pos=30)
    r = invoke("rm", "--store", path, entries[1].key[:10], "--yes")
    assert r.exit_code == 0 and "corrupt" in r.stdout
    assert keys_in(path) == {entries[0].key, entries[2].key, entries[3].key}


# -- gc -------------------------------------------------------------------------------------------
def test_gc_corrupt(store):
    path, entries = store
    damage(path, entries[3].key)
    dry = invoke("gc", "--store", path, "--corrupt", "--dry-run", "-q")
    assert dry.exit_code == 0 and "corrupt: entry checksum mismatch" in dry.stdout
    assert keys_in(path) == {e.key for e in entries}
    r = invoke("gc", "--store", path, "--corrupt", "--yes", "-q")
    assert r.exit_code == 0 and "Removed 1 context and 1 entry" in r.stdout
    assert keys_in(path) == {e.key for e in entries[:3]}
    assert invoke("verify", "--store", path, "-q").exit_code == 0
    again = invoke("gc", "--store", path, "--corrupt", "--yes", "-q")
    assert again.exit_code == 0 and "Nothing to remove." in again.stdout


def test_gc_corrupt_removes_a_context_whose_chunk_is_missing(store):
    """What a kill between an older rm's two deletes left (it deleted chunks before records): verify
    reported the context broken, and gc --corrupt said "Nothing to remove" (issue 31, item 3)."""
    path, entries = store
    with KVStore(path) as s:
        s.backend.delete(b"e/" + entries[1].key.encode())
    assert invoke("verify", "--store", path, "-q").exit_code == 1
    r = invoke("gc", "--store", path, "--corrupt", "--yes", "-q")
    assert r.exit_code == 0 and f"chunk 1 of 1 ({entries[1].key[:12]}) is missing" in r.stdout
    assert "Removed 1 context and 0 entries" in r.stdout
    v = invoke("verify", "--store", path, "-q")
    assert v.exit_code == 0 and "3 entries and 3 contexts verified, all intact." in v.stdout


def test_gc_max_size_least_recently_used_first(store):
    path, entries = store
    with KVStore(path, readonly=True) as s:
        sizes = {e.key: e.stored_bytes for e in s.scan().entries}
    budget = sizes[entries[0].key] + sizes[entries[2].key]  # room for the two most recently used
    dry = invoke("gc", "--store", path, "--max-size", f"{budget}", "--dry-run")
    assert dry.exit_code == 0
    listed = [line.split()[1] for line in dry.stdout.splitlines()[1:3]]
    assert listed == [entries[3].key[:12], entries[1].key[:12]]  # oldest use first
    r = invoke("gc", "--store", path, "--max-size", f"{budget}B", "--yes")
    assert r.exit_code == 0 and "Removed 2 contexts and 2 entries" in r.stdout
    assert keys_in(path) == {entries[0].key, entries[2].key}
    assert "Nothing to remove." in invoke("gc", "--store", path, "--max-size", "1GiB", "--yes").stdout


def test_gc_older_than_and_model(store):
    path, entries = store
    r = invoke("gc", "--store", path, "--older-than", "30d", "--model", "tiny", "--yes")
    assert r.exit_code == 0 and "unused for 40.0 days" in r.stdout
    assert keys_in(path) == {entries[0].key, entries[2].key, entries[3].key}
    r = invoke("gc", "--store", path, "--older-than", "1w", "--yes")
    assert r.exit_code == 0
    assert keys_in(path) == {entries[0].key}


def test_gc_bad_arguments(store):
    path, entries = store
    for args in (["--max-size", "10XB"], ["--max-size", "-5GiB"], ["--older-than", "soon"], ["--grace", "1"]):
        r = invoke("gc", "--store", path, *args, "--yes")
        assert r.exit_code == 2, args
        assert r.stderr.strip().splitlines()[-1].startswith("Error:"), r.stderr
    assert "'10XB' is not a size" in invoke("gc", "--store", path, "--max-size", "10XB").stderr
    assert keys_in(path) == {e.key for e in entries}


# -- bad stores: one line, exit 1, nothing lost ----------------------------------------------------------
COMMANDS = [["ls"], ["stats"], ["verify"], ["rm", "abc", "--yes"], ["gc", "--corrupt", "--yes"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_missing_store(cmd, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    code, out, err = run_main(capsys, *cmd, "--store", str(missing))
    assert code == 1 and out == ""
    assert err == f"kvstore: error: no store at {missing}; build one first with `kvstore build`\n"
    assert not missing.exists()  # no command creates a store by accident


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_store_path_is_a_file(cmd, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("precious")
    code, out, err = run_main(capsys, *cmd, "--store", str(f))
    assert code == 1 and len(err.splitlines()) == 1 and "is a file" in err and "Traceback" not in err
    assert f.read_text() == "precious"


def test_future_format_store(store, capsys):
    path, entries = store
    with KVStore(path) as s:
        s.backend.put(b"meta", json.dumps({"format": STORE_FORMAT + 1, "codec": "raw", "created": 0}).encode())
    for cmd in COMMANDS:
        code, out, err = run_main(capsys, *cmd, "--store", path)
        assert code == 1 and len(err.splitlines()) == 1 and "upgrade kvstore" in err, cmd
    b = open_backend(path, readonly=True)
    try:
        assert len(list(b.keys(b"e/"))) == len(entries)  # refused, not touched
    finally:
        b.close()


def test_verify_exit_code_through_main(store, capsys):
    path, entries = store
    damage(path, entries[0].key)
    code, out, err = run_main(capsys, "verify", "--store", path, "--quiet")
    assert code == 1 and entries[0].key in out
    assert err == (
        "kvstore: error: 1 of 4 entries corrupt; 1 of 4 contexts broken; "
        "`kvstore gc --corrupt` removes corrupt entries\n"
    )


def test_help_does_not_import_torch():
    code = (
        "import sys, kvstore.cli.main, kvstore.cli.common, kvstore.cli.manage\n"
        "from click.testing import CliRunner\n"
        "for cmd in (['--help'], ['ls', '--help'], ['gc', '--help'], ['rm', '--help']):\n"
        "    assert CliRunner().invoke(kvstore.cli.main.app, cmd).exit_code == 0\n"
        "bad = [m for m in ('torch', 'transformers', 'tqdm', 'kvstore.store') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


# -- kvstore.cli.common helpers ---------------------------------------------------------------------------------
def test_parse_size():
    assert parse_size("10GiB") == 10 << 30
    assert parse_size("512 mib") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("4096") == parse_size("4096B") == 4096
    assert parse_size("0") == 0
    for bad in ("", "GiB", "-1GiB", "1e9", "10XB", "ten", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_parse_duration():
    assert parse_duration("30d") == 30 * DAY
    assert parse_duration("12h") == 12 * 3600
    assert parse_duration("90m") == 90 * 60
    assert parse_duration("45s") == 45
    assert parse_duration("2W") == 14 * DAY
    assert parse_duration("1.5d") == 1.5 * DAY
    assert parse_duration("1d 12h") == 1.5 * DAY
    for bad in ("", "30", "d", "-1d", "1y", "1d x"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_render_table_and_emit(capsys):
    text = render_table([["a", 1, 1.5, None], ["bbbb", 22, None, "x"]], ["name", "n", "ratio", "z"])
    assert text.splitlines() == ["name   n  ratio  z", "a      1   1.50  -", "bbbb  22      -  x"]
    assert render_table([], ["a", "b"]) == "a  b"
    rows = [{"k": "x", "n": 1}, {"k": "y", "n": 2, "extra": True}]
    emit(rows, "json")
    assert json.loads(capsys.readouterr().out) == rows
    emit(rows, "csv")
    assert capsys.readouterr().out.splitlines() == ["k,n,extra", "x,1,", "y,2,True"]
    emit(rows, "table", columns={"n": "N", "k": "KEY"}, formatters={"k": str.upper})
    assert capsys.readouterr().out.splitlines() == ["N  KEY", "1  X", "2  Y"]


def test_progress_bar_is_a_callback(capsys):
    with progress_bar(3, "work", quiet=False, unit="entry") as bar:
        for i in range(3):
            bar(i + 1, 3)
    assert "work" in capsys.readouterr().err
    with progress_bar(3, "work", quiet=True) as bar:
        bar(1, 3)
        bar.update(1)
    assert capsys.readouterr().err == ""


# -- derived entries (issue 35, item 3) ------------------------------------------------------------
@pytest.fixture
def derived_store(store):
    """The 4-context store, with scores and a pressed cache for the first context, scores for the
    third, and a context stored only as a pressed cache (``7...7``, 20 tokens)."""
    from helpers.entries import put_derived

    path, entries = store
    with KVStore(path) as s:
        first = put_derived(s, entries[0].key, 8)
        put_derived(s, entries[2].key, 24, fp=FP_OTHER, name="other", kinds=("scores",))
        only = put_derived(s, "7" * 64, 20, kinds=("pressed",))
    return path, entries, first, only


def test_ls_shows_what_each_context_has_of_derived_entries(derived_store):
    path, entries, first, only = derived_store
    r = invoke("ls", "--store", path)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split()[-1] == "DERIVED" and "5 contexts" in lines[-1]
    row = next(line for line in lines if line.startswith(entries[0].key[:12]))
    assert "pressed knorm:0.5 raw 50%" in row and "scores knorm raw" in row
    pressed_only = next(line for line in lines if line.startswith("777777777777"))
    assert pressed_only.split()[4:6] == ["20", "0"]  # tokens from its header, no chunk
    rows = {row["key"]: row for row in json.loads(invoke("ls", "--store", path, "--format", "json").stdout)}
    assert {d["kind"] for d in rows[entries[0].key]["derived"]} == {"scores", "pressed"}
    assert rows["7" * 64]["chunks"] == 0 and rows["7" * 64]["derived"][0]["kept_fraction"] == 0.5
    assert rows[entries[1].key]["derived"] == [] and rows[entries[1].key]["derived_bytes"] == 0
    cells = {row["key"]: row["derived"] for row in csv.DictReader(io.StringIO(
        invoke("ls", "--store", path, "--format", "csv").stdout))}  # fmt: skip
    assert cells[entries[1].key] == "-" and "pressed knorm:0.5" in cells["7" * 64]


def test_ls_derived_lists_one_row_per_derived_entry(derived_store):
    path, entries, first, only = derived_store
    r = invoke("ls", "--store", path, "--derived", "--full-keys")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].split()[:4] == ["CONTEXT", "KEY", "KIND", "SPEC"]
    assert first["pressed"] in r.stdout and only["pressed"] in r.stdout and "4 derived entries" in r.stdout
    rows = json.loads(invoke("ls", "--store", path, "--derived", "--format", "json", "--model", "other").stdout)
    assert [(row["kind"], row["context"]) for row in rows] == [("scores", entries[2].key)]
    assert rows[0]["press"] == {"method": "knorm"} and rows[0]["stored_bytes"] > 0
    bad = invoke("ls", "--store", path, "--derived", "--chunks")
    assert bad.exit_code == 2 and "--chunks and --derived" in bad.stderr


def test_stats_totals_derived_entries_by_kind(derived_store):
    path, *_ = derived_store
    r = invoke("stats", "--store", path)
    assert r.exit_code == 0, r.output
    assert "Total: 5 contexts, 100 tokens; 4 chunks" in r.stdout
    assert "Derived, pressed: 2 entries of 2 contexts" in r.stdout and "keeping 50.0%" in r.stdout
    assert "Derived, scores: 2 entries of 2 contexts" in r.stdout
    doc = json.loads(invoke("stats", "--store", path, "--format", "json").stdout)
    kinds = {d["kind"]: d for d in doc["derived"]}
    assert kinds["pressed"]["entries"] == 2 and kinds["pressed"]["kept_fraction"] == 0.5
    assert doc["totals"]["derived_entries"] == 4 and doc["totals"]["orphan_derived"] == 0
    assert sum(g["contexts"] for g in doc["groups"]) == 4  # the groups are the contexts with chunks


def test_verify_checks_every_byte_of_derived_entries(derived_store):
    path, entries, first, only = derived_store
    ok = invoke("verify", "--store", path, "-q")
    assert ok.exit_code == 0 and "8 entries (4 derived) and 5 contexts verified, all intact." in ok.stdout
    with KVStore(path) as s:
        name = b"x/" + entries[0].key.encode() + b"/" + first["pressed"].encode()
        raw = bytearray(s.backend.get(name))
        raw[-30] ^= 0xFF
        s.backend.put(name, bytes(raw))
    assert invoke("ls", "--store", path).exit_code == 0  # a listing reads headers only
    r = invoke("verify", "--store", path, "-q")
    assert r.exit_code == 1
    assert f"corrupt  {first['pressed']}  entry checksum mismatch" in r.stdout
    assert f"(derived entry of context {entries[0].key})" in r.stdout
    assert "1 of 8 entries corrupt (0 of 4 chunk entries, 1 of 4 derived entries)" in r.stderr
    g = invoke("gc", "--store", path, "--corrupt", "--yes", "-q")
    assert g.exit_code == 0 and "Removed 0 contexts, 0 entries and 1 derived entry" in g.stdout
    assert invoke("verify", "--store", path, "-q").exit_code == 0


def test_rm_removes_a_context_with_its_derived_entries(derived_store):
    path, entries, first, only = derived_store
    dry = invoke("rm", "--store", path, entries[0].key[:10], "--dry-run")
    assert dry.exit_code == 0 and "1 context, 1 entry and 2 derived entries to remove" in dry.stdout
    assert dry.stdout.count("derived entry of a removed context (asked for)") == 2
    r = invoke("rm", "--store", path, entries[0].key[:10], "--yes")
    assert r.exit_code == 0 and "Removed 1 context, 1 entry and 2 derived entries" in r.stdout
    with KVStore(path, readonly=True) as s:
        assert s.derived_keys(entries[0].key) == [] and s.derived_keys("7" * 64) == [only["pressed"]]
    r = invoke("rm", "--store", path, "7777", "--yes")
    assert r.exit_code == 0 and "Removed 1 context, 0 entries and 1 derived entry" in r.stdout


def test_gc_collects_derived_entries_whose_context_is_gone(derived_store):
    path, entries, first, only = derived_store
    with KVStore(path) as s:
        s.backend.delete(b"r/" + entries[2].key.encode())  # an older kvstore removed the context
        s.backend.put(b"a/" + entries[2].key.encode(), struct.pack("<d", time.time() - 2 * 3600))
        old = time.time() - 2 * 3600
        for key in s.derived_keys(entries[2].key):
            s.backend.put(b"a/" + key.encode(), struct.pack("<d", old))
    assert "Unused: 1 derived entry whose context is gone" in invoke("stats", "--store", path).stdout
    r = invoke("gc", "--store", path, "--yes", "-q")
    assert r.exit_code == 0 and "Removed 0 contexts, 1 entry and 1 derived entry" in r.stdout
    with KVStore(path, readonly=True) as s:
        assert s.derived_keys(entries[2].key) == [] and len(s.derived_keys(entries[0].key)) == 2


def test_sync_and_export_copy_derived_entries(derived_store, tmp_path):
    path, entries, first, only = derived_store
    dst = str(tmp_path / "copy")
    r = invoke("sync", path, dst, "-q")
    assert r.exit_code == 0 and "4 derived entries" in r.stdout, r.output
    assert invoke("verify", "--store", dst, "-q").stdout == invoke("verify", "--store", path, "-q").stdout
    out = tmp_path / "exported"
    e = invoke("export", str(out), "--store", path, "-q")
    assert e.exit_code == 0 and "Exported 4 context(s) and 4 derived entries" in e.stdout, e.output
    assert (out / f"{'7' * 64}.pressed.{only['pressed']}.safetensors").exists()


def test_ls_and_stats_ratio_a_lossy_store_against_the_model_dtype(tmp_path):
    """Issue 45, finding 8: ``ratio`` is over the payload before compression (for int8, the codes);
    KV-RATIO (``kv_ratio``, stats' ``stored_to_kv``) is over the keys and values in the model's
    dtype, so a lossy codec's saving shows."""
    from kvstore.store.keys import chain_keys, chain_seed

    ids = list(range(256))
    [key] = chain_keys(chain_seed(FP_TINY, torch.float32, device="cpu", attn="sdpa"), ids, [(0, 256)])
    g = torch.Generator().manual_seed(0)
    layers = tuple((torch.randn(4, 256, 64, generator=g), torch.randn(4, 256, 64, generator=g)) for _ in range(2))
    entry = Entry(key, FP_TINY, "tiny", torch.tensor(ids), layers, time.time(), "", 0,
                  numerics={"device": "cpu", "attn": "sdpa"})  # fmt: skip
    path = str(tmp_path / "int8")
    with KVStore(path, codec="int8") as s:
        s.put(entry)
        s.put_context(key, [key], 256)
    runner = CliRunner()
    [row] = json.loads(runner.invoke(app, ["ls", "--store", path, "--format", "json"]).stdout)
    assert row["ratio"] > 0.5 and row["kv_ratio"] < 0.4  # float32 -> int8 codes: about a quarter
    assert row["kv_ratio"] == round(row["stored_bytes"] / (2 * 2 * 4 * 256 * 64 * 4), 4)  # 2 layers of K and V
    table = runner.invoke(app, ["ls", "--store", path]).stdout
    assert "KV-RATIO" in table and f"{row['kv_ratio']:.3f}" in table
    [group] = json.loads(runner.invoke(app, ["stats", "--store", path, "--format", "json"]).stdout)["groups"]
    assert group["stored_to_kv"] < 0.4 and "KV-RATIO" in runner.invoke(app, ["stats", "--store", path]).stdout
