"""gc and rm remove only what is still unused when they execute (issue 31, items 1 and 3).

A plan may wait (at a prompt, behind a long listing) while builds reuse its chunks; execution
checks again, deletes, checks once more and puts back what a build recorded meanwhile. The
interleavings below are forced deterministically by a backend wrapper that runs a "build" (a
second handle recording a context) at the exact step named, on LMDB, memory and S3 (SeaweedFS).
"""

from __future__ import annotations

import time
import uuid

import pytest

from helpers.entries import make_chain, store_chain
from helpers.hooked import Hooked
from kvstore.store.gc import GcOptions, plan_gc
from kvstore.store.kvstore import KVStore
from kvstore.store.removal import execute_plan

LATER = 7200.0  # plans made "two hours later": every orphan is past the default grace


def _url(request, tmp_path) -> str:
    if request.param == "s3":
        return request.getfixturevalue("s3_url")
    return str(tmp_path / "store") if request.param == "lmdb" else f"memory://removal-{uuid.uuid4().hex}"


@pytest.fixture(params=["lmdb", "memory", "s3"])
def url(request, tmp_path) -> str:
    """The interleavings a store without transactions meets too: LMDB, memory and S3."""
    return _url(request, tmp_path)


@pytest.fixture(params=["lmdb", "memory"])
def local_url(request, tmp_path) -> str:
    """The plan-level checks, the same on every backend (the interleavings above run on S3)."""
    return _url(request, tmp_path)


def contexts() -> tuple[list, list]:
    """Two contexts sharing their first chunk: 4 + 3 chunks, 6 distinct."""
    head = list(range(100, 104))
    return make_chain(head + list(range(7, 16))), make_chain(head + list(range(40, 45)))


def keys(chain) -> list[str]:
    return [e.key for e in chain]


def record(store: KVStore, chain) -> tuple[str, ...]:
    """What a build does once a context's chunks are stored: record it (and check its chunks)."""
    return store.put_context(chain[-1].key, keys(chain), sum(e.n_tokens for e in chain))


def orphans_only(url: str) -> tuple[list, list]:
    """A store holding two contexts' chunks and no record (what a killed build leaves)."""
    a, b = contexts()
    with KVStore(url) as s:
        store_chain(s, a, record=False)
        store_chain(s, b, record=False)
    return a, b


def assert_intact(url: str, *chains) -> None:
    with KVStore(url, readonly=True) as s:
        info = s.verify()
    assert not info.corrupt
    complete = {c.key for c in info.contexts if c.complete}
    assert {chain[-1].key for chain in chains} <= complete, info.contexts


def plan_orphans(store: KVStore):
    return plan_gc(store.scan(), GcOptions(orphans=True), now=time.time() + LATER)


def s3(url: str) -> bool:
    return url.startswith("s3://")


# -- the plan waited while a build reused its chunks ------------------------------------------------
def test_a_plan_that_waited_while_a_build_recorded_on_its_orphans_removes_none(url):
    a, b = orphans_only(url)
    with KVStore(url) as gc:
        plan = plan_orphans(gc)
        assert {k for k, _, _ in plan.remove} == set(keys(a)) | set(keys(b))  # 6 orphans, all planned
        with KVStore(url) as build:  # the build finds every chunk ("skipped") and records both contexts
            assert record(build, a) == () and record(build, b) == ()
        report = execute_plan(gc, plan)
    assert report.entries == () and len(report.kept) == 6
    assert_intact(url, a, b)


def record_during_delete(url: str, when: str):
    """Orphans of two contexts planned for removal; a build records context ``a`` right
    ``when`` ("before" or "after") the first delete of an entry. Returns (what the build's
    record check reported, the execution's report, a's chunks, b's chunks)."""
    a, b = orphans_only(url)
    checked = []
    with KVStore(url) as gc, KVStore(url) as build:
        plan = plan_orphans(gc)

        def hook(op, names, at):
            if at == when and not checked and op.startswith("delete") and any(n.startswith(b"e/") for n in names):
                checked.append(record(build, a))

        gc.backend = Hooked(gc.backend, hook, per_object=s3(url))
        report = execute_plan(gc, plan)
    assert len(checked) == 1
    return checked[0], report, a, b


def test_a_build_recording_between_the_check_and_the_delete_gets_its_chunks_back(url):
    """The narrowest window: the build marks, records and checks (all there) after execution's
    first check and before its delete. The second check sees the record and puts the chunks back."""
    missing, report, a, b = record_during_delete(url, "before")
    assert missing == ()  # the build found every chunk of its context...
    assert set(keys(a)) <= {k for k, _ in report.kept}  # ...and they were put back
    assert set(report.entries) == set(keys(b)) - set(keys(a))  # what nothing uses still goes
    assert_intact(url, a)


def test_a_build_recording_right_after_the_delete_sees_the_loss(url):
    """The build records after the delete: its own check reports the missing chunks (a build then
    computes them again), and execution puts back what it removed under the new record."""
    missing, _, a, _ = record_during_delete(url, "after")
    assert missing  # the build saw at least one of its chunks gone
    assert_intact(url, a)  # and none is missing now


