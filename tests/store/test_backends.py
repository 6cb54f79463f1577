"""The storage protocol: one contract suite run over every backend (LMDB, memory, S3 against a
local SeaweedFS server, and an LMDB tier in front of S3), then LMDB's own promises (the map grows
by itself, data survives a reopen, clear errors for bad paths, a second process reads what the
first committed). The S3 backend's own promises are in test_s3.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest

from kvstore.errors import ReadOnlyStoreError, StoreError, StoreNotFoundError
from kvstore.store.backends import Backend, open_backend
from kvstore.store.backends.lmdb import LMDBBackend

BACKENDS = ["lmdb", "memory", "s3", "tiered"]


@pytest.fixture(params=BACKENDS)
def opener(request, tmp_path):
    """``open(readonly=False)`` for a fresh, empty store of each backend kind (the tiered one:
    an LMDB cache in front of S3, small enough that the contract's values get evicted)."""
    if request.param == "lmdb":
        url, options = f"lmdb://{tmp_path / 'store'}", {}
    elif request.param == "memory":
        url, options = f"memory://test-{uuid.uuid4().hex}", {}
    elif request.param == "s3":
        url, options = request.getfixturevalue("s3_url"), {"part_size": 1 << 20, "page_size": 2}
    else:
        url = request.getfixturevalue("s3_url")
        options = {"cache_dir": str(tmp_path / "tier"), "cache_size": 4 << 20, "part_size": 1 << 20}
    return lambda readonly=False: open_backend(url, readonly=readonly, **options)


@pytest.fixture
def backend(opener):
    b = opener()
    yield b
    b.close()


# -- the contract -------------------------------------------------------------------------------
def test_implements_the_protocol(backend):
    assert isinstance(backend, Backend)
    assert backend.readonly is False


def test_get_put_overwrite(backend):
    assert backend.get(b"k") is None
    backend.put(b"k", b"v1")
    assert bytes(backend.get(b"k")) == b"v1"
    backend.put(b"k", memoryview(b"v2 longer"))  # memoryviews are accepted as values
    assert bytes(backend.get(b"k")) == b"v2 longer"


def test_binary_and_large_values(backend):
    blob = os.urandom(3 << 20)
    backend.put(b"big", blob)
    backend.put(b"\x00\xff", b"\x00" * 7)
    assert bytes(backend.get(b"big")) == blob
    assert bytes(backend.get(b"\x00\xff")) == b"\x00" * 7


def test_delete_and_contains(backend):
    backend.put(b"k", b"v")
    assert backend.contains(b"k")
    assert backend.delete(b"k") is True
    assert not backend.contains(b"k")
    assert backend.get(b"k") is None
    assert backend.delete(b"k") is False


def test_keys_prefix_sorted(backend):
    for k in [b"e/b", b"e/a", b"a/x", b"e0", b"meta", b"e/c"]:
        backend.put(k, b"1")
    assert list(backend.keys(b"e/")) == [b"e/a", b"e/b", b"e/c"]
    assert list(backend.keys(b"a/")) == [b"a/x"]
    assert list(backend.keys(b"zz")) == []
    assert list(backend.keys()) == sorted([b"e/b", b"e/a", b"a/x", b"e0", b"meta", b"e/c"])


def test_keys_is_a_snapshot(backend):
    # callers delete while iterating (gc): the iterator must not see or trip over that
    for i in range(5):
        backend.put(b"e/%d" % i, b"1")
    for k in backend.keys(b"e/"):
        backend.delete(k)
    assert list(backend.keys(b"e/")) == []


def test_view(backend):
    backend.put(b"k", b"hello")
    with backend.view(b"k") as buf:
        assert isinstance(buf, memoryview)
        assert bytes(buf) == b"hello"
    with backend.view(b"missing") as buf:
        assert buf is None


def test_batched(backend):
    backend.put_many([(b"a", b"1"), (b"b", b"2"), (b"c", b"3")])
    assert [None if v is None else bytes(v) for v in backend.get_many([b"a", b"x", b"c"])] == [b"1", None, b"3"]
    assert backend.delete_many([b"a", b"c", b"x"]) == 2
    assert list(backend.keys()) == [b"b"]
    assert backend.delete_many([]) == 0
    backend.put_many([])


def test_put_if_absent(backend):
    assert backend.put_if_absent(b"e/00aa", b"first") is True
    assert backend.put_if_absent(b"e/00aa", b"second") is False
    assert bytes(backend.get(b"e/00aa")) == b"first"
    backend.delete(b"e/00aa")
    assert backend.put_if_absent(b"e/00aa", memoryview(b"third")) is True
    assert bytes(backend.get(b"e/00aa")) == b"third"


def test_put_many_if_absent(backend):
    backend.put(b"e/00bb", b"there")
    got = backend.put_many_if_absent([(b"e/00aa", b"a"), (b"e/00bb", b"b"), (b"e/00cc", memoryview(b"c"))])
    assert got == [True, False, True]
    assert [bytes(v) for v in backend.get_many([b"e/00aa", b"e/00bb", b"e/00cc"])] == [b"a", b"there", b"c"]
    assert backend.put_many_if_absent([]) == []


def test_peek(backend):
    blob = os.urandom((2 << 20) + 3)
    backend.put(b"big", blob)
    backend.put(b"small", b"abc")
    backend.put(b"empty", b"")
    assert backend.peek(b"big", 100) == (blob[:100], len(blob))
    assert backend.peek(b"small", 100) == (b"abc", 3)
    assert backend.peek(b"empty", 10) == (b"", 0)
    assert backend.peek(b"missing", 10) is None


def test_empty_value(backend):
    backend.put(b"e/0000", b"")
    assert backend.contains(b"e/0000")
    assert bytes(backend.get(b"e/0000")) == b""
    with backend.view(b"e/0000") as buf:
        assert buf is not None and len(buf) == 0


def test_readonly_refuses_writes_but_reads(opener):
    w = opener()
    w.put(b"k", b"v")
    w.close()
    r = opener(readonly=True)
    try:
        assert r.readonly is True
        assert bytes(r.get(b"k")) == b"v"
        for write in (
            lambda: r.put(b"k", b"x"),
            lambda: r.delete(b"k"),
            lambda: r.put_many([(b"a", b"b")]),
            lambda: r.delete_many([b"k"]),
        ):
            with pytest.raises(ReadOnlyStoreError):
                write()
        assert bytes(r.get(b"k")) == b"v"
    finally:
        r.close()


def test_close_is_idempotent_and_reopen_keeps_data(opener):
    b = opener()
    b.put_many([(b"e/1", b"one"), (b"e/2", b"two")])
    b.delete(b"e/2")
    b.close()
    b.close()
    b = opener()
    try:
        assert bytes(b.get(b"e/1")) == b"one"
        assert b.get(b"e/2") is None
    finally:
        b.close()


# -- LMDB ---------------------------------------------------------------------------------------
def test_lmdb_map_grows_when_full(tmp_path):
    b = LMDBBackend(tmp_path / "s", map_size=1 << 16)
    try:
        values = {b"v%d" % i: os.urandom(700_000) for i in range(8)}  # ~5.6 MB into a 64 KiB map
        for k, v in values.items():
            b.put(k, v)
        b.put_many([(b"batch%d" % i, os.urandom(300_000)) for i in range(4)])
        assert b.env.info()["map_size"] > 5_000_000
        assert all(bytes(b.get(k)) == v for k, v in values.items())
    finally:
        b.close()
    b = LMDBBackend(tmp_path / "s", map_size=1 << 16)  # a reopen adopts the grown file's size
    try:
        assert all(bytes(b.get(k)) == v for k, v in values.items())
        assert len(list(b.keys(b"batch"))) == 4
    finally:
        b.close()


def test_lmdb_plain_path_and_url_are_the_same_store(tmp_path):
    a = open_backend(str(tmp_path / "s"))
    a.put(b"k", b"v")
    a.close()
    b = open_backend(f"lmdb://{tmp_path / 's'}", readonly=True)
    try:
        assert bytes(b.get(b"k")) == b"v"
        assert b.disk_bytes() > 0
    finally:
        b.close()


def test_lmdb_readonly_missing_store(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no store"):
        LMDBBackend(tmp_path / "nope", readonly=True)
    assert not (tmp_path / "nope").exists()  # a read never creates anything
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreNotFoundError):
        LMDBBackend(tmp_path / "empty", readonly=True)
    with pytest.raises(StoreNotFoundError):
        LMDBBackend(tmp_path / "nope", create=False)


def test_lmdb_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"not a store")
    for readonly in (False, True):
        with pytest.raises(StoreError, match="is a file"):
            LMDBBackend(f, readonly=readonly)
    assert f.read_bytes() == b"not a store"


