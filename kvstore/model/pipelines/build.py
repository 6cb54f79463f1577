"""Building caches: plan what each distinct context needs, then compute its missing chunks once and
store them (and its pressed caches and scores).

:func:`plan_build` makes a frozen :class:`BuildPlan` before any work: per distinct context of this
shard a :class:`ContextStep` saying what is stored of it (its verified chunks) and what the build
does: ``skip`` (stored whole and recorded), ``record`` (stored whole, its record missing),
``migrate`` (a format-1 entry holding exactly it: rewritten as a chain, nothing recomputed) or
``compute`` (its chunks from the stored prefix on), and which pressed caches and scores it lacks
(``presses``/``scores`` options). ``kvstore build --dry-run`` prints it. :func:`run_build`
carries it out: the dense work by the model's cache path
(:meth:`kvstore.model.paths.base.CachePath.compute`; chunks that several contexts to compute share,
such as a few-shot block, computed first, once), then the derived work
(:mod:`kvstore.model.pipelines.derive`). Encoding and writing run on a background thread
(:class:`~kvstore.model.io.writer.Writer`): each context's chunks first, then its record, so a
reader or a concurrent gc never sees a record whose chunks were not written yet. The counts come
back as values and make the :class:`BuildReport`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import ReadOnlyStoreError
from kvstore.model.compute.attention import uses_grouped_kv
from kvstore.model.io.chains import DEFAULT_KEYING, Chain, Keying
from kvstore.model.io.probes import load_v1, verified_depth
from kvstore.model.io.writer import Writer
from kvstore.model.options import BuildOptions
from kvstore.model.paths.base import BuildCounts, CachePath
from kvstore.model.paths.choice import check_supported, check_variants
from kvstore.model.pipelines.derive import derive
from kvstore.model.plan.build import BuildPlan, plan_build
from kvstore.model.variants.variant import make_variant
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
    pressed_written: int = 0  # pressed caches stored (presses x contexts)
    scores_written: int = 0  # scores stored (scorers x contexts)
    derived_bytes: int = 0  # stored bytes of the pressed caches and scores written
    scoring_tokens: int = 0  # context tokens the scorers' forwards ran (windows, re-runs, replays; not prefill)

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


@uses_grouped_kv
def build_caches(
    handle: ModelHandle, contexts: Sequence[TextOrIds], store: KVStore, options: BuildOptions,
    keying: Keying = DEFAULT_KEYING, labels: Sequence[str] | None = None, progress: Progress | None = None,
) -> BuildReport:  # fmt: skip
    """Store the cache of every distinct context of ``contexts`` that is not stored whole and
    intact (with ``options.shard`` = ``(i, n)``: those whose key
    :func:`kvstore.model.plan.build.in_shard` gives to ``i``), and the pressed caches and scores the
    options ask for. See :meth:`kvstore.model.adapter.Adapter.build`."""
    t_start = time.perf_counter()
    options, path = _checked(handle, store, options)
    plan = plan_build(handle, contexts, store, options, keying, labels)
    return run_build(handle, plan, store, path, progress, t_start)


def _checked(handle: ModelHandle, store: KVStore, options: BuildOptions) -> tuple[BuildOptions, CachePath[Any]]:
    """The build's one check: ``options`` with its batch size resolved, and the model's cache path
    for ``store`` (ModelError for a model or codec it cannot serve, or presses on a path without them)."""
    shard = options.shard
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard {shard[0]}/{shard[1]}: need 0 <= I < N")
    if options.batch_size is None:
        options = BuildOptions.of(options, batch_size=default_build_batch(handle))
    assert options.batch_size is not None
    if options.batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    path = check_supported(handle, store)
    if options.presses or options.scores:
        if store.readonly:
            raise ReadOnlyStoreError(f"store {store.url} was opened read-only: build cannot store pressed caches")
        check_variants(handle, [make_variant(press=p) for p in options.presses or options.scores])
    return options, path


@uses_grouped_kv
def run_build(
    handle: ModelHandle, plan: BuildPlan, store: KVStore, path: CachePath[Any], progress: Progress | None = None,
    t_start: float | None = None,
) -> BuildReport:  # fmt: skip
    """Carry out ``plan`` (made by :func:`plan_build` for ``store`` from options checked by
    :func:`build_caches`, which gives the model's cache ``path`` it found): the dense chains, then
    the pressed caches and scores."""
    t_start = time.perf_counter() if t_start is None else t_start
    options = plan.options
    steps = plan.steps
    skipped = sum(1 for st in steps if st.action in ("skip", "record"))
    reused = sum(st.chain.n_tokens for st in steps if st.action in ("skip", "record"))
    to_compute = [(st.chain, st.depth) for st in steps if st.action == "compute"]
    legacy = [st.chain for st in steps if st.action == "migrate"]
    if progress and skipped + plan.other_shards:
        progress(skipped + plan.other_shards, 0)  # nothing to do for these here
    writer = Writer(store)
    counts = BuildCounts()
    try:
        for st in steps:
            if st.action == "record" and not store.readonly:  # a read-only store keeps what it has
                writer.put_context(st.chain)  # recorded through the writer, which checks its chunks are still there
        for chain in legacy:  # a format-1 entry of exactly this context: rewritten as a chain
            layers = load_v1(handle, store, chain)
            if layers is None:  # gone since the plan: computed after all
                to_compute.append((chain, 0))
                continue
            writer.put_chunks(handle, chain, layers)
            reused += chain.n_tokens
            if progress:
                progress(1, 0)
        store.touch(k for chain, depth in to_compute for k in chain.keys[:depth])  # a concurrent gc spares them
        shared = _shared_prefixes(to_compute)
        if shared:  # chunks several to_compute contexts start with: computed once, first
            counts += path.compute(handle, store, shared, writer, options, None, False)
            writer.flush()
            to_compute = [(chain, max(depth, _depth_in(chain, shared))) for chain, depth in to_compute]
        counts += path.compute(handle, store, to_compute, writer, options, progress, True)
        distinct = [st.chain for st in steps]
        for _ in range(3):  # a concurrent gc removed chunks of contexts just recorded: compute them again
            writer.flush()
            lost, writer.lost = set(writer.lost), []
            redo = [(p, d) for p in distinct if p.key in lost and (d := verified_depth(handle, store, p)) < len(p.keys)]
            counts += path.compute(handle, store, redo, writer, options, None, True)
        writer.flush()  # every context's chunks and record written before its derived entries
        pressing = [st for st in steps if st.presses or st.scores]
        derived = derive(handle, store, pressing, options, path, writer, progress)
    finally:
        writer.close()
    s = writer.stats
    return BuildReport(
        contexts=len(plan.chains), distinct=len(steps), other_shards=plan.other_shards,
        built=counts.built + derived.computed_contexts, skipped=skipped, failed=len(plan.errors),
        tokens=counts.tokens + derived.tokens, tokens_reused=reused + counts.tokens_reused, migrated=len(legacy),
        chunks_written=s.chunks_written, raw_bytes=s.raw_bytes, stored_bytes=s.stored_bytes,
        seconds=time.perf_counter() - t_start, store_seconds=s.store_seconds, store_wait_seconds=s.wait_seconds,
        errors=list(plan.errors), keys=[p.key if p else "" for p in plan.chains],
        pressed_written=derived.pressed, scores_written=derived.scores, derived_bytes=derived.bytes,
        scoring_tokens=derived.scoring.total,
    )  # fmt: skip


def _shared_prefixes(to_compute: Sequence[tuple[Chain, int]]) -> list[tuple[Chain, int]]:
    """The longest not-yet-stored chunk prefixes that at least two to_compute contexts share, as
    ``(chain of the prefix, stored depth)`` jobs (their chunks only: a prefix is not a context)."""
    uses: dict[str, int] = {}
    for chain, depth in to_compute:
        for k in chain.keys[depth:]:
            uses[k] = uses.get(k, 0) + 1
    jobs: dict[str, tuple[Chain, int]] = {}
    for chain, depth in to_compute:
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


__all__ = ["BuildReport", "build_caches", "default_build_batch", "run_build"]
