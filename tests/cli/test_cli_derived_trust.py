"""Issue 42 from the command line: a dry run creates nothing and says what a new store would get; no
build output that gc would delete; a corrupt pressed entry is rebuilt; exit codes and messages say
what happened, in the words the user typed."""

from __future__ import annotations

import json

import pytest

from helpers.cli import run_main, write_dataset
from kvstore.store.keyspace import META, derived_entry_key
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import PRESSED


@pytest.fixture
def data(tmp_path):
    return write_dataset(tmp_path / "qa.jsonl", range(3), questions=1)


def _common(model_dir, store) -> list[str]:
    return ["--model", str(model_dir), "--store", str(store), "--quiet", "--no-chat"]


def _json(capsys, *args) -> dict:
    code, out, err = run_main(capsys, *map(str, args), "--format", "json")
    assert code == 0, err
    return json.loads(out)


def _error(capsys, *args) -> str:
    code, _, err = run_main(capsys, *map(str, args))
    assert code != 0, args
    lines = [x for x in err.splitlines() if x.startswith("kvstore: error")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("backend", ["lmdb", "memory"])
def test_a_dry_run_creates_nothing_and_reports_the_new_stores_settings(tiny_llama_dir, tmp_path, data, capsys, backend):
    url = str(tmp_path / "new" / "store") if backend == "lmdb" else "memory://issue42-dry-run"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + json.dumps({"id": "broken"}) + "\n")
    flags = ["--chunk-tokens", "128", "--codec", "int8", "--press", "knorm:0.5"]
    code, out, err = run_main(capsys, "build", str(bad), *_common(tiny_llama_dir, url), *flags, "--dry-run",
                              "--skip-bad-rows", "--format", "json")  # fmt: skip
    assert code == 0, err
    if backend == "lmdb":
        assert not (tmp_path / "new").exists()  # no directory, no meta, no lock file
    else:
        with KVStore(url, readonly=True) as kv:
            assert not kv.backend.contains(META) and list(kv.backend.keys()) == []
    # the real build then gets the flags' settings, not the defaults a dry run wrote
    built = _json(capsys, "build", data, *_common(tiny_llama_dir, url), "--chunk-tokens", "128")
    assert built["built"] == 3
    with KVStore(url, readonly=True) as kv:
        assert kv.chunk_tokens == 128
    # what the dry run said: the settings a new store would get, the rows it would skip
    plan = json.loads(out)
    assert plan["store_exists"] is False and plan["chunk_tokens"] == 128 and plan["codec"].startswith("int8")
    assert plan["bad_rows_skipped"] == 1 and "would skip" in err and "missing field 'context'" in err
    assert plan["to_compute"] == 3 and plan["pressed_to_make"] == 3
    again = _json(capsys, "build", data, *_common(tiny_llama_dir, url), "--dry-run")
    assert again["store_exists"] is True and again["to_skip"] == 3 and again["chunk_tokens"] == 128


def test_no_dense_with_scores_alone_is_refused_naming_the_flags(tiny_llama_dir, tmp_path, data, capsys):
    store = tmp_path / "s"
    line = _error(capsys, "build", data, *_common(tiny_llama_dir, store), "--no-dense", "--score", "kvzip")
    assert "--no-dense" in line and "--score" in line and "--press" in line
    line = _error(capsys, "build", data, *_common(tiny_llama_dir, store), "--no-dense")
    assert "--no-dense" in line and "dense=False" not in line
    assert not store.exists()


