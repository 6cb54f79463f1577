"""Crash points, deterministically: run a store mutation in a child process whose backend ends the
process with ``os._exit`` just before its N-th mutating call (a put, put_if_absent, put_many,
delete or delete_many; with ``per_object``, as on S3, one object of a batch at a time), for every
N from 1 to the total. The child is forked from the zygote (``helpers.cli``): torch and the store
code are already imported, so a crash costs a fork, not an interpreter start.

Each operation is a function ``op(url, args, wrap)`` that opens the store at ``url``, wraps its
backend with ``wrap`` once it is open (the description record is not a step), and runs the
mutation as the library does it (the same calls the CLI makes). The parent copies the store's
starting state into a fresh store for each N (:func:`snapshot`, :func:`restore`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.cli import zygote
from helpers.hooked import Hooked

CRASHED = 77  # the child's exit status when it ended itself at the chosen step


# -- the operations ------------------------------------------------------------------------------------
_ADAPTERS: dict[str, Any] = {}


def adapter_of(model: str):
    """The model, loaded once per process (the parent's repair runs reuse it; a child loads it)."""
    from kvstore.model.adapter import Adapter

    if model not in _ADAPTERS:
        _ADAPTERS[model] = Adapter.from_pretrained(model, dtype="float64")
    return _ADAPTERS[model]


def op_build(url: str, args: dict, wrap: Callable) -> None:
    from kvstore.store.kvstore import KVStore

    adapter = adapter_of(args["model"])
    store = KVStore(url)
    store.backend = wrap(store.backend)
    try:
        # with "presses": each context's pressed caches and their scores too (build --press)
        adapter.generate_kv_cache(args["contexts"], store, presses=args.get("presses", ()))
    finally:
        store.close()  # writes the last-use records: a step of its own


def op_remove(url: str, args: dict, wrap: Callable) -> None:
    """``kvstore rm KEY`` (``args["keys"]``) or ``kvstore gc`` (``args["gc"]``: plan_gc's options)."""
    from kvstore.errors import EntryNotFoundError
    from kvstore.store.gc import GcOptions, plan_gc
    from kvstore.store.kvstore import KVStore
    from kvstore.store.removal import execute_plan

    with KVStore(url) as store:
        gc = args.get("gc")
        info = store.verify() if gc and gc.get("corrupt") else store.scan()
        try:
            plan = plan_gc(info, GcOptions(**gc)) if gc else plan_gc(info, GcOptions(keys=args["keys"]))
        except EntryNotFoundError:  # rm run again after a crash past its deletes: nothing by that key is left
            return
        store.backend = wrap(store.backend)
        execute_plan(store, plan)


def op_sync(url: str, args: dict, wrap: Callable) -> None:
    from kvstore.store.backends import open_backend
    from kvstore.store.transfer import execute_sync, plan_sync

    src, dst = open_backend(args["src"], readonly=True), wrap(open_backend(url))
    try:
        execute_sync(plan_sync(src, dst), src, dst, jobs=1)  # one at a time: the same order every run
    finally:
        dst.close()
        src.close()


def op_import(url: str, args: dict, wrap: Callable) -> None:
    from kvstore.model.llminference import import_caches
    from kvstore.store.kvstore import KVStore

    adapter = adapter_of(args["model"])
    with KVStore(url) as store:
        store.backend = wrap(store.backend)
        import_caches(adapter, args["cache"], args["contexts"], store, max_context_length=args["limit"], check=0)


OPS: dict[str, Callable[[str, dict, Callable], None]] = {
    "build": op_build, "rm": op_remove, "gc": op_remove, "sync": op_sync, "import": op_import,
}  # fmt: skip


# -- running one in a child ----------------------------------------------------------------------------
def _child(op: str, url: str, args: dict, crash_at: int, per_object: bool, env: dict, result: str) -> None:
    import torch

    os.environ.update(env)
    torch.set_num_threads(1)
    calls = [0]

    def hook(name: str, keys, when: str) -> None:
        if when == "before":
            calls[0] += 1
            if calls[0] == crash_at:
                os._exit(CRASHED)  # a crash: no finally, no flush, no close

    OPS[op](url, args, lambda backend: Hooked(backend, hook, per_object=per_object))
    Path(result).write_text(str(calls[0]))
    os._exit(0)


def run(op: str, url: str, args: dict, *, crash_at: int, per_object: bool, env: dict, workdir: Path) -> int | None:
    """Run ``op`` on ``url`` in a child that ends itself before mutating call ``crash_at`` (0:
    never). Returns the number of mutating calls when it ran to the end, None when it crashed as
    asked; raises AssertionError for any other ending."""
    result = workdir / f"calls-{uuid.uuid4().hex}"
    p = zygote().Process(target=_child, args=(op, url, args, crash_at, per_object, env, str(result)))
    p.start()
    p.join(120)
    if p.exitcode is None:
        p.kill()
        raise AssertionError(f"{op} did not finish")
    if p.exitcode == CRASHED and crash_at:
        return None
    assert p.exitcode == 0 and result.exists(), f"{op} (crash at {crash_at}) ended with {p.exitcode}"
    return int(result.read_text())


# -- copies of a store's state -------------------------------------------------------------------------
def snapshot(url: str) -> dict[bytes, bytes]:
    """Every value of the store at ``url`` by backend key."""
    from kvstore.store.backends import open_backend

    backend = open_backend(url, readonly=True)
    try:
        names = list(backend.keys())
        return {k: bytes(v) for k, v in zip(names, backend.get_many(names)) if v is not None}
    finally:
        backend.close()


def restore(url: str, values: dict[bytes, Any]) -> str:
    """Write ``values`` into the (new, empty) store at ``url``; returns ``url``."""
    from kvstore.store.backends import open_backend

    backend = open_backend(url)
    try:
        backend.put_many(list(values.items()))
    finally:
        backend.close()
    return url
