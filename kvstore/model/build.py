"""Building caches: compute each distinct context's missing chunks once and store them.

A context whose chain is stored whole and intact is skipped (its record written if it lacks one);
any other context is computed from its longest stored prefix on:

* no stored prefix: a **prefill** in right-padded batches. Real tokens sit at slots ``0..n-1``
  with positions ``0..n-1``, so causal attention never lets them see a pad and every pad query
  still has real keys to attend to (a fully masked row turns into NaN under eager fp64 attention,
  and ``0 * NaN`` would poison real rows). Each row's KV is sliced back to its real tokens, so a
  stored chunk does not depend on its batch-mates;
* a stored prefix: only the rest is computed on top of it (:func:`kvstore.model.chains.extend`).

Chunks that several pending contexts share (a few-shot block, a document and its extension) are
computed first, once, and then extended. Encoding and writing run on a background thread
(:class:`Writer`): each context's chunks first, then its record, so a reader or a concurrent gc
never sees a record whose chunks were not written yet.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.errors import ContextTooLongError
from kvstore.model import chains
from kvstore.model.attention import uses_grouped_kv
from kvstore.model.cache import LayerKV
from kvstore.model.chains import ContextPlan
from kvstore.model.forward import batches, prefill
from kvstore.model.options import BuildOptions
from kvstore.model.writer import BuildReport, Writer
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle, TextOrIds


def default_build_batch(adapter: ModelHandle) -> int:
    """Rows per build forward when none is asked for: 1 on CPU (contexts one at a time prefilled
    faster than in padded batches of 8 on the 2-core VM: 42.7 vs 62.2 s for the same 16 contexts,
    experiments/results/e2e_overhead.json), 8 on accelerators."""
    return 1 if adapter.device.type == "cpu" else 8


def stored_depth(adapter: ModelHandle, store: KVStore, plan: ContextPlan) -> int:
    """How many leading chunks of ``plan`` are stored, intact and this model's (verified)."""
    with store.open_chain(plan.keys) as views:
        return sum(1 for _ in _fitting(adapter, plan, views))


def _fitting(adapter: ModelHandle, plan: ContextPlan, views):
    for j, view in enumerate(views):
        if not chains.fits(adapter, view, plan, j):
            return
        yield view


def load_prefix_kv(adapter: ModelHandle, store: KVStore, plan: ContextPlan, depth: int) -> LayerKV | None:
    """The keys/values of ``plan``'s first ``depth`` chunks, materialized (None if they are no
    longer all stored intact)."""
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    with store.open_chain(plan.keys[:depth]) as views:
        for view in _fitting(adapter, plan, views):
            pieces.append([(k.materialize(), v.materialize()) for k, v in filter(None, view.layers)])
    if len(pieces) < depth:
        return None
    return tuple(
        (torch.cat([p[i][0] for p in pieces], 1), torch.cat([p[i][1] for p in pieces], 1))
        for i in range(len(pieces[0]))
    )


def load_v1(adapter: ModelHandle, store: KVStore, plan: ContextPlan) -> LayerKV | None:
    """The keys/values of a format-1 entry holding exactly ``plan``'s context, materialized (None
    when there is none, or it is corrupt or another model's)."""
    if not store.contains(plan.v1_key):
        return None
    whole = ContextPlan(plan.ids, ((0, plan.n_tokens),), (plan.v1_key,), plan.v1_key)
    with store.open_entry(plan.v1_key) as view:
        if view is None or view.header.format != 1 or not chains.fits(adapter, view, whole, 0):
            return None
        return tuple((k.materialize(), v.materialize()) for k, v in filter(None, view.layers))


def compute(
    adapter: ModelHandle, store: KVStore, jobs: Sequence[tuple[ContextPlan, int]], writer: Writer, report: BuildReport,
    batch_size: int, max_batch_tokens: int | None, progress: Progress | None, count: bool = True,
) -> None:  # fmt: skip
    """Compute and write ``(plan, depth)`` jobs: each plan's chunks from ``depth`` on, then (when
    ``count``: they are contexts, not shared prefixes) its record, the way the model's cache path
    does it (:mod:`kvstore.model.paths`)."""
    adapter.path.compute(adapter, store, jobs, writer, report, batch_size, max_batch_tokens, progress, count)