def _flip_pressed(url: str) -> None:
    with KVStore(url) as kv:
        for context in kv.context_keys():
            for key in kv.derived_keys(context):
                with kv.open_derived(context, key) as view:
                    kind = view.header.kind
                if kind == PRESSED:
                    name = derived_entry_key(context, key)
                    raw = bytearray(kv.backend.get(name))
                    raw[len(raw) // 2] ^= 0xFF
                    kv.backend.put(name, bytes(raw))
                    return
    raise AssertionError("no pressed entry")


def test_a_corrupt_pressed_entry_is_rebuilt(tiny_llama_dir, tmp_path, data, capsys):
    url = str(tmp_path / "s")
    common = _common(tiny_llama_dir, url)
    assert _json(capsys, "build", data, *common, "--press", "snapkv:0.5")["pressed_written"] == 3
    _flip_pressed(url)
    plan = _json(capsys, "build", data, *common, "--press", "snapkv:0.5", "--dry-run")
    assert plan["pressed_to_make"] == 1  # verified as chunks are, not only found
    again = _json(capsys, "build", data, *common, "--press", "snapkv:0.5")
    assert again["pressed_written"] == 1 and again["chunks_written"] == 0
    code, out, err = run_main(capsys, "verify", "--store", url)
    assert code == 0, err


def test_verify_and_export_name_a_corrupt_derived_entry_and_fail(tiny_llama_dir, tmp_path, data, capsys):
    url = str(tmp_path / "s")
    _json(capsys, "build", data, *_common(tiny_llama_dir, url), "--press", "snapkv:0.5")  # + snapkv's scores
    _flip_pressed(url)
    code, out, err = run_main(capsys, "export", "--store", url, str(tmp_path / "out"))
    assert code == 1 and "1 corrupt derived entry" in err  # as sync: what it skipped is a failure
    line = _error(capsys, "verify", "--store", url)
    assert "1 of 9 entries corrupt (0 of 3 chunk entries, 1 of 6 derived entries)" in line


def test_score_quotes_what_was_typed_and_ignores_a_ratio(tiny_llama_dir, tmp_path, data, capsys):
    common = _common(tiny_llama_dir, tmp_path / "s")
    line = _error(capsys, "build", data, *common, "--score", "bogus")
    assert "'bogus'" in line and "bogus:0" not in line and "unknown press" in line
    plan = _json(capsys, "build", data, *common, "--score", "kvzip:1.5", "--dry-run")  # a ratio --score ignores
    assert plan["scores_to_make"] == 3


def test_a_registered_press_name_on_the_command_line_gets_a_hint(tiny_llama_dir, tmp_path, data, capsys):
    line = _error(capsys, "build", data, *_common(tiny_llama_dir, tmp_path / "s"), "--press", "my_registered:0.5")
    assert "unknown press 'my_registered'" in line and "register_press" in line and "process" in line


def test_a_press_given_twice_is_written_once(tiny_llama_dir, tmp_path, data, capsys):
    built = _json(capsys, "build", data, *_common(tiny_llama_dir, tmp_path / "s"), "--press", "knorm:0.5",
                  "--press", "knorm:0.5:head")  # fmt: skip
    assert built["pressed_written"] == 3  # one entry per context, however often it was asked for


def test_scores_written_is_a_number_when_presses_store_scores(tiny_llama_dir, tmp_path, data, capsys):
    built = _json(capsys, "build", data, *_common(tiny_llama_dir, tmp_path / "s"), "--press", "snapkv:0.5")
    assert built["scores_written"] == 3  # snapkv's scores, stored on their first use by the press


def test_sync_codec_says_what_it_did_with_derived_entries(tiny_llama_dir, tmp_path, data, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _json(capsys, "build", data, *_common(tiny_llama_dir, src), "--press", "knorm:0.5")
    code, out, err = run_main(capsys, "sync", src, dst, "--codec", "int8", "--format", "json")
    assert code == 0, err
    assert "3 derived entries" in err and "not copied" in err
    assert json.loads(out)["derived_not_converted"] == 3
    code, out, err = run_main(capsys, "sync", src, src, "--codec", "int8")
    assert code == 0 and "3 derived entries" in err and "stay as they are" in err


def test_a_sweep_reports_the_share_of_pairs_kept_beside_the_rounded_kept_tokens(tiny_llama_dir, tmp_path, data, capsys):
    common = ["--model", str(tiny_llama_dir), "--no-cache", "--quiet", "--no-chat", "-n", "1"]
    got = _json(
        capsys, "sample", data, *common, "--variant", "kvzip:0.75", "--variant", "kvzip:0.99", "--variant", "dense"
    )
    table = {row["variant"]: row for row in got["variants"]}
    assert table["dense"]["kept_fraction"] == 1.0
    for name in ("kvzip:0.75", "kvzip:0.99"):  # the cache bytes over the dense ones: (token, head) pairs kept
        row = table[name]
        assert row["kept_fraction"] == round(row["cache_bytes"] / table["dense"]["cache_bytes"], 4) > 0
    assert 0.2 < table["kvzip:0.75"]["kept_fraction"] < 0.3
