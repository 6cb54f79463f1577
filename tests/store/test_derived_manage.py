"""Derived entries managed like everything stored (issue 35, item 3): a scan lists them with their
contexts (and a context stored only as pressed caches), removing a context removes them first,
none outlives its context (an orphan goes past the grace), execution keeps what was used or
recorded since the plan, sync and export copy them verified, old stores open unchanged, an ``rm``
whose records went finds its chunks again, and a scan's memory stays small per entry."""

from __future__ import annotations

import struct
import time
import tracemalloc

import pytest

from helpers.entries import make_chain, put_derived, store_chain
from helpers.paths import GOLDEN
from kvstore.store.export import export_store
from kvstore.store.gc import GcOptions, plan_gc
from kvstore.store.keyspace import access_key, derived_entry_key, entry_key, record_key
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import PRESSED, SCORES
from kvstore.store.removal import execute_plan
from kvstore.store.summary import derived_totals
from kvstore.store.transfer import sync

LATER = 7200.0  # plans made two hours later: past the default grace


@pytest.fixture(params=["lmdb", "memory"])
def url(request, tmp_path) -> str:
    return str(tmp_path / "store") if request.param == "lmdb" else f"memory://derived-manage-{tmp_path.name}"


def chains() -> tuple[list, list, list]:
    """Three contexts; a and b share their first chunk."""
    head = [100, 101, 102, 103]
    return (make_chain(head + list(range(7, 16))), make_chain(head + list(range(40, 45))),
            make_chain(list(range(60, 70))))  # fmt: skip


def keys_of(chain) -> list[str]:
    return [e.key for e in chain]


def populated(url: str) -> tuple[list, list, list, dict, dict]:
    """a (with scores and a pressed cache), b (none), c (scores only); a pressed-only context p."""
    a, b, c = chains()
    with KVStore(url) as s:
        for chain in (a, b, c):
            store_chain(s, chain)
        da = put_derived(s, a[-1].key, 13)
        put_derived(s, c[-1].key, 10, kinds=("scores",))
        dp = put_derived(s, "7" * 64, 21, kinds=("pressed",))
    return a, b, c, da, dp


def test_a_scan_files_derived_entries_under_their_contexts(url):
    a, b, c, da, dp = populated(url)
    with KVStore(url, readonly=True) as s:
        info = s.scan()
    assert info.n_entries == 9 and len(info.derived) == 4 and not info.corrupt
    by_key = {ctx.key: ctx for ctx in info.contexts}
    assert set(by_key) == {a[-1].key, b[-1].key, c[-1].key, "7" * 64}
    ca = by_key[a[-1].key]
    assert sorted(d.kind for d in ca.derived) == [PRESSED, SCORES] and len(ca.chunks) == 4
    assert ca.derived_bytes == sum(d.stored_bytes for d in ca.derived) > 0
    pressed = next(d for d in ca.derived if d.kind == PRESSED)
    assert pressed.kept_fraction == pytest.approx(7 / 13) and pressed.spec == "knorm:0.5" and pressed.codec == "raw"
    p = by_key["7" * 64]  # a context stored only as pressed caches: tokens from its header, no chunk
    assert (p.n_tokens, p.chunks, p.complete, p.model_name, p.dtype) == (21, (), True, "tiny", "float32")
    assert not info.orphan_derived and not info.orphans
    record = ca.as_record()
    assert record["derived_bytes"] == ca.derived_bytes and {d["kind"] for d in record["derived"]} == {PRESSED, SCORES}
    kinds = {t.kind: t for t in derived_totals(info)}
    assert (kinds[PRESSED].entries, kinds[PRESSED].contexts, kinds[SCORES].entries) == (2, 2, 2)