def test_rm_removes_records_before_the_chunks_they_name(local_url):
    a, b = contexts()
    order = []
    with KVStore(local_url) as s:
        store_chain(s, a)
        store_chain(s, b)
        plan = plan_gc(s.scan(), GcOptions(keys=[a[-1].key[:12]]))
        assert {k for k, _, _ in plan.remove} == set(keys(a)[1:])  # the shared head stays for b
        s.backend = Hooked(s.backend, lambda op, names, when: order.extend(n[:2] for n in names if when == "before"),
                           per_object=True)  # fmt: skip
        report = execute_plan(s, plan)
    assert report.contexts == (a[-1].key,) and set(report.entries) == set(keys(a)[1:])
    deletes = [p for p in order if p in (b"r/", b"e/")]
    assert deletes.index(b"r/") < deletes.index(b"e/") and b"r/" not in deletes[deletes.index(b"e/") :]
    assert_intact(local_url, b)


def test_rm_keeps_a_context_used_since_the_plan(local_url):
    a, b = contexts()
    with KVStore(local_url) as s:
        store_chain(s, a)
        store_chain(s, b)
        plan = plan_gc(s.scan(), GcOptions(keys=[a[-1].key[:12]]))
        with KVStore(local_url) as reader:
            reader.touch([a[-1].key])  # a sample used it while the question waited
        report = execute_plan(s, plan)
    assert report.contexts == () and report.entries == ()
    assert (a[-1].key, "used since the plan") in report.kept
    assert_intact(local_url, a, b)


# -- gc --corrupt ------------------------------------------------------------------------------------
def test_gc_corrupt_removes_a_context_whose_chunk_is_missing(local_url):
    """What a kill between the two deletes of an older rm or gc left: a record whose chunk is gone."""
    a, b = contexts()
    with KVStore(local_url) as s:
        store_chain(s, a)
        store_chain(s, b)
        s.backend.delete(b"e/" + a[1].key.encode())
        plan = plan_gc(s.verify(), GcOptions(corrupt=True))
        assert [(k, why) for k, why, _ in plan.contexts] == [(a[-1].key, f"chunk 2 of 4 ({a[1].key[:12]}) is missing")]
        report = execute_plan(s, plan)
        assert report.contexts == (a[-1].key,)
        info = s.verify()
    assert not info.corrupt and all(c.complete for c in info.contexts) and [c.key for c in info.contexts] == [b[-1].key]


def test_gc_corrupt_keeps_a_broken_context_repaired_since_the_plan(local_url):
    a, _ = contexts()
    with KVStore(local_url) as s:
        store_chain(s, a)
        s.backend.delete(b"e/" + a[1].key.encode())
        plan = plan_gc(s.verify(), GcOptions(corrupt=True))
        with KVStore(local_url) as build:  # a build computes the missing chunk again and records the context
            build.put(a[1])
            assert record(build, a) == ()
        report = execute_plan(s, plan)
    assert report.contexts == () and report.kept
    assert_intact(local_url, a)


def test_gc_corrupt_keeps_an_entry_repaired_since_the_plan(local_url):
    a, _ = contexts()
    with KVStore(local_url) as s:
        store_chain(s, a)
        raw = bytearray(s.backend.get(b"e/" + a[2].key.encode()))
        raw[-20] ^= 0xFF
        s.backend.put(b"e/" + a[2].key.encode(), bytes(raw))
        plan = plan_gc(s.verify(), GcOptions(corrupt=True))
        assert {k for k, _, _ in plan.remove} == {a[2].key}
        with KVStore(local_url) as build:  # a writable sample found it corrupt and wrote it again
            build.put_bytes(a[2].key, build.encode(a[2]))
        report = execute_plan(s, plan)
    assert report.entries == () and (a[2].key, "intact again since the plan") in report.kept


# -- a build running while gc removes what it has not recorded yet -----------------------------------
def test_a_build_computes_again_the_chunks_a_gc_took_before_its_record(tiny_llama, tmp_path, monkeypatch):
    """gc with no grace, while a build is between writing a context's chunks and recording it:
    the chunks go (they look unused), the build's record check sees it and computes them again."""
    from helpers.cli import context_text
    from kvstore.model.adapter import Adapter

    adapter = Adapter(*tiny_llama, name="tiny")
    url = str(tmp_path / "store")
    real = KVStore.put_context
    removed: list[str] = []

    def gc_then_record(self, key, chunks, n_tokens):
        if not removed:
            with KVStore(url) as gc:
                removed.extend(execute_plan(gc, plan_gc(gc.scan(), GcOptions(orphans=True, grace=0.0))).entries)
        return real(self, key, chunks, n_tokens)

    monkeypatch.setattr(KVStore, "put_context", gc_then_record)
    with KVStore(url, chunk_tokens=8) as s:
        report = adapter.generate_kv_cache([context_text(i) for i in range(3)], s)
    assert removed and report.built >= 3
    with KVStore(url, readonly=True) as s:
        info = s.verify()
    assert len(info.contexts) == 3 and all(c.complete for c in info.contexts) and not info.corrupt
