"""Entries this kvstore cannot read but that are no damage (issue 45, findings 3 and 4): a header
that says a format newer than this code's (its checksum intact), or a derived entry of a kind this
process does not know (a plug-in's). They are their own class across management: ``verify`` reports
them and exits 0, ``ls``/``stats`` list them apart with "upgrade kvstore", ``gc --corrupt`` and
plain ``gc`` remove neither them nor their contexts nor the contexts' other entries, ``sync`` copies
them byte for byte, ``export`` skips them and exits 1."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from helpers.entries import assemble, make_chain, put_derived, split, store_chain
from kvstore.cli.main import app
from kvstore.store.frame import FORMAT_VERSION
from kvstore.store.keyspace import entry_key, owned_key
from kvstore.store.kvstore import KVStore


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


NEWER = FORMAT_VERSION + 1  # a format no release of this code writes


def _newer(blob: bytes) -> bytes:
    """The same entry, its header saying a format newer than this code's, resealed (a valid checksum)."""
    header, payload = split(blob)
    header["format"] = NEWER
    return assemble(header, payload)


def _everything(path: str) -> dict[bytes, bytes]:
    with KVStore(path, readonly=True) as s:
        return {k: s.backend.get(k) for k in s.backend.keys()}


def populated(path: str) -> dict[str, Any]:
    """A recorded context whose last chunk is of a newer format, owning readable scores; a context stored
    only as a pressed cache of a newer format, owning readable scores; a plain context."""
    newer_chain = make_chain(list(range(10, 21)))
    plain = make_chain(list(range(40, 49)))
    pressed_only = "5" * 64
    with KVStore(path) as s:
        store_chain(s, newer_chain)
        store_chain(s, plain)
        context = newer_chain[-1].key
        name = entry_key(context)
        s.backend.put(name, _newer(s.backend.get(name)))
        owned = put_derived(s, context, 11, kinds=("scores",))
        pressed = put_derived(s, pressed_only, 9, seed=1)
        pname = owned_key(pressed_only, pressed["pressed"])
        s.backend.put(pname, _newer(s.backend.get(pname)))
    return {"context": context, "scores": owned["scores"], "plain": plain[-1].key, "pressed_only": pressed_only,
            "pressed": pressed["pressed"], "pressed_scores": pressed["scores"]}  # fmt: skip


@pytest.fixture
def store(tmp_path) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path / "store")
    return path, populated(path)


def test_verify_reports_them_apart_and_exits_0(store):
    path, keys = store
    r = invoke("verify", "--store", path, "-q")
    assert r.exit_code == 0, r.output
    assert f"unknown  {keys['context']}  entry was written by format version {NEWER}" in r.stdout
    assert f"unknown  {keys['pressed']}" in r.stdout and "corrupt" not in r.stdout and "broken" not in r.stdout
    assert "2 entries of a newer format" in r.stderr and "upgrade kvstore" in r.stderr
    with KVStore(path, readonly=True) as s:
        info = s.verify()
        assert not info.corrupt and {u.key for u in info.unknown} == {keys["context"], keys["pressed"]}
        assert not info.orphan_owned  # the pressed-only context's scores have a context: a newer writer's


def test_a_newer_entry_with_a_bad_checksum_is_corrupt(store):
    path, keys = store
    with KVStore(path) as s:
        raw = bytearray(s.backend.get(entry_key(keys["context"])))
        raw[-20] ^= 0xFF
        s.backend.put(entry_key(keys["context"]), bytes(raw))
        assert [c.key for c in s.verify().corrupt] == [keys["context"]]


def test_ls_and_stats_list_them_with_the_advice_to_upgrade(store):
    path, keys = store
    r = invoke("ls", "--store", path)
    assert r.exit_code == 0, r.output
    assert "upgrade kvstore" in r.stderr and "gc --corrupt" not in r.stderr
    r = invoke("stats", "--store", path)
    assert r.exit_code == 0 and "Unknown: 2 entries" in r.stdout and "Unreadable" not in r.stdout
    assert json.loads(invoke("stats", "--store", path, "--format", "json").stdout)["totals"]["unknown"] == 2


def test_gc_corrupt_removes_nothing_of_theirs(store):
    path, keys = store
    before = _everything(path)
    r = invoke("gc", "--store", path, "--corrupt", "--dry-run")
    assert r.exit_code == 0, r.output
    assert keys["context"][:12] not in r.stdout and keys["pressed_only"][:12] not in r.stdout
    r = invoke("gc", "--store", path, "--corrupt", "--yes", "-q")
    assert r.exit_code == 0, r.output
    assert _everything(path) == before  # the newer entries, their contexts and their scores stay


def test_plain_gc_keeps_the_scores_of_a_context_known_by_a_newer_pressed_cache(store):
    path, keys = store
    before = _everything(path)
    r = invoke("gc", "--store", path, "--grace", "0s", "--yes", "-q")  # orphans past a grace of 0
    assert r.exit_code == 0, r.output
    assert _everything(path) == before


def test_sync_copies_them_byte_for_byte(store, tmp_path):
    path, keys = store
    dst = str(tmp_path / "copy")
    r = invoke("sync", path, dst, "-q")
    assert r.exit_code == 0, r.output
    assert r.stderr.count("copied as it is") == 2
    src = _everything(path)
    assert _everything(dst) == src
    with KVStore(dst, readonly=True) as d:
        info = d.verify()
        assert not info.corrupt and len(info.unknown) == 2


def test_export_skips_them_and_exits_1(store, tmp_path):
    path, keys = store
    out = tmp_path / "out"
    r = invoke("export", "--store", path, str(out), "-q", "--format", "json")
    assert r.exit_code == 1
    report = json.loads(r.stdout)
    assert sorted(report["unknown_keys"]) == sorted([keys["context"], keys["pressed"]])
    assert "newer format or an unknown kind" in r.stderr
    assert (out / f"{keys['plain']}.safetensors").exists() and not (out / f"{keys['context']}.safetensors").exists()