def test_removing_a_context_removes_its_derived_entries_first(url):
    a, b, c, da, dp = populated(url)
    with KVStore(url) as s:
        plan = plan_gc(s.scan(), GcOptions(keys=[a[-1].key[:16]]))
        assert [(ctx, k) for ctx, k, _, _ in plan.derived] == [(a[-1].key, da[SCORES]), (a[-1].key, da[PRESSED])]
        assert all("derived entry of a removed context (asked for)" == why for _, _, why, _ in plan.derived)
        order: list[bytes] = []
        real = s.backend.delete_many

        def spy(keys):
            keys = list(keys)
            order.extend(keys)
            return real(keys)

        s.backend.delete_many = spy  # type: ignore[method-assign]
        report = execute_plan(s, plan)
        assert report.contexts == (a[-1].key,) and set(report.derived) == set(da.values())
        firsts = [k[:2] for k in order if not k.startswith(b"a/")]
        assert firsts.index(b"x/") < firsts.index(b"r/") < firsts.index(b"e/")  # derived, record, chunks
        assert s.derived_keys(a[-1].key) == [] and not s.backend.contains(record_key(a[-1].key))
        assert s.contains(a[0].key)  # shared with b
        info = s.scan()
        assert {ctx.key for ctx in info.contexts} == {b[-1].key, c[-1].key, "7" * 64}


def test_a_context_stored_only_as_pressed_caches_is_removed_with_them(url):
    populated(url)
    with KVStore(url) as s:
        plan = plan_gc(s.scan(), GcOptions(keys=["7777"]))
        assert [k for k, _, _ in plan.contexts] == ["7" * 64] and len(plan.derived) == 1
        report = execute_plan(s, plan)
        assert report.contexts == ("7" * 64,) and len(report.derived) == 1
        assert s.derived_keys("7" * 64) == []


def test_rm_by_a_derived_key_removes_that_entry_only(url):
    a, *_, da, _ = populated(url)
    with KVStore(url) as s:
        plan = plan_gc(s.scan(), GcOptions(keys=[da[PRESSED][:12]]))
        assert not plan.contexts and not plan.remove and [k for _, k, _, _ in plan.derived] == [da[PRESSED]]
        execute_plan(s, plan)
        assert s.derived_keys(a[-1].key) == [da[SCORES]]


def test_a_derived_entry_never_outlives_its_context(url):
    a, b, c, da, dp = populated(url)
    with KVStore(url) as s:
        s.backend.delete(record_key(c[-1].key))  # an older kvstore removed the context: its scores are orphans
        info = s.scan()
        assert [d.context for d in info.orphan_derived] == [c[-1].key]
        assert not plan_gc(info, GcOptions(orphans=True)).derived  # within the grace
        plan = plan_gc(info, GcOptions(orphans=True), now=time.time() + LATER)
        assert [why for *_, why, _ in plan.derived] == ["no context uses it (unused for 2.0 hours)"]
        execute_plan(s, plan)
        assert s.derived_keys(c[-1].key) == [] and s.derived_keys(a[-1].key)


def test_last_use_of_a_derived_entry_keeps_its_context(url):
    a, b, c, da, dp = populated(url)
    old = time.time() - 40 * 86400
    with KVStore(url) as s:
        every = [e.key for chain in (a, b, c) for e in chain] + list(da.values())
        s.backend.put_many([(access_key(k), struct.pack("<d", old)) for k in every])
        s.backend.put(access_key(da[PRESSED]), struct.pack("<d", time.time()))  # a was used through its pressed cache
        info = s.scan()
        dropped = {k for k, _, _ in plan_gc(info, GcOptions(older_than=30 * 86400)).contexts}
        assert a[-1].key not in dropped and {b[-1].key, c[-1].key} <= dropped


def test_a_size_budget_counts_derived_bytes(url):
    a, b, c, da, dp = populated(url)
    with KVStore(url, readonly=True) as s:
        info = s.scan()
    total = info.stored_bytes + info.derived_bytes
    assert not plan_gc(info, GcOptions(max_bytes=total)).contexts
    plan = plan_gc(info, GcOptions(max_bytes=total - 1))
    assert plan.contexts and plan.keep_bytes <= total - 1


