"""Every crash point of every multi-step mutation (issue 31, item 5), deterministically.

The build's writer, rm, gc, sync and import-llminference (rm, gc, sync and import with derived
entries present: scores and pressed caches of kept and removed contexts, an orphan, a context
stored only as pressed caches) each run in a child process that ends
itself (``os._exit``) just before its N-th mutating backend call, for every N from 1 to the total
(``helpers.crash``): on LMDB, where a call is one transaction; for the build, rm, gc and sync also on
LMDB with every object of a batch a step of its own ("objects": what an object store does,
without its latency); and for the build's writer and gc on S3 itself (a real SeaweedFS on
127.0.0.1), one object at a time, on smaller stores.
After each crash the store holds no problem it did not hold before (every
context record names chunks that are there and intact, no derived entry outlives its context) and no
context or derived entry the operation was not asked to remove is lost; then the next run, the same
command again, finishes the job and leaves exactly what an uninterrupted run leaves (every entry,
derived entry and record; last-use records aside). The list of these points and what each guarantees is in
docs/reliability.md."""

from __future__ import annotations

import struct
import time
import uuid
from pathlib import Path

import pytest
import torch

from helpers import crash
from helpers.cli import context_text
from helpers.entries import make_chain, put_derived, store_chain
from helpers.s3 import BUCKET
from kvstore.errors import StoreNotFoundError
from kvstore.store.kvstore import KVStore
from kvstore.store.scan import chain_problem

DAY = 86400.0


def state(url: str) -> tuple[set[str], set[str]]:
    """(contexts whose chain is whole and intact, and their intact derived entries; problems:
    corrupt entries, broken contexts, malformed records and derived entries whose context is gone)
    of the store at ``url``; a store never created is empty."""
    try:
        with KVStore(url, readonly=True) as s:
            info = s.verify()
    except StoreNotFoundError:
        return set(), set()
    broken = {c.key for c in info.contexts if chain_problem(c.chunks, info.by_key)}
    problems = {f"corrupt {c.key}" for c in info.corrupt} | {f"broken {k}" for k in broken}
    problems |= {f"malformed {c.key}" for c in info.malformed}
    problems |= {f"orphan derived {d.key}" for d in info.orphan_derived}  # none outlives its context
    whole = {c.key for c in info.contexts} - broken
    return whole | {f"derived {d.context}/{d.key}" for d in info.derived if d.context in whole}, problems


def stored(url: str) -> set[bytes]:
    """Every stored value's name but last-use records and the description: what a re-run must
    leave exactly as an uninterrupted run does."""
    return {k for k in crash.snapshot(url) if not k.startswith((b"a/", b"meta"))} if url else set()


def derived_ids(store: KVStore, context: str) -> set[str]:
    return {f"derived {context}/{k}" for k in store.derived_keys(context)}


# -- starting states ------------------------------------------------------------------------------------
def _chains(n: int, base: int, shared_head: bool = True) -> list[list]:
    head = [5, 6, 7, 8] if shared_head else []
    return [make_chain(head + list(range(base + 10 * i, base + 10 * i + 6)), chunk=4) for i in range(n)]


def start_build(tmp_path: Path, tiny_llama_dir: Path) -> tuple[str, dict, set[str]]:
    """Context 0 stored; the build skips it, extends it into context 1 (its chunks reused) and
    computes context 2."""
    first = context_text(0, words=(4, 9))
    contexts = [first, first + " once upon a time there was a small model", context_text(2, words=(4, 9))]
    url = str(tmp_path / "start")
    with KVStore(url, chunk_tokens=8) as s:  # context 0 is stored before the build
        crash.adapter_of(str(tiny_llama_dir)).generate_kv_cache(contexts[:1], s)
    return url, {"model": str(tiny_llama_dir), "contexts": contexts}, state(url)[0]


