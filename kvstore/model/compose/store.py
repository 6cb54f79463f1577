"""``build`` of passage rows for composition (``Adapter.build(compose=True)``, ``kvstore build --compose``):
each distinct passage stored once as its own chain, and the rows' head, instead of each row's
composed ids as an exact prefix chain.

The plan is an ordinary :class:`~kvstore.model.plan.build.BuildPlan` whose steps are the head's
chain and each distinct passage's (:func:`~kvstore.model.compose.passages.passage_chain`), planned
as any context is (``skip`` when stored whole and intact, ``record`` when only its record is
missing, else ``compute``), so ``--dry-run`` prints it as it prints a build. The build computes each
missing passage alone from position 0 and stores its chunks and its record flagged ``passage``:
exactly what a composed sample stores on a miss, so a composed sample after it computes no passage.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvstore.errors import ComposeError, ReadOnlyStoreError
from kvstore.model.compose.passages import check_composable, passage_chain
from kvstore.model.compose.rows import Composed
from kvstore.model.compute.forward import prefill
from kvstore.model.io.chains import Chain, chain_of, chunk_entries
from kvstore.model.options import BuildOptions
from kvstore.model.pipelines.build import BuildReport
from kvstore.model.plan.build import BuildPlan, _step, in_shard
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def passage_chains(handle: ModelHandle, composed: Composed, store: KVStore) -> tuple[list[Chain], set[str]]:
    """``(every chain the rows compose from: the head's then each passage's, in order of first use;
    the keys of the passages' chains)``."""
    out: dict[str, Chain] = {}
    passages: set[str] = set()
    for row in composed.rows:
        if row.head:
            head = chain_of(handle, row.head, store)
            out.setdefault(head.key, head)
        for ids in row.passages:
            chain = passage_chain(handle, ids, store)
            out.setdefault(chain.key, chain)
            passages.add(chain.key)
    return list(out.values()), passages


def plan_passages(handle: ModelHandle, composed: Composed, store: KVStore, options: BuildOptions) -> BuildPlan:
    """The plan of storing ``composed``'s head and passages (nothing is written). ComposeError (one
    line) for presses, scores or ``dense=False`` (passages are stored dense) or a model whose
    passages cannot be placed."""
    if options.presses or options.scores or not options.dense:
        raise ComposeError("passages are stored dense: build them without presses, scores or dense=False")
    check_composable(handle)
    found, _ = passage_chains(handle, composed, store)
    mine = [c for c in found if options.shard is None or in_shard(c.key, *options.shard)]
    steps = tuple(_step(handle, store, chain, options) for chain in mine)
    return BuildPlan(tuple(found), steps, (), len(found) - len(mine), options)


def build_passages(
    handle: ModelHandle, composed: Composed, store: KVStore, options: BuildOptions,
    progress: Progress | None = None,
) -> BuildReport:  # fmt: skip
    """Store ``composed``'s head chain and each distinct passage once (module docstring): a
    :class:`BuildReport` whose contexts are those chains. ReadOnlyStoreError for a read-only store."""
    t0 = time.perf_counter()
    if store.readonly:
        raise ReadOnlyStoreError(f"store {store.url} was opened read-only: build cannot store passages")
    plan = plan_passages(handle, composed, store, options)
    _, passages = passage_chains(handle, composed, store)
    n = dict.fromkeys(("built", "skipped", "tokens", "tokens_reused", "chunks_written", "raw_bytes", "stored_bytes"), 0)
    store_seconds = 0.0
    for step in plan.steps:
        chain = step.chain
        if step.action == "compute":
            layers = prefill(handle, [chain.ids])[0]  # the whole chain alone from position 0
            n["tokens"] += chain.n_tokens
            t1 = time.perf_counter()
            for entry in chunk_entries(handle, chain, layers, first=step.depth):
                n["stored_bytes"] += store.put(entry)
                n["raw_bytes"] += sum(kv[0].nbytes + kv[1].nbytes for kv in entry.layers if kv is not None)
                n["chunks_written"] += 1
            store_seconds += time.perf_counter() - t1
            n["built"] += 1
        else:
            n["skipped"] += step.action == "skip"
            n["tokens_reused"] += chain.n_tokens
        if step.action in ("compute", "record"):
            store.put_context(chain.key, chain.keys, chain.n_tokens, passage=chain.key in passages)
        if progress:
            progress(1, chain.n_tokens)
    return BuildReport(
        contexts=sum(len(r.passages) + bool(r.head) for r in composed.rows), distinct=len(plan.steps),
        other_shards=plan.other_shards, built=n["built"], skipped=n["skipped"], tokens=n["tokens"],
        tokens_reused=n["tokens_reused"], chunks_written=n["chunks_written"], raw_bytes=n["raw_bytes"],
        stored_bytes=n["stored_bytes"], seconds=time.perf_counter() - t0, store_seconds=store_seconds,
    )  # fmt: skip


def build_of(composed: Composed | None, what: str) -> Composed:
    """``composed``, or ComposeError (one line) when the contexts are not passages."""
    if composed is None:
        raise ComposeError(f"{what} is for contexts given as passages (a list of strings per row)")
    return composed


__all__ = ["build_of", "build_passages", "passage_chains", "plan_passages"]