def compute_dense(
    adapter: ModelHandle, store: KVStore, jobs: Sequence[tuple[ContextPlan, int]], writer: Writer, report: BuildReport,
    batch_size: int, max_batch_tokens: int | None, progress: Progress | None, count: bool = True,
) -> None:  # fmt: skip
    """:func:`compute` for full-attention models: jobs with nothing stored are prefilled in
    batches; the others extend their stored prefix."""
    fresh = [(p, d) for p, d in jobs if d == 0]
    lengths = [p.n_tokens for p, _ in fresh]
    for batch in batches(sorted(range(len(fresh)), key=lambda i: lengths[i]), lengths, batch_size, max_batch_tokens):
        rows = prefill(adapter, [fresh[i][0].ids for i in batch])
        for i, layers in zip(batch, rows):
            writer.put_chunks(adapter, fresh[i][0], layers, record=count)
        account(report, [fresh[i][0].n_tokens for i in batch], count, progress)
    partial = [(p, d) for p, d in jobs if d > 0]
    rest = [p.n_tokens - p.spans[d - 1][1] for p, d in partial]
    sizes = [p.n_tokens for p, _ in partial]
    for batch in batches(sorted(range(len(partial)), key=lambda i: sizes[i]), sizes, batch_size, max_batch_tokens):
        prefixes, todo = [], []
        for i in batch:
            plan, depth = partial[i]
            kv = load_prefix_kv(adapter, store, plan, depth)
            if kv is None:  # the prefix went away meanwhile: compute the whole context
                compute_dense(
                    adapter, store, [(plan, 0)], writer, report, batch_size, max_batch_tokens, progress, count
                )
                continue
            prefixes.append(kv)
            todo.append(i)
        if todo:
            starts = [partial[i][0].spans[partial[i][1] - 1][1] for i in todo]
            rests = chains.extend(adapter, prefixes, [partial[i][0].ids[s:] for i, s in zip(todo, starts)])
            for i, s, layers in zip(todo, starts, rests):
                writer.put_chunks(adapter, partial[i][0], layers, partial[i][1], s, record=count)
            if count:
                report.tokens_reused += sum(starts)
            account(report, [rest[i] for i in todo], count, progress)


def account(report: BuildReport, tokens: Sequence[int], count: bool, progress: Progress | None) -> None:
    report.tokens += sum(tokens)
    if count:
        report.built += len(tokens)
        if progress:
            progress(len(tokens), sum(tokens))


def in_shard(key: str, i: int, n: int) -> bool:
    """Whether shard ``i`` of ``n`` builds ``key``: its first 16 hex digits, read as a number,
    are ``i`` modulo ``n`` (keys are sha256 hex, so shards get near-equal shares)."""
    return int(key[:16], 16) % n == i


