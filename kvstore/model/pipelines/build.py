"""Building caches: compute each distinct context's missing chunks once and store them.

A context whose chain is stored whole and intact is skipped (its record written if it lacks one);
a context stored as a format-1 entry is rewritten as a chain (nothing recomputed); any other is
computed from its longest stored prefix on by the model's cache path
(:meth:`kvstore.model.paths.base.CachePath.compute`). Chunks that several pending contexts share
(a few-shot block, a document and its extension) are computed first, once, and then extended.
Encoding and writing run on a background thread (:class:`~kvstore.model.compute.writer.Writer`):
each context's chunks first, then its record, so a reader or a concurrent gc never sees a record
whose chunks were not written yet. The counts come back as values and make the
:class:`BuildReport`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import ContextTooLongError
from kvstore.model.compute.attention import uses_grouped_kv
from kvstore.model.compute.cache import LayerKV
from kvstore.model.compute.writer import Writer
from kvstore.model.handle import row_label
from kvstore.model.options import BuildOptions
from kvstore.model.paths.base import BuildCounts
from kvstore.model.paths.choice import check_supported
from kvstore.model.plan import chains
from kvstore.model.plan.chains import DEFAULT_KEYING, Chain, Keying
from kvstore.model.stages.load import load_v1, verified_depth
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle, TextOrIds


@dataclass(frozen=True)
class BuildReport:
    """What :meth:`Adapter.build` did. Sizes are bytes; times are seconds."""

    contexts: int = 0  # contexts given (with duplicates)
    distinct: int = 0  # in this shard
    other_shards: int = 0  # distinct contexts left to the other shards
    built: int = 0  # contexts computed (whole or from a stored prefix)
    skipped: int = 0  # already stored whole and intact
    failed: int = 0
    tokens: int = 0  # context tokens run through the model
    tokens_reused: int = 0  # context tokens found stored (skipped contexts and stored prefixes)
    migrated: int = 0  # contexts found as format-1 entries and rewritten as chains (nothing recomputed)
    chunks_written: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    store_seconds: float = 0.0  # encode + write, on the writer thread (overlaps compute)
    store_wait_seconds: float = 0.0  # time the compute thread waited for the writer
    errors: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # key of each given context, in input order

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "keys"}
        return d | {"ratio": round(self.ratio, 4), "tokens_per_second": round(self.tokens_per_second, 1)}


def default_build_batch(handle: ModelHandle) -> int:
    """Rows per build forward when none is asked for: 1 on CPU (contexts one at a time prefilled
    faster than in padded batches of 8 on the 2-core VM: 42.7 vs 62.2 s for the same 16 contexts,
    experiments/results/e2e_overhead.json), 8 on accelerators."""
    return 1 if handle.device.type == "cpu" else 8


def in_shard(key: str, i: int, n: int) -> bool:
    """Whether shard ``i`` of ``n`` builds ``key``: its first 16 hex digits, read as a number,
    are ``i`` modulo ``n`` (keys are sha256 hex, so shards get near-equal shares)."""
    return int(key[:16], 16) % n == i


@dataclass(frozen=True)
class _Planned:
    """The contexts of a build, planned: per given context its plan (None: refused, its message in
    ``errors``), and the distinct ones of this shard."""

    plans: list[Chain | None]
    errors: list[str]
    distinct: list[Chain]
    other_shards: int


def _plan_contexts(
    handle: ModelHandle, contexts: Sequence[TextOrIds], store: KVStore, options: BuildOptions, keying: Keying,
    labels: Sequence[str] | None,
) -> _Planned:  # fmt: skip
    plans: list[Chain | None] = []
    errors: list[str] = []
    for i, c in enumerate(contexts):
        try:
            ids = handle.context_ids(
                c, special_tokens=keying.special_tokens, truncate=options.truncate,
                max_context_tokens=options.max_context_tokens, label=row_label(labels, i),
            )  # fmt: skip
            plans.append(
                chains.chain_of(handle, ids, store, prefix=keying.prefix, special_tokens=keying.special_tokens)
            )
        except ContextTooLongError as exc:
            if not options.skip_errors:
                raise
            errors.append(str(exc))
            plans.append(None)
    distinct = list({p.key: p for p in plans if p is not None}.values())
    other = 0
    if options.shard is not None:
        mine = [p for p in distinct if in_shard(p.key, *options.shard)]
        other, distinct = len(distinct) - len(mine), mine
    return _Planned(plans, errors, distinct, other)


@uses_grouped_kv
def build_caches(
    handle: ModelHandle, contexts: Sequence[TextOrIds], store: KVStore, options: BuildOptions,
    keying: Keying = DEFAULT_KEYING, labels: Sequence[str] | None = None, progress: Progress | None = None,
) -> BuildReport:  # fmt: skip
    """Store the cache of every distinct context of ``contexts`` that is not stored whole and
    intact (with ``options.shard`` = ``(i, n)``: those whose key :func:`in_shard` gives to ``i``).
    See :meth:`kvstore.model.adapter.Adapter.build`."""
    shard = options.shard
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard {shard[0]}/{shard[1]}: need 0 <= I < N")
    if options.batch_size is None:
        options = BuildOptions.of(options, batch_size=default_build_batch(handle))
    assert options.batch_size is not None
    if options.batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    path = check_supported(handle, store)
    t_start = time.perf_counter()
    planned = _plan_contexts(handle, contexts, store, options, keying, labels)
    skipped = reused = 0
    pending: list[tuple[Chain, int]] = []
    legacy: list[tuple[Chain, LayerKV]] = []
    unrecorded: list[Chain] = []
    for chain in planned.distinct:
        depth = verified_depth(handle, store, chain)  # verified: corrupt chunks are rebuilt
        if depth == len(chain.keys):
            skipped += 1
            reused += chain.n_tokens
            if store.context(chain.key) is None and not store.readonly:
                unrecorded.append(chain)  # recorded through the writer, which checks its chunks are still there
        elif depth == 0 and (old := load_v1(handle, store, chain)) is not None:
            legacy.append((chain, old))
        else:
            pending.append((chain, depth))
    if progress and skipped + planned.other_shards:
        progress(skipped + planned.other_shards, 0)  # nothing to do for these here
    writer = Writer(store)
    counts = BuildCounts()
    try:
        for chain in unrecorded:
            writer.put_context(chain)
        for chain, layers in legacy:  # a format-1 entry of exactly this context: rewritten as a chain
            writer.put_chunks(handle, chain, layers)
            reused += chain.n_tokens
            if progress:
                progress(1, 0)
        store.touch(k for chain, depth in pending for k in chain.keys[:depth])  # a concurrent gc spares them
        shared = _shared_prefixes(pending)
        if shared:  # chunks several pending contexts start with: computed once, first
            counts += path.compute(handle, store, shared, writer, options, None, False)
            writer.flush()
            pending = [(chain, max(depth, _depth_in(chain, shared))) for chain, depth in pending]
        counts += path.compute(handle, store, pending, writer, options, progress, True)
        for _ in range(3):  # a concurrent gc removed chunks of contexts just recorded: compute them again
            writer.flush()
            lost, writer.lost = set(writer.lost), []
            redo = [
                (p, d)
                for p in planned.distinct
                if p.key in lost and (d := verified_depth(handle, store, p)) < len(p.keys)
            ]
            counts += path.compute(handle, store, redo, writer, options, None, True)
    finally:
        writer.close()
    s = writer.stats
    return BuildReport(
        contexts=len(contexts), distinct=len(planned.distinct), other_shards=planned.other_shards,
        built=counts.built, skipped=skipped, failed=sum(1 for p in planned.plans if p is None), tokens=counts.tokens,
        tokens_reused=reused + counts.tokens_reused, migrated=len(legacy), chunks_written=s.chunks_written,
        raw_bytes=s.raw_bytes, stored_bytes=s.stored_bytes, seconds=time.perf_counter() - t_start,
        store_seconds=s.store_seconds, store_wait_seconds=s.wait_seconds, errors=planned.errors,
        keys=[p.key if p else "" for p in planned.plans],
    )  # fmt: skip


def _shared_prefixes(pending: Sequence[tuple[Chain, int]]) -> list[tuple[Chain, int]]:
    """The longest not-yet-stored chunk prefixes that at least two pending contexts share, as
    ``(chain of the prefix, stored depth)`` jobs (their chunks only: a prefix is not a context)."""
    uses: dict[str, int] = {}
    for chain, depth in pending:
        for k in chain.keys[depth:]:
            uses[k] = uses.get(k, 0) + 1
    jobs: dict[str, tuple[Chain, int]] = {}
    for chain, depth in pending:
        shared = depth
        while shared < len(chain.keys) and uses[chain.keys[shared]] > 1:
            shared += 1
        if shared > depth and shared < len(chain.keys):
            end = chain.spans[shared - 1][1]
            sub = Chain(chain.ids[:end], chain.spans[:shared], chain.keys[:shared], "", chain.lossy)
            jobs.setdefault(sub.key, (sub, depth))
    return list(jobs.values())


def _depth_in(chain: Chain, shared: Sequence[tuple[Chain, int]]) -> int:
    keys = {sub.key: len(sub.keys) for sub, _ in shared}
    return max((keys[k] for k in chain.keys if k in keys), default=0)


__all__ = ["BuildReport", "build_caches", "default_build_batch", "in_shard"]