def test_lmdb_garbage_data_file(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "data.mdb").write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(StoreError):
        LMDBBackend(tmp_path / "s", readonly=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores file permissions")
def test_lmdb_unwritable_directory(tmp_path):
    d = tmp_path / "ro"
    b = LMDBBackend(d)
    b.put(b"k", b"v")
    b.close()
    d.chmod(0o555)
    try:
        with pytest.raises(ReadOnlyStoreError):
            LMDBBackend(d)
        r = LMDBBackend(d, readonly=True)  # reading still works
        try:
            assert bytes(r.get(b"k")) == b"v"
        finally:
            r.close()
        with pytest.raises(ReadOnlyStoreError):
            LMDBBackend(d / "sub")  # cannot create a store inside it
    finally:
        d.chmod(0o755)


def _reader(path: str, ready, go, results) -> None:
    try:
        r = LMDBBackend(path, readonly=True)
        results.put(("before", None if r.get(b"k0") is None else bytes(r.get(b"k0"))))
        ready.set()
        go.wait(30)
        v = r.get(b"k1")
        results.put(("after", None if v is None else len(v), None if v is None else bytes(v[:16])))
        r.close()
    except BaseException as exc:  # report instead of hanging the parent
        results.put(("error", repr(exc)))
        ready.set()


def test_lmdb_reader_process_sees_committed_data(tmp_path):
    path = str(tmp_path / "s")
    w = LMDBBackend(path, map_size=1 << 16)
    w.put(b"k0", b"first")
    ctx = mp.get_context("spawn")  # a fresh interpreter: no LMDB handle crosses a fork
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_reader, args=(path, ready, go, results))
    p.start()
    try:
        assert ready.wait(60)
        assert results.get(timeout=10) == ("before", b"first")
        big = os.urandom(2 << 20)  # grows the writer's map while the reader has the store open
        w.put(b"k1", big)
        go.set()
        assert results.get(timeout=30) == ("after", len(big), big[:16])
    finally:
        go.set()
        p.join(30)
        w.close()
    assert p.exitcode == 0
