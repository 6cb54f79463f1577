"""Entry kinds are one table (issue 40, item 1) and a kind owns its format (issue 48, item 4): a
kind of entry a context owns defined in one test module (``helpers/kind_summary.py``: its layer
record type, a header field of its own, its view and its encoder; one ``register_kind``) is put,
opened, listed, counted, verified, removed with its context, collected as an orphan or as corrupt,
synced and exported by the same commands as the built-in scores and pressed caches, with no line of
the store's management knowing its name."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from helpers.entries import FP_TINY, make_chain, store_chain
from helpers.kind_summary import SummaryKind, SummaryLayer, SummaryView, encode_summary
from kvstore.cli.main import app
from kvstore.store.gc import GcOptions, plan_gc
from kvstore.store.keyspace import owned_key
from kvstore.store.kinds import find_kind, register_kind, unregister_kind
from kvstore.store.kvstore import KVStore
from kvstore.store.owned_header import OwnedFacts
from kvstore.store.removal import execute_plan

LATER = 7200.0  # a plan made two hours later: past the default grace


@pytest.fixture
def summary_kind():
    kind = register_kind(SummaryKind())
    yield kind
    unregister_kind(kind.name)


def summary_blob(context: str, n_tokens: int, seed: int = 0) -> tuple[str, bytes]:
    facts = OwnedFacts(context, FP_TINY, "tiny", "float32", n_tokens, {"device": "cpu"})
    g = torch.Generator().manual_seed(seed)
    return encode_summary(facts, [torch.rand(2, generator=g) for _ in range(2)], summary_of="values")


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def populated(path: str) -> tuple[str, str, str]:
    """A recorded context with a summary; a summary whose context is not stored (an orphan)."""
    chain = make_chain(list(range(20, 33)))
    orphan = "7" * 64
    with KVStore(path) as s:
        store_chain(s, chain)
        context = chain[-1].key
        key, blob = summary_blob(context, 13)
        s.put(blob)  # the one put: kind, owner and key read from the frame
        orphan_key, orphan_blob = summary_blob(orphan, 9, seed=1)
        s.put(orphan_blob)
    return context, key, orphan_key


def test_a_kind_defined_in_a_test_is_managed_like_the_built_in_ones(tmp_path, summary_kind):
    path = str(tmp_path / "store")
    context, key, orphan_key = populated(path)

    listed = json.loads(invoke("ls", "--store", path, "--derived", "--format", "json").stdout)
    assert {(r["kind"], r["key"]) for r in listed} == {("summary", key), ("summary", orphan_key)}
    assert all(r["kept_fraction"] is None for r in listed)  # keeps no part of its context
    contexts = json.loads(invoke("ls", "--store", path, "--format", "json").stdout)
    assert [d["key"] for c in contexts if c["key"] == context for d in c["derived"]] == [key]
    assert "7" * 64 not in {c["key"] for c in contexts}  # a summary does not stand for its context

    with KVStore(path, readonly=True) as s:  # one scan, one table: its chunks and the entries contexts own
        table = s.scan().entries
        assert len(table) == 4 and sorted(d.key for d in table.owned) == sorted([key, orphan_key])  # 4 chunks
    stats = json.loads(invoke("stats", "--store", path, "--format", "json").stdout)
    assert [(k["kind"], k["entries"]) for k in stats["derived"]] == [("summary", 2)]

    assert invoke("verify", "--store", path, "-q").exit_code == 0

    out = tmp_path / "out"
    r = invoke("export", "--store", path, str(out), "-q")
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    exported = load_file(str(out / f"{context}.summary.{key}.safetensors"))
    assert sorted(exported) == ["layers.0.summary", "layers.1.summary"]

    dst = str(tmp_path / "copy")
    r = invoke("sync", path, dst, "-q")
    assert r.exit_code == 0, r.output
    with KVStore(dst, readonly=True) as d:
        assert d.derived_keys(context) == [key] and not d.verify().corrupt
        assert d.has(summary_kind, key, context) and not d.has(summary_kind, key, "7" * 64)
        with d.open(summary_kind, key, owner=context) as view:  # the store's one open, for any kind
            assert isinstance(view, SummaryView) and view.header.kind == "summary"
            assert view.header.fields == {"summary_of": "values"}  # its own header field, read back
            assert view.header.layers == (SummaryLayer(2, "mean-norm"),) * 2  # its own record type
            assert view.summary(1).shape == (2,)
        chunk = find_kind("chunk")
        assert chunk is not None and d.has(chunk, context)
        with d.open(chunk, context) as view:
            assert view is not None and view.header.key == context

    with KVStore(path) as s:  # the orphan goes past the grace
        plan = plan_gc(s.scan(), GcOptions(orphans=True), now=time.time() + LATER)
        assert [(r.kind, r.owner, r.key) for r in plan.entries] == [("summary", "7" * 64, orphan_key)]
        execute_plan(s, plan)
        assert s.derived_keys("7" * 64) == []

    r = invoke("rm", "--store", path, context[:12], "--yes")  # its context goes, and the summary with it
    assert r.exit_code == 0, r.output
    with KVStore(path, readonly=True) as s:
        assert s.derived_keys(context) == [] and len(s.scan().contexts) == 0


def test_a_corrupt_entry_of_the_new_kind_is_found_and_collected(tmp_path, summary_kind):
    path = str(tmp_path / "store")
    context, key, _ = populated(path)
    with KVStore(path) as s:
        raw = bytearray(s.backend.get(owned_key(context, key)))
        raw[-30] ^= 0xFF
        s.backend.put(owned_key(context, key), bytes(raw))
        with pytest.warns(UserWarning, match="corrupt"), s.open(find_kind("summary"), key, owner=context) as view:
            assert view is None  # a miss
    assert invoke("verify", "--store", path, "-q").exit_code != 0
    r = invoke("gc", "--store", path, "--corrupt", "--yes", "-q")
    assert r.exit_code == 0, r.output
    with KVStore(path, readonly=True) as s:
        assert s.derived_keys(context) == [] and not s.verify().corrupt


def test_an_unregistered_kind_is_kept_copied_and_reported_never_corrupt(tmp_path, summary_kind):
    """Issue 45, finding 4: a process without the plug-in keeps its entries (not corrupt)."""
    path = str(tmp_path / "store")
    context, key, orphan_key = populated(path)
    unregister_kind("summary")
    with KVStore(path, readonly=True) as s:
        before = {k: s.backend.get(k) for k in s.backend.keys()}
        info = s.verify()
        assert not info.corrupt and not info.derived and {u.key for u in info.unknown} == {key, orphan_key}
        assert any("kind 'summary', which this process does not know" in u.reason for u in info.unknown)
    r = invoke("verify", "--store", path, "-q")
    assert r.exit_code == 0 and "unknown" in r.stdout and "corrupt" not in r.stdout, r.output
    r = invoke("ls", "--store", path)
    assert r.exit_code == 0 and "load the plug-in" in r.stderr and "gc --corrupt" not in r.stderr
    for args in (("--corrupt",), ("--grace", "0s")):
        assert invoke("gc", "--store", path, *args, "--yes", "-q").exit_code == 0
    with KVStore(path, readonly=True) as s:
        assert {k: s.backend.get(k) for k in s.backend.keys()} == before  # nothing removed
    dst = str(tmp_path / "copy")
    r = invoke("sync", path, dst, "-q")
    assert r.exit_code == 0 and r.stderr.count("copied as it is") == 2, r.output
    with KVStore(dst, readonly=True) as d:
        assert d.backend.get(owned_key(context, key)) == before[owned_key(context, key)]
    r = invoke("export", "--store", path, str(tmp_path / "out"), "-q")
    assert r.exit_code == 1 and "2 entries of a newer format or an unknown kind" in r.stderr
    register_kind(summary_kind)
    with pytest.raises(ValueError, match="already registered"):
        register_kind(SummaryKind())
    with pytest.raises(ValueError, match="already registered"):
        register_kind(find_kind("pressed"))  # type: ignore[arg-type]
