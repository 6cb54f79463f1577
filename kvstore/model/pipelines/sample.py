"""Sampling: batched greedy answers to questions about stored contexts, under one or more variants.

:func:`sample_variants` tokenizes the rows, plans each context's chain, orders rows by context (rows
of one context share a load) and length, and cuts them into batches. Each batch is a
:class:`~kvstore.model.plan.batch.BatchPlan` run by the model's cache path
(:mod:`kvstore.model.paths`): load, complete (compute what is missing and hand it to the writer),
then per variant transform (a press) and answer. Loading ahead is "plan the next batch and submit its
load": once a batch is complete (its new chunks handed to the writer), the next batch is planned
(seeing the chunks the writer holds, such as a shared head, and waiting for them instead of
computing them again) and its load runs on a worker thread while this batch's variants answer.

Layouts (exactness depends on them): stored contexts are *left*-padded to the batch's longest ``P``
(pads are zero KV, masked), questions left-padded after them, then the generated tokens; explicit
``position_ids`` continue each row at its own context length (``c + j``). The reference without a
cache (``use_cache=False``) runs context and question together (one variant, no hook), or prefills
the contexts densely in memory and answers each variant as the cached path does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic

import torch

from kvstore.errors import ContextTooLongError
from kvstore.model.compute.attention import uses_grouped_kv
from kvstore.model.compute.forward import Decoding, batches, row_length
from kvstore.model.handle import row_label
from kvstore.model.io import chains
from kvstore.model.io.chains import Chain, Keying
from kvstore.model.io.writer import Writer
from kvstore.model.options import SampleOptions
from kvstore.model.paths.base import BatchAnswers, BatchSetup, CachePath, PreparedT
from kvstore.model.paths.choice import check_supported, check_variants
from kvstore.model.pipelines.batches import run_batches
from kvstore.model.plan.batch import BatchPlan, RowSet, plan_batch
from kvstore.model.press.spec import ScoringTokens
from kvstore.model.stages.load import Loaded, load
from kvstore.model.variants import hooks
from kvstore.model.variants.variant import DENSE, Variant
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle, TextOrIds


@dataclass
class SampleResult:
    """Tokens from :meth:`Adapter.greedy_sample` with ``return_details=True``.

    ``tokens``: ``[n_rows, num_new_tokens]`` int64; after a row's EOS the rest is the pad id.
    ``scores``: per row ``[steps, vocab]`` float32 logits (only with ``return_scores``).
    ``cache_hit``: per row, whether its whole context came from the store; ``cached_tokens``: how
    many of its context tokens did. ``prefill_tokens_computed``: context tokens run through the
    model (each distinct context once per batch; with ``use_cache=False``, every row's context).
    ``prefill_tokens_saved``: context tokens the no-cache path would have computed and this run
    did not. ``codecs``: per row, the codec spec of the entries its context came from or was
    stored with (``int8:64`` when the answer came from a lossy cache; None without a cache).
    ``variant``: the name of the variant that answered (``dense`` without a hook or press);
    ``decode_seconds``: time spent answering under it (question forwards and decode steps, every
    batch; loads and prefills are shared by the variants of a sweep and not counted).
    ``kept_tokens``: per row, the context tokens it answered over (fewer than its context under a
    press); ``cache_bytes``: bytes of the keys and values of those tokens, summed over rows;
    ``scoring_tokens_computed``: context tokens the presses' scoring forwards ran (observation
    windows, context re-runs, replays; shared by every variant of a sweep; not prefill), of which
    ``window_tokens_computed`` observation windows and ``replay_tokens_computed`` replays.
    ``compose``: the composition policy that answered (``none``, ``last:64``, ``full``...; None
    for a context that was not composed of passages); only ``full`` is exact.
    ``lossy_copies``: in a lossless run, per lossy codec identity, how many of the contexts the store
    did not hold whole it held more of under that codec when the run began (what ``--codec`` would
    read; :func:`kvstore.model.io.chains.lossy_copies`); empty otherwise.
    """

    tokens: torch.Tensor
    lengths: list[int]
    cache_hit: list[bool]
    scores: list[torch.Tensor] | None = None
    prefill_tokens_saved: int = 0
    prefill_tokens_computed: int = 0
    cached_tokens: list[int] = field(default_factory=list)
    codecs: list[str | None] = field(default_factory=list)
    variant: str = DENSE.name
    decode_seconds: float = 0.0
    kept_tokens: list[int] = field(default_factory=list)
    cache_bytes: int = 0
    window_tokens_computed: int = 0
    scoring_tokens_computed: int = 0
    replay_tokens_computed: int = 0
    load_wait_seconds: float = 0.0
    compose: str | None = None
    lossy_copies: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Rows:
    """A run's rows, tokenized: context chains (``chains``), context ids and question ids (``question_ids``)."""

    chains: tuple[Chain, ...]
    contexts: tuple[tuple[int, ...], ...]
    question_ids: tuple[tuple[int, ...], ...]

    def requests(self, new_tokens: int) -> RowSet:
        """The rows as the batch planner reads them."""
        return RowSet(self.chains, self.question_ids, new_tokens)


