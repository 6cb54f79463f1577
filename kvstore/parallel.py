"""A small shared thread pool for work that releases the GIL (zstd decompression, torch copies).

:func:`run_all` runs callables on up to ``threads`` threads and returns each one's exception (or
None) instead of raising, so that a caller can tell which piece of a load failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore.process import POOL

GROUPS_PER_THREAD = 4


def _executor(threads: int) -> ThreadPoolExecutor:
    """The process's shared pool (:data:`kvstore.process.POOL`), grown to ``threads`` workers."""
    pool = POOL
    with pool.lock:
        if pool.executor is None or pool.size < threads:
            if pool.executor is not None:
                pool.executor.shutdown(wait=False)
            pool.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstore-load")
            pool.size = threads
        return pool.executor


def _guarded(fn: Callable[[], object]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed back to the caller
        return exc
    return None


def run_all(fns: Sequence[Callable[[], object]], threads: int) -> list[BaseException | None]:
    """Run every callable of ``fns`` (on ``threads`` threads when more than one), returning per
    callable the exception it raised, or None. Workers run in the caller's torch inference and
    grad modes (both are per thread)."""
    if threads <= 1 or len(fns) <= 1:
        return [_guarded(fn) for fn in fns]
    import torch

    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    # a few tasks per thread, each running a run of the callables: hundreds of small copies (a
    # chain of chunks x layers) cost more to hand over one by one than to run
    size = -(-len(fns) // (threads * GROUPS_PER_THREAD))
    groups = [fns[i : i + size] for i in range(0, len(fns), size)]

    def in_mode(group: Sequence[Callable[[], object]]) -> list[BaseException | None]:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return [_guarded(fn) for fn in group]

    return [err for errs in _executor(threads).map(in_mode, groups) for err in errs]


__all__ = ["run_all"]