def start_rm(tmp_path: Path) -> tuple[str, dict, set[str]]:
    """Three contexts, the removed one and a kept one with scores and a pressed cache each."""
    url = str(tmp_path / "start")
    a, b, c = _chains(3, 100)
    with KVStore(url) as s:
        for chain in (a, b, c):
            store_chain(s, chain)
        put_derived(s, a[-1].key, 10)
        put_derived(s, b[-1].key, 10)
        keep = {b[-1].key, c[-1].key} | derived_ids(s, b[-1].key)
    return url, {"keys": [a[-1].key[:16]]}, keep


def start_gc(tmp_path: Path, *, small: bool = False) -> tuple[str, dict, set[str]]:
    """A kept context, an old one, one with a corrupt chunk, one missing a chunk, old orphans and a
    malformed record: every kind of thing gc --corrupt --older-than removes (``small``: the kept
    context, the corrupt one and an orphan, for the slower store)."""
    url = str(tmp_path / "start")
    kept, corrupt, broken = _chains(3, 100)
    old = make_chain([1, 2, 3, 4, 50, 51, 52], chunk=4, created=time.time() - 100 * DAY)
    orphans = make_chain([9, 9, 9, 9] if small else [9, 9, 9, 9, 60, 61], chunk=4)
    with KVStore(url) as s:
        for chain in (kept, corrupt) if small else (kept, old, corrupt, broken):
            store_chain(s, chain)
        store_chain(s, orphans, record=False)
        s.backend.put_many([(b"a/" + e.key.encode(), struct.pack("<d", time.time() - 2 * DAY)) for e in orphans])
        name = b"e/" + corrupt[-1].key.encode()
        raw = bytearray(s.backend.get(name))
        raw[-20] ^= 0xFF
        s.backend.put(name, bytes(raw))
        put_derived(s, kept[-1].key, 10)  # kept with its context
        if not small:
            s.backend.delete(b"e/" + broken[-1].key.encode())
            s.backend.put(b"r/" + b"0" * 64, b"not a record")
            put_derived(s, old[-1].key, 7)  # removed with its old context
            gone = put_derived(s, "6" * 64, 9, kinds=("scores",))  # an orphan: its context is gone
            only = put_derived(s, "5" * 64, 9, kinds=("pressed", "scores"))  # a context stored as pressed caches, old
            past = struct.pack("<d", time.time() - 40 * DAY)
            s.backend.put_many([(b"a/" + k.encode(), past) for k in (*gone.values(), *only.values())])
        keep = {kept[-1].key} | derived_ids(s, kept[-1].key)
    args = {"gc": {"corrupt": True, "older_than": 30 * DAY, "orphans": True}}
    return url, args, keep


def start_sync(tmp_path: Path) -> tuple[str, dict, set[str]]:
    src = str(tmp_path / "src")
    with KVStore(src) as s:
        for chain in _chains(2, 100):
            store_chain(s, chain)
            put_derived(s, chain[-1].key, 10, kinds=("scores",))
        put_derived(s, "5" * 64, 9)  # a context stored as pressed caches (and its scores)
    return "", {"src": src}, set()  # DST starts empty


def start_import(tmp_path: Path, tiny_neox_dir: Path) -> tuple[str, dict, set[str]]:
    from kvstore.model.llminference import cache_name

    adapter = crash.adapter_of(str(tiny_neox_dir))
    contexts = [context_text(i, words=(4, 9)) for i in range(2)]
    config = adapter.model.config.to_json_string(use_diff=False)
    cache = tmp_path / "llminference"
    cache.mkdir()
    for text in contexts:
        layers = adapter.prefill([adapter.encode_context(text)])[0]
        t = torch.stack([torch.stack([k, v]) for k, v in layers]).unsqueeze(2).clone()
        torch.save(t, cache / f"{cache_name(config, text, 256)}.pt")
    url = str(tmp_path / "start")
    with KVStore(url, chunk_tokens=8) as s:  # derived entries already there stay as they are
        put_derived(s, "5" * 64, 9)
        keep = {"5" * 64} | derived_ids(s, "5" * 64)
    return url, {"model": str(tiny_neox_dir), "cache": str(cache), "contexts": contexts, "limit": 256}, keep