def tokenize_rows(
    handle: ModelHandle, contexts: Sequence[TextOrIds], questions: Sequence[TextOrIds], options: SampleOptions,
    store: KVStore | None, keying: Keying, labels: Sequence[str] | None,
) -> Rows:  # fmt: skip
    """Token ids and chains of every row (``labels`` name rows in errors). ContextTooLongError
    naming a row whose context, question and answer exceed the positions."""
    special_tokens, prefix = keying.special_tokens, keying.prefix
    if len(contexts) != len(questions):
        raise ValueError(f"{len(contexts)} contexts but {len(questions)} questions")
    q_ids = [tuple(handle.encode_question(q)) for q in questions]
    c_ids = [
        tuple(handle.context_ids(c, special_tokens=special_tokens, truncate=options.truncate,
                                 max_context_tokens=options.max_context_tokens, label=row_label(labels, i)))
        for i, c in enumerate(contexts)
    ]  # fmt: skip
    if handle.max_positions:
        for i in range(len(c_ids)):
            if len(c_ids[i]) + len(q_ids[i]) + options.num_new_tokens > handle.max_positions:
                raise ContextTooLongError(
                    f"{row_label(labels, i)}: context ({len(c_ids[i])}) + question ({len(q_ids[i])}) + "
                    f"{options.num_new_tokens} new tokens exceed the model's {handle.max_positions} positions; use a "
                    "shorter question, fewer new tokens or a lower max_context_tokens"
                )
    chain_list = tuple(chains.chain_of(handle, c, store if options.use_cache else None, prefix=prefix,
                              special_tokens=special_tokens) for c in c_ids)  # fmt: skip
    return Rows(chain_list, tuple(c_ids), tuple(q_ids))


def check_sample(
    handle: ModelHandle, options: SampleOptions, variants: Sequence[Variant], store: KVStore | None
) -> CachePath[Any]:
    """A sample's one check, before any tokenizing: the model's cache path for the store it reads
    (ModelError for a model or codec it cannot serve), ValueError for no variant or compiled steps on
    a path without them, HookError for hooked variants under fixed-shape steps, ModelError for
    variants on a path without them."""
    if not variants:
        raise ValueError("no variant to answer with")
    hooks.check_steps(variants, options.steps)
    path = check_supported(handle, store if options.use_cache else None)
    if options.steps != "dynamic" and not path.supports("compile"):
        raise ValueError(
            f"compiled decoding supports models whose every layer is full attention; {handle.name} has "
            "sliding-window, chunked or state layers (decode it without compile)"
        )
    check_variants(handle, variants)
    return path


@uses_grouped_kv
def sample_variants(
    handle: ModelHandle, rows: Rows, options: SampleOptions, variants: Sequence[Variant], store: KVStore | None,
    path: CachePath[Any], progress: Progress | None = None,
) -> list[SampleResult]:  # fmt: skip
    """Greedy answers (see :meth:`kvstore.model.adapter.Adapter.sample`) under each of
    ``variants``, from one load of each batch: one :class:`SampleResult` per variant, in order.
    ``path``: what :func:`check_sample` returned for these options, variants and store."""
    decoding = options.decoding()
    use_store = store if options.use_cache else None
    writer = Writer(store) if (options.use_cache and store is not None and not store.readonly) else None
    work = BatchSetup(use_store, writer, decoding, tuple(variants))
    n = len(rows.chains)
    order = sorted(range(n), key=lambda i: (len(rows.contexts[i]), rows.chains[i].key, i))
    sizes = [len(rows.contexts[i]) + len(rows.question_ids[i]) + decoding.new_tokens for i in range(n)]
    todo = list(batches(order, sizes, options.batch_size, options.max_batch_tokens))
    ahead = options.load_ahead and use_store is not None and path.supports("load_ahead")
    # what a lossy codec holds of the contexts this lossless run misses, looked up before it stores them
    lossless = use_store is not None and use_store.codec.lossless
    held = chains.lossy_copies(handle, rows.chains, use_store) if lossless and use_store is not None else {}
    answering = Answering(handle, path, work, rows.requests(decoding.new_tokens))
    try:
        parts, waited = run_batches(
            handle, answering, todo, ahead=ahead, upcoming=answering.prefetch,
            progress=(lambda b: progress(len(b), sum(len(rows.contexts[i]) + len(rows.question_ids[i]) for i in b)))
            if progress else None,
        )  # fmt: skip
    finally:
        if writer is not None:
            writer.close()
    results = _collect(handle, rows, parts, variants, decoding, options.use_cache, waited)
    for result in results:
        result.lossy_copies = dict(held)
    return results


