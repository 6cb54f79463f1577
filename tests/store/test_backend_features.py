"""The backend protocol's optional features (``local``, ``prefetch``, ``disk_bytes``) are declared
with defaults, so callers use them without probing: every backend answers them, with the value
that backend's nature gives. The S3 backend's prefetch is tested in test_s3.py."""

from __future__ import annotations

import uuid

import pytest

from kvstore.store.backends import Backend, open_backend


@pytest.fixture(params=["lmdb", "memory", "tiered"])
def backend(request, tmp_path):
    if request.param == "lmdb":
        b = open_backend(str(tmp_path / "store"))
    elif request.param == "memory":
        b = open_backend(f"memory://features-{uuid.uuid4().hex}")
    else:  # a tier in front of a shared LMDB path: any URL can be the remote
        b = open_backend(str(tmp_path / "remote"), cache_dir=str(tmp_path / "tier"), cache_size=1 << 20)
    b.kind = request.param
    yield b
    b.close()


def test_every_backend_declares_the_optional_features(backend):
    assert isinstance(backend, Backend)
    assert backend.local is (backend.kind in ("lmdb", "memory"))  # a tier's misses go to its remote
    backend.put(b"e/x", b"value")
    assert backend.prefetch([b"e/x", b"e/missing"]) is None  # accepted everywhere; loads stay right
    assert bytes(backend.get(b"e/x")) == b"value"
    disk = backend.disk_bytes()
    if backend.kind == "lmdb":
        assert isinstance(disk, int) and disk > 0
    else:
        assert disk is None  # memory holds nothing on disk; a tier's remote is not its own file


def test_store_info_reads_disk_bytes_from_the_protocol(tmp_path):
    from kvstore.store.kvstore import KVStore

    with KVStore(str(tmp_path / "s")) as store:
        assert store.scan().disk_bytes == store.backend.disk_bytes() > 0
    with KVStore(f"memory://info-{uuid.uuid4().hex}") as store:
        assert store.scan().disk_bytes is None


def test_no_caller_probes_a_backend_with_getattr():
    import ast

    from helpers.paths import REPO

    repo = REPO
    found = []
    for path in sorted((repo / "kvstore").rglob("*.py")) + sorted((repo / "cli").rglob("*.py")):
        rel = str(path.relative_to(repo))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0])
                if "backend" in target or "remote" in target:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "declare the feature on the Backend protocol instead:\n" + "\n".join(found)


def test_every_backend_declares_its_copies(backend):
    """origin / local_copy / drop_local: a tier's copies are its own; every other backend has one."""
    backend.put(b"e/x", b"value")
    with backend.local_copy(b"e/x") as copy:
        held = None if copy is None else bytes(copy)
    if backend.kind == "tiered":
        assert backend.origin() is backend.remote and held == b"value"
        assert backend.drop_local([b"e/x", b"e/missing"]) == 1  # the tier's copy went...
        with backend.local_copy(b"e/x") as copy:
            assert copy is None
        assert backend.contains(b"e/x") and bytes(backend.get(b"e/x")) == b"value"  # ...the remote's stayed
        backend.remote.delete(b"e/x")  # gone from the remote while the tier still holds a copy
        assert not backend.contains(b"e/x")  # contains asks the remote
    else:
        assert backend.origin() is backend and held is None and backend.drop_local([b"e/x"]) == 0