@uses_grouped_kv
def build_caches(
    adapter: ModelHandle,
    contexts: Sequence[TextOrIds],
    store: KVStore,
    options: BuildOptions | None = None,
    *,
    special_tokens: bool = True,
    labels: Sequence[str] | None = None,
    progress: Progress | None = None,
    prefix: TextOrIds | None = None,
) -> BuildReport:
    """Store the cache of every distinct context of ``contexts`` that is not stored whole and
    intact (with ``options.shard`` = ``(i, n)``: those whose key :func:`in_shard` gives to ``i``).
    See :meth:`kvstore.model.adapter.Adapter.build`."""
    options = options if options is not None else BuildOptions()
    batch_size, max_batch_tokens, truncate = options.batch_size, options.max_batch_tokens, options.truncate
    max_context_tokens, skip_errors, shard = options.max_context_tokens, options.skip_errors, options.shard
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard {shard[0]}/{shard[1]}: need 0 <= I < N")
    if batch_size is None:
        batch_size = default_build_batch(adapter)
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    adapter.check_supported(store)
    t_start = time.perf_counter()
    report = BuildReport(contexts=len(contexts))
    plans: list[ContextPlan | None] = []
    for i, c in enumerate(contexts):
        try:
            label = adapter.row_label(labels, i)
            ids = adapter.context_ids(
                c, special_tokens=special_tokens, truncate=truncate, max_context_tokens=max_context_tokens, label=label
            )
            plans.append(adapter.plan(ids, store, prefix=prefix, special_tokens=special_tokens))
        except ContextTooLongError as exc:
            if not skip_errors:
                raise
            report.errors.append(str(exc))
            plans.append(None)
    report.keys = [p.key if p else "" for p in plans]
    report.failed = sum(1 for p in plans if p is None)
    distinct = list({p.key: p for p in plans if p is not None}.values())
    if shard is not None:
        mine = [p for p in distinct if in_shard(p.key, *shard)]
        report.other_shards = len(distinct) - len(mine)
        distinct = mine
    report.distinct = len(distinct)
    pending: list[tuple[ContextPlan, int]] = []
    legacy: list[tuple[ContextPlan, LayerKV]] = []
    unrecorded: list[ContextPlan] = []
    for plan in distinct:
        depth = stored_depth(adapter, store, plan)  # verified: corrupt chunks are rebuilt
        if depth == len(plan.keys):
            report.skipped += 1
            report.tokens_reused += plan.n_tokens
            if store.context(plan.key) is None and not store.readonly:
                unrecorded.append(plan)  # recorded through the writer, which checks its chunks are still there
        elif depth == 0 and (old := load_v1(adapter, store, plan)) is not None:
            legacy.append((plan, old))
        else:
            pending.append((plan, depth))
    if progress and report.skipped + report.other_shards:
        progress(report.skipped + report.other_shards, 0)  # nothing to do for these here
    writer = Writer(store, report)
    try:
        for plan in unrecorded:
            writer.put_context(plan)
        for plan, layers in legacy:  # a format-1 entry of exactly this context: rewritten as a chain
            writer.put_chunks(adapter, plan, layers)
            report.migrated += 1
            report.tokens_reused += plan.n_tokens
            if progress:
                progress(1, 0)
        store.touch(k for plan, depth in pending for k in plan.keys[:depth])  # a concurrent gc spares them
        shared = _shared_prefixes(pending)
        if shared:  # chunks several pending contexts start with: computed once, first
            compute(adapter, store, shared, writer, report, batch_size, max_batch_tokens, None, count=False)
            writer.flush()
            pending = [(plan, max(depth, _depth_in(plan, shared))) for plan, depth in pending]
        compute(adapter, store, pending, writer, report, batch_size, max_batch_tokens, progress)
        for _ in range(3):  # a concurrent gc removed chunks of contexts just recorded: compute them again
            writer.flush()
            lost, writer.lost = set(writer.lost), []
            redo = [(p, d) for p in distinct if p.key in lost and (d := stored_depth(adapter, store, p)) < len(p.keys)]
            compute(adapter, store, redo, writer, report, batch_size, max_batch_tokens, None)
    finally:
        try:
            writer.close()
        finally:
            report.seconds = time.perf_counter() - t_start
    return report


def _shared_prefixes(pending: Sequence[tuple[ContextPlan, int]]) -> list[tuple[ContextPlan, int]]:
    """The longest not-yet-stored chunk prefixes that at least two pending contexts share, as
    ``(plan of the prefix, stored depth)`` jobs (their chunks only: a prefix is not a context)."""
    uses: dict[str, int] = {}
    for plan, depth in pending:
        for k in plan.keys[depth:]:
            uses[k] = uses.get(k, 0) + 1
    jobs: dict[str, tuple[ContextPlan, int]] = {}
    for plan, depth in pending:
        shared = depth
        while shared < len(plan.keys) and uses[plan.keys[shared]] > 1:
            shared += 1
        if shared > depth and shared < len(plan.keys):
            end = plan.spans[shared - 1][1]
            sub = ContextPlan(plan.ids[:end], plan.spans[:shared], plan.keys[:shared], "", plan.lossy)
            jobs.setdefault(sub.key, (sub, depth))
    return list(jobs.values())


def _depth_in(plan: ContextPlan, shared: Sequence[tuple[ContextPlan, int]]) -> int:
    keys = {sub.key: len(sub.keys) for sub, _ in shared}
    return max((keys[k] for k in plan.keys if k in keys), default=0)


__all__ = [
    "BuildReport",
    "LayerKV",
    "Writer",
    "batches",
    "build_caches",
    "account",
    "compute",
    "compute_dense",
    "in_shard",
    "load_v1",
    "prefill",
    "stored_depth",
]
