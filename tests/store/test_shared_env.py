"""One process may open one LMDB store any number of times: handles on one directory share its
environment (reference-counted, closed with the last handle), and a forked child opens its own
without disturbing the parent's reader slots (issue 31, item 5)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.entries import make_entry, put_contexts
from kvstore.errors import StoreError
from kvstore.store.backends import lmdb_env
from kvstore.store.backends.lmdb import LMDBBackend
from kvstore.store.kvstore import KVStore


def test_one_store_opened_many_times_in_one_process(tmp_path):
    path = str(tmp_path / "store")
    before = lmdb_env.open_count()
    entries = [make_entry(i) for i in range(3)]
    a = KVStore(path)
    b = KVStore(path)  # failed before: "The environment ... is already open in this process"
    r = KVStore(str(tmp_path / "store" / ".." / "store"), readonly=True)  # another spelling of the same path
    try:
        assert a.backend.env is b.backend.env is r.backend.env
        assert lmdb_env.open_count() == before + 1
        a.put(entries[0])
        b.put(entries[1])
        assert set(r.keys()) == {entries[0].key, entries[1].key}
        a.close()  # the others keep working
        b.put(entries[2])
        assert len(r) == 3 and r.get(entries[2].key) is not None
    finally:
        for s in (a, b, r):
            s.close()
    assert lmdb_env.open_count() == before  # the last handle closed the environment
    with KVStore(path, readonly=True) as again:
        assert len(again) == 3


def _child(path: str, result: Path) -> None:
    """In a forked child: open the store the parent holds, write, read; report; never return."""
    code = 0
    try:
        with LMDBBackend(path) as b:
            b.put(b"from-child", b"1")
            result.write_text(bytes(b.get(b"from-parent") or b"").decode())
    except StoreError as exc:
        result.write_text(f"StoreError: {exc}")
        code = 3
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.write_text(f"{type(exc).__name__}: {exc}")
        code = 4
    os._exit(code)


def _fork(path: str, result: Path) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _child(path, result)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_opens_its_own_environment(tmp_path):
    path = str(tmp_path / "store")
    parent = LMDBBackend(path)
    try:
        parent.put(b"from-parent", b"hello")
        # no transaction in progress at the fork: the child closes its inherited copy, opens its own
        assert _fork(path, tmp_path / "r1") == 0 and (tmp_path / "r1").read_text() == "hello"
        assert bytes(parent.get(b"from-child")) == b"1"
        with parent.view(b"from-parent") as held:  # a read in progress at the fork
            readers = parent.env.readers()
            assert _fork(path, tmp_path / "r2") == 3
            assert "inside a transaction in the parent process" in (tmp_path / "r2").read_text()
            assert parent.env.readers() == readers  # the parent's reader slot is untouched
            assert bytes(held) == b"hello"
        parent.put(b"after", b"2")
        assert bytes(parent.get(b"after")) == b"2"
    finally:
        parent.close()


def test_readonly_directory_shares_a_read_only_environment(tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    path = tmp_path / "ro"
    put_contexts(str(path), [make_entry(1)])
    path.chmod(0o555)
    try:
        with KVStore(str(path), readonly=True) as a, KVStore(str(path), readonly=True) as b:
            assert a.backend.env is b.backend.env and len(a) == len(b) == 1
    finally:
        path.chmod(0o755)


def _use_inherited(store: KVStore, result: Path) -> None:
    """In a forked child: use the parent's handle; report what it raised; never return."""
    try:
        store.keys()
        result.write_text("no error")
    except StoreError as exc:
        result.write_text(f"StoreError: {exc}")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.write_text(f"{type(exc).__name__}: {exc}")
    store.close()  # lets go without touching the parent's environment
    os._exit(0)


def test_a_forked_child_using_its_parents_store_gets_one_line_naming_the_rule(tmp_path):
    path = str(tmp_path / "store")
    put_contexts(path, [make_entry(1)])
    parent = KVStore(path)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            _use_inherited(parent, tmp_path / "r")
        os.waitpid(pid, 0)
        message = (tmp_path / "r").read_text()
        assert message.startswith("StoreError: ") and "\n" not in message, message
        assert "forked child" in message and "open your own store in each process" in message
        assert len(parent) == 1  # the parent's handle keeps working
    finally:
        parent.close()