def test_execution_keeps_a_derived_entry_used_since_the_plan_and_its_context(url):
    a, *_, da, _ = populated(url)
    with KVStore(url) as s:
        plan = plan_gc(s.scan(), GcOptions(keys=[a[-1].key[:16]]))
        s.backend.put(access_key(da[PRESSED]), struct.pack("<d", time.time() + 5))  # a sample used it meanwhile
        report = execute_plan(s, plan)
        assert not report.contexts and not report.derived and not report.entries
        assert {why for _, why in report.kept} == {
            "used since the plan",  # the pressed cache, and the context's record
            "its context was used since the plan",  # the scores
            "named by a context recorded since the plan",  # the chunks of the record kept
        }
        assert sorted(s.derived_keys(a[-1].key)) == sorted(da.values())


def test_execution_keeps_an_orphan_whose_context_was_recorded_since_the_plan(url):
    a, b, c, da, dp = populated(url)
    with KVStore(url) as s:
        raw = s.backend.get(record_key(c[-1].key))
        s.backend.delete(record_key(c[-1].key))
        plan = plan_gc(s.scan(), GcOptions(orphans=True), now=time.time() + LATER)
        assert len(plan.derived) == 1
        s.backend.put(record_key(c[-1].key), raw)  # a build recorded the context again meanwhile
        report = execute_plan(s, plan)
        assert not report.derived and report.kept[0][1] == "its context was recorded since the plan"


def test_gc_corrupt_removes_a_corrupt_derived_entry_and_drops_nothing_else(url):
    a, *_, da, _ = populated(url)
    with KVStore(url) as s:
        name = derived_entry_key(a[-1].key, da[PRESSED])
        raw = bytearray(s.backend.get(name))
        raw[-30] ^= 0xFF
        s.backend.put(name, bytes(raw))
        assert not s.scan().corrupt  # the payload: only a full check sees it
        info = s.verify()
        assert [(c.context, c.key) for c in info.corrupt] == [(a[-1].key, da[PRESSED])]
        plan = plan_gc(info, GcOptions(corrupt=True))
        assert [k for _, k, _, _ in plan.derived] == [da[PRESSED]] and not plan.contexts and not plan.remove
        execute_plan(s, plan)
        assert s.derived_keys(a[-1].key) == [da[SCORES]] and not s.verify().corrupt


def test_rm_interrupted_after_its_records_finds_the_chunks_again(url):
    """Issue 36: ``rm KEY`` killed after its record went left the chunks for gc past its grace;
    now the re-run finds them from the chain's parent links and removes those no context uses."""
    a, b, c = chains()
    with KVStore(url) as s:
        for chain in (a, b, c):
            store_chain(s, chain)
        s.backend.delete(record_key(a[-1].key))  # what the killed rm did
        plan = plan_gc(s.scan(), GcOptions(keys=[a[-1].key[:16]]))
        assert [k for k, _, _ in plan.remove] == keys_of(a)[1:]  # a's own chunks, the first one last-but-none
        assert [why for _, why, _ in plan.remove] == ["chunk of a removed context (asked for)"] * 2 + ["asked for"]
        execute_plan(s, plan)
        assert set(s.keys()) == set(keys_of(b)) | set(keys_of(c))  # b's chunks (the shared head too) stay