# -- the test -------------------------------------------------------------------------------------------
# "objects" where a batch is several steps (the writer's marks and record, rm's and gc's deletes,
# sync's batched copies); import writes through the build's writer
CASES = [("build", "lmdb"), ("build", "objects"), ("build", "s3"), ("build --press", "objects"), ("import", "lmdb"),
         ("sync", "lmdb"),
         ("sync", "objects"), ("rm", "lmdb"), ("rm", "objects"), ("gc", "lmdb"), ("gc", "objects"),
         ("gc", "s3")]  # fmt: skip


@pytest.mark.parametrize("op, where", CASES)
def test_every_crash_point_keeps_the_store_whole(op, where, tmp_path, request):
    env = request.getfixturevalue("s3_env") if where == "s3" else {}

    def fresh() -> str:
        name = uuid.uuid4().hex[:10]
        return f"s3://{BUCKET}/crash-{op}-{name}" if where == "s3" else str(tmp_path / f"store-{name}")

    if op == "build --press":  # the build's new writes: each context's scores and pressed cache
        start, args, keep = start_build(tmp_path, request.getfixturevalue("tiny_llama_dir"))
        op, args = "build", dict(args, presses=["kvzip:0.5"])
    elif op == "build":
        start, args, keep = start_build(tmp_path, request.getfixturevalue("tiny_llama_dir"))
        if where == "s3":  # fewer steps on the slower store: one short new context (the rest: "objects")
            args = dict(args, contexts=["Document 9: the lazy fox."])
    elif op == "gc":
        start, args, keep = start_gc(tmp_path, small=where == "s3")
    elif op == "import":
        start, args, keep = start_import(tmp_path, request.getfixturevalue("tiny_neox_dir"))
    else:
        start, args, keep = {"rm": start_rm, "sync": start_sync}[op](tmp_path)
    values = crash.snapshot(start) if start else {}
    _, problems_before = state(start) if start else (set(), set())

    def copy() -> str:
        url = fresh()
        return crash.restore(url, values) if values else url

    kw = {"per_object": where != "lmdb", "env": env, "workdir": tmp_path}
    whole = copy()
    total = crash.run(op, whole, args, crash_at=0, **kw)
    done, leftover = state(whole)
    assert total and not leftover and keep <= done, (total, leftover)
    left = stored(whole)

    for n in range(1, total + 1):
        url = copy()
        assert crash.run(op, url, args, crash_at=n, **kw) is None
        contexts, problems = state(url)
        assert problems <= problems_before, (n, problems - problems_before)  # nothing broken by the crash
        assert keep <= contexts, (n, keep - contexts)  # nothing recorded lost
        crash.OPS[op](url, args, lambda backend: backend)  # the next run, here, to the end
        assert state(url) == (done, set()), n  # finishes exactly what an uninterrupted run does
        assert stored(url) == left, (n, stored(url) ^ left)  # and leaves nothing else behind


def test_derived_entries_of_a_context_extending_a_stored_one_stay_with_it(tmp_path, tiny_llama_dir):
    """build --press over a context that extends a stored one (its chain cut at the stored one's end):
    its scores and pressed cache are filed under its record, so the store lists one context and rm
    of that context removes them."""
    start, args, _ = start_build(tmp_path, tiny_llama_dir)
    crash.op_build(start, dict(args, presses=["kvzip:0.5"]), lambda backend: backend)
    with KVStore(start, readonly=True) as s:
        info = s.scan()
    recorded = {r.key for r in info.contexts if r.chunks}
    assert {d.context for d in info.derived} <= recorded, "derived entries filed under no record"
