"""A chain's chunks are read with the kernel's read-ahead on (``KVStore.open_chain`` inside
``backend.read_ahead()``): LMDB maps its file with read-ahead off (``MADV_RANDOM``), so that a cold
chunk came in one 4 KiB page at a time. While any load of a process is inside, the map has the
default advice; once the last one is out, LMDB's again; a map that moved (the store grew) is found
again. Linux only: the advice shows in /proc/self/smaps (``rr``: random read)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from helpers.entries import make_chain, store_chain
from kvstore.store.kvstore import KVStore

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")


def _random_read(data: Path) -> list[bool]:
    """Per mapping of ``data`` in this process: whether it is advised random read."""
    out, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=5)
        if len(first) >= 5 and "-" in first[0] and not line.startswith("VmFlags"):
            inside = len(first) == 6 and first[5] == str(data)
        elif inside and line.startswith("VmFlags:"):
            out.append("rr" in line.split()[1:])
    return out


@pytest.fixture
def store(tmp_path):
    s = KVStore(str(tmp_path / "s"), codec="raw")
    yield s
    s.close()


def test_read_ahead_is_on_while_any_load_is_inside(store, tmp_path):
    data = Path(store.backend._shared.key) / "data.mdb"
    assert _random_read(data) == [True]  # as LMDB opens it (readahead=False)
    other = KVStore(str(tmp_path / "s"), codec="raw")  # another handle: the same environment
    try:
        with store.backend.read_ahead():
            assert _random_read(data) == [False]
            with other.backend.read_ahead():
                assert _random_read(data) == [False]
            assert _random_read(data) == [False], "the first load is still inside"
        assert _random_read(data) == [True]
        store.backend.env.set_mapsize(2 * store.backend.env.info()["map_size"])  # the map moves
        with store.backend.read_ahead():
            assert _random_read(data) == [False]
        assert _random_read(data) == [True]
    finally:
        other.close()


def test_a_chain_is_read_inside_read_ahead(store):
    chain = make_chain(list(range(1, 11)))  # 3 chunks of 4, 4 and 2 tokens
    store_chain(store, chain)
    backend, inside, seen = store.backend, [0], []
    real_view, real_ahead = backend.view, backend.read_ahead

    @contextlib.contextmanager
    def read_ahead():
        inside[0] += 1
        try:
            with real_ahead():
                yield
        finally:
            inside[0] -= 1

    def view(key):
        seen.append(inside[0])
        return real_view(key)

    backend.read_ahead, backend.view = read_ahead, view
    keys = [e.key for e in chain]
    with store.open_chain(keys, lazy=True, defer=True) as views:
        assert len(views) == 3 and inside[0] == 0
        got = views[1].layers[0][0].materialize()
    assert seen == [1, 1, 1]
    assert torch.equal(got, chain[1].layers[0][0])