def test_sync_copies_derived_entries_verified_after_the_records(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    a, *_, da, dp = populated(src)
    with KVStore(src) as s:
        name = derived_entry_key("7" * 64, dp[PRESSED])
        raw = bytearray(s.backend.get(name))
        raw[-30] ^= 0xFF
        s.backend.put(name, bytes(raw))
    report = sync(src, dst, jobs=1)
    assert report.copied_derived == 3 and [k.split()[0] for k, _ in report.corrupt] == [dp[PRESSED]]
    with KVStore(dst, readonly=True) as d:
        assert sorted(d.derived_keys(a[-1].key)) == sorted(da.values()) and not d.derived_keys("7" * 64)
        assert not d.verify().corrupt
    with KVStore(src, readonly=True) as s:
        from kvstore.store.transfer import plan_sync

        plan = plan_sync(s.backend, None)
    phases = [k[:2] for k in plan.missing]
    assert phases.index(b"x/") > max(i for i, p in enumerate(phases) if p != b"x/")  # derived entries last


def test_export_writes_each_derived_entry(tmp_path):
    from safetensors.torch import load_file

    url = str(tmp_path / "store")
    a, *_, da, dp = populated(url)
    with KVStore(url, readonly=True) as s:
        report = export_store(s, tmp_path / "out")
    assert report.written == 3 and report.derived == 4 and not report.derived_bad
    pressed = load_file(str(tmp_path / "out" / f"{a[-1].key}.{PRESSED}.{da[PRESSED]}.safetensors"))
    assert pressed["layers.1.heads.0.keys"].shape == (7, 4) and pressed["layers.0.heads.1.positions"].tolist() == list(
        range(0, 13, 2)
    )
    scores = load_file(str(tmp_path / "out" / f"{a[-1].key}.{SCORES}.{da[SCORES]}.safetensors"))
    assert scores["layers.0.scores"].shape == (2, 13)
    with KVStore(url, readonly=True) as s:
        assert export_store(s, tmp_path / "out").skipped == 7  # resumes


def test_an_old_store_opens_unchanged(tmp_path):
    """A store as earlier releases wrote it (golden entries and records, no x/ keys) lists,
    verifies, plans nothing and loads as before."""
    from kvstore.store.entry import decode_entry
    from kvstore.store.scan import ContextRecord

    url, keys = str(tmp_path / "old"), set()
    with KVStore(url) as s:
        for path in sorted(GOLDEN.glob("entry_v[23]_context_*.kvs")):
            blob = path.read_bytes()
            h = decode_entry(blob).header
            keys.add(h.key)
            s.backend.put(entry_key(h.key), blob)
            s.backend.put(record_key(h.key), ContextRecord(h.key, (h.key,), h.n_tokens, h.created).to_bytes())
        assert not list(s.backend.keys(b"x/"))
    with KVStore(url, readonly=True) as s:
        info = s.verify()
        assert info.n_entries == len(keys) == len(info.contexts) > 1 and not info.corrupt and not info.derived
        assert not plan_gc(info, GcOptions(orphans=True), now=time.time() + 10**9).n
        for c in info.contexts:
            with s.open_chain(c.chunks) as views:
                assert len(views) == 1  # a hit


def test_a_scan_keeps_little_python_memory_per_entry(tmp_path):
    """Not a timing: the scan's Python memory per chunk stays far below what keeping every parsed
    header cost (~4.7 KB), with a generous bound (the benchmark measures the figure)."""
    url = str(tmp_path / "store")
    with KVStore(url) as s:
        for i in range(60):
            chain = make_chain([i, i + 1, i + 2, *range(100 + 50 * i, 140 + 50 * i)], chunk=4)
            store_chain(s, chain)
            if i % 10 == 0:
                put_derived(s, chain[-1].key, len(chain) * 4 - 1)
    with KVStore(url, readonly=True) as s:
        s.scan()
        tracemalloc.start()
        info = s.scan()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    n = info.n_entries + len(info.derived)
    assert n > 600 and peak / n < 2000, peak / n


def test_a_bad_tier_copy_of_a_derived_entry_is_named_and_only_dropped(tmp_path):
    remote, tier = str(tmp_path / "remote"), str(tmp_path / "tier")
    a, *_, da, _ = populated(remote)
    name = derived_entry_key(a[-1].key, da[PRESSED])
    with KVStore(remote, cache_dir=tier) as s:
        with s.open_derived(a[-1].key, da[PRESSED]) as view:  # read through: the tier holds a copy
            assert view is not None
        with s.backend.local_copy(name) as copy:
            bad = bytearray(copy)
        bad[-30] ^= 0xFF
        s.backend.tier.put(b"v/" + name, bytes(bad))
        info = s.verify()
        assert not info.corrupt and [(c.context, c.key) for c in info.local_corrupt] == [(a[-1].key, da[PRESSED])]
        plan = plan_gc(info, GcOptions(corrupt=True))
        assert not plan.derived and [k for _, k, _, _ in plan.derived_local] == [da[PRESSED]]
        assert execute_plan(s, plan).dropped_local == 1
        with s.backend.local_copy(name) as copy:
            assert copy is None  # dropped from the tier; the remote's copy stays
        assert s.has_derived(a[-1].key, da[PRESSED]) and not s.verify().local_corrupt