@dataclass(frozen=True)
class Answering(Generic[PreparedT]):
    """A sample's work on each batch (a :class:`~kvstore.model.pipelines.batches.BatchWork`):
    planned with the decoding's fixed shapes, prepared by ``path`` (nothing when there is no
    store: the no-cache reference) and answered under every variant."""

    handle: ModelHandle
    path: CachePath[PreparedT]
    work: BatchSetup
    requests: RowSet

    def plan(self, rows: list[int]) -> BatchPlan:
        w = self.work
        return plan_batch(rows, self.requests, w.store, w.writer, w.decoding.fixed, w.variants)

    def load(self, plan: BatchPlan) -> Loaded:
        return load(self.handle, plan, self.work.store, self.work.writer)

    def prepare(self, plan: BatchPlan, loaded: Loaded | None) -> PreparedT | None:
        if self.work.store is None:
            return None
        return self.path.prepare(self.handle, plan, self.work, loaded)

    def finish(self, plan: BatchPlan, prepared: PreparedT | None) -> BatchAnswers:
        if self.work.store is None:  # not ``prepared is None``: a path may prepare nothing ahead
            return self.path.reference(self.handle, plan, self.work)
        return self.path.answer(self.handle, plan, self.work, prepared)  # type: ignore[arg-type]

    def prefetch(self, rows: list[int]) -> None:
        """A remote store starts fetching the chunks of ``rows``' contexts (the next batch)."""
        if self.work.store is not None:
            self.work.store.prefetch(k for i in rows for k in self.requests.chains[i].keys)


def _collect(
    handle: ModelHandle, rows: Rows, parts: Sequence[tuple[BatchPlan, BatchAnswers]], variants: Sequence[Variant],
    decoding: Decoding, use_cache: bool, waited: float = 0.0,
) -> list[SampleResult]:  # fmt: skip
    """The per-variant results of every batch, in the caller's row order (``waited``: seconds spent
    waiting for loads done ahead)."""
    n, N = len(rows.chains), decoding.new_tokens
    out = []
    cached = [0] * n
    codecs: list[str | None] = [None] * n
    computed = sum(b.computed for _, b in parts)
    scoring = sum((b.scoring for _, b in parts), ScoringTokens())
    for plan, b in parts:
        for r, i in enumerate(plan.rows):
            cached[i] = b.cached_tokens[r]
            codecs[i] = b.codecs[r]
    for v, variant in enumerate(variants):
        tokens = torch.full((n, N), handle.pad_id, dtype=torch.long)
        lengths = [0] * n
        kept = [0] * n
        scores: list[torch.Tensor] | None = [torch.empty(0)] * n if decoding.scores else None
        seconds = 0.0
        nbytes = 0
        for plan, b in parts:
            a = b.answers[v]
            seconds += a.seconds
            nbytes += a.cache_bytes
            for r, i in enumerate(plan.rows):
                tokens[i] = a.tokens[r]
                lengths[i] = row_length(handle, a.tokens[r], decoding)
                kept[i] = a.kept_tokens[r]
                if scores is not None:
                    row_scores = a.scores[r]
                    assert row_scores is not None
                    scores[i] = row_scores
        hits = [use_cache and cached[i] == len(rows.contexts[i]) for i in range(n)]
        saved = sum(len(c) for c in rows.contexts) - computed
        out.append(
            SampleResult(
                tokens=tokens,
                lengths=lengths,
                cache_hit=hits,
                scores=scores,
                prefill_tokens_saved=saved,
                prefill_tokens_computed=computed,
                cached_tokens=list(cached),
                codecs=list(codecs),
                variant=variant.name,
                decode_seconds=seconds,
                kept_tokens=kept,
                cache_bytes=nbytes,
                window_tokens_computed=scoring.window,
                scoring_tokens_computed=scoring.total,
                replay_tokens_computed=scoring.replay,
                load_wait_seconds=waited,
            )
        )
    return out


__all__ = ["Rows", "SampleResult", "check_sample", "sample_variants", "tokenize_rows"]
