"""Scoring: log-likelihoods of continuations given contexts, from stored caches or without them.

* **Cached** (``use_cache=True``): rows are batched with a context's rows together and each batch
  runs the same stages as sampling (:mod:`kvstore.model.stages`): load, complete, then per variant
  transform (a press, over the context's tokens scoring reads) and the score stage
  (:mod:`kvstore.model.stages.score`: ``x[-1]`` fed again with ``y[:-1]`` after the contexts).
  The reference under a variant (``use_cache=False`` with a press or a hook) runs the same stages
  with nothing loaded or stored, so both paths agree under any variant.
* **Reference** (``use_cache=False``, no variant): ``x + y[:-1]`` right-padded from position 0
  through the model in one forward, as lm-evaluation-harness's ``hf`` model runs it
  (:func:`kvstore.model.scoring.rows.score_reference`).

Both gather ``log_softmax`` of the logits (float32 and float64 models in their own dtype, 16-bit
ones upcast to float32) at the continuation's tokens and sum them in float64; a row is greedy when
the argmax at every continuation position is that token. Rolling log-likelihood
(:func:`score_rolling`) splits each document into lm-eval's ``loglikelihood_rolling`` windows and
scores them as rows. The result types and the tokenization rules live in
:mod:`kvstore.model.scoring.scores`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic

import torch

from kvstore.errors import ContextTooLongError, DatasetError, ModelError, PressError
from kvstore.model.compute.attention import uses_grouped_kv
from kvstore.model.compute.forward import Decoding
from kvstore.model.handle import row_label
from kvstore.model.io import chains
from kvstore.model.io.chains import DEFAULT_KEYING, Keying
from kvstore.model.io.writer import Writer
from kvstore.model.options import ScoreOptions
from kvstore.model.paths.base import BatchScores, BatchSetup, CachePath, PreparedT, Scoring
from kvstore.model.paths.choice import check_supported, check_variants
from kvstore.model.pipelines.batches import run_batches
from kvstore.model.plan.batch import BatchPlan, RowSet, plan_batch
from kvstore.model.press.spec import ScoringTokens
from kvstore.model.scoring.rows import row_batches, score_reference, vocab_size
from kvstore.model.scoring.scores import (
    RollingResult,
    RollingResults,
    ScoredRow,
    ScoreResult,
    encode_pair,
    prefix_token_id,
    rolling_windows,
)
from kvstore.model.stages.load import Loaded, load
from kvstore.model.variants.variant import Variant
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle, TextOrIds


@dataclass(frozen=True)
class ScoreRows:
    """Tokenized rows: each context (at least 1 token) and continuation (at least 1), fitting the
    model's positions; ``keep[i]``: also store row ``i``'s context + continuation as a chain, from
    the keys and values the scoring forward computed (empty: keep none)."""

    contexts: tuple[tuple[int, ...], ...]
    continuations: tuple[tuple[int, ...], ...]
    keep: tuple[bool, ...] = ()


def encode_rows(
    handle: ModelHandle, contexts: Sequence[TextOrIds], continuations: Sequence[TextOrIds], special_tokens: bool,
    labels: Sequence[str] | None, truncate: bool,
) -> ScoreRows:  # fmt: skip
    """Token ids of each (context, continuation) row, split as lm-eval splits them
    (:func:`kvstore.model.scoring.scores.encode_pair`) and fitted to the model's positions;
    DatasetError naming a row whose continuation is empty."""
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    pairs = [encode_pair(handle, c, y, special_tokens=special_tokens) for c, y in zip(contexts, continuations)]
    ctx, cont = [p[0] for p in pairs], [p[1] for p in pairs]
    for i in range(len(pairs)):
        label = row_label(labels, i)
        if not cont[i]:
            raise DatasetError(f"{label}: the continuation is empty after tokenization; there is nothing to score")
        ctx[i] = _fit(handle, ctx[i], len(cont[i]), truncate, label)
    return ScoreRows(tuple(map(tuple, ctx)), tuple(map(tuple, cont)))


def _fit(handle: ModelHandle, ctx: list[int], n_cont: int, truncate: bool, label: str) -> list[int]:
    """``ctx`` such that context + continuation - 1 tokens fit the model's positions: as is, or
    left-truncated (lm-eval's rule: the last ``max_positions + 1`` tokens of the pair) with
    ``truncate``; else ContextTooLongError naming the row."""
    limit = handle.max_positions
    if not limit or len(ctx) + n_cont - 1 <= limit:
        return ctx
    if truncate and n_cont <= limit:
        return ctx[len(ctx) + n_cont - 1 - limit :]
    raise ContextTooLongError(
        f"{label}: context ({len(ctx)}) + continuation ({n_cont}) tokens exceed the model's {limit} positions"
        + ("" if n_cont > limit else "; shorten it or ask for left-truncation (truncate=True / --truncate)")
    )


@uses_grouped_kv
def score_rows(
    handle: ModelHandle, rows: ScoreRows, options: ScoreOptions, variants: Sequence[Variant], store: KVStore | None,
    keys: Keying = DEFAULT_KEYING, progress: Progress | None = None,
) -> list[ScoreResult]:  # fmt: skip
    """One :class:`ScoreResult` per variant, every variant scored from each batch's one load. Rows
    are kept (``rows.keep``) only from a dense variant's forward: a hooked or pressed one's keys
    and values are not what the model computes on the whole context."""
    path = check_supported(handle, store if options.use_cache else None)
    check_variants(handle, variants)
    for v in variants:
        if v.press is not None and v.press.question:
            raise PressError(
                f"{v.name}: a question-aware press needs a question apart from its context; in scoring the question "
                "is part of the scored context: use the press without ':q'"
            )
    plain = all(v.dense for v in variants)
    if options.use_cache and not path.supports("scoring"):
        raise ModelError(
            f"scoring from stored caches supports models whose every layer is full attention; {handle.name} "
            f"({handle.model.config.model_type}) has sliding-window, chunked or state layers: score it without the "
            "cache (use_cache=False / --no-cache)"
        )
    if options.use_cache or not plain:  # a variant's reference: the cached layout, nothing loaded or stored
        return _score_cached(handle, rows, options, variants, store if options.use_cache else None, keys, progress)
    scored = score_reference(handle, rows.contexts, rows.continuations, options, progress)
    computed = sum(len(c) for c in rows.contexts)
    kept = [len(c) - 1 for c in rows.contexts]
    nbytes = sum(kept) * handle.kv_bytes_per_token()
    saved = sum(len(c) for c in rows.contexts) - computed
    return [ScoreResult(scored, computed, saved, v.name, kept, nbytes) for v in variants]


@torch.inference_mode()
def _score_cached(
    handle: ModelHandle, rows: ScoreRows, options: ScoreOptions, variants: Sequence[Variant], store: KVStore | None,
    keys: Keying, progress: Progress | None,
) -> list[ScoreResult]:  # fmt: skip
    """Every variant's scores through the model's cache path (load, complete, transform, score),
    each batch planned once; without ``store`` nothing is loaded or stored (a variant's reference)."""
    ctx, cont = rows.contexts, rows.continuations
    n = len(ctx)
    keep = rows.keep or (False,) * n
    limit = handle.max_positions
    # fed tokens: the context's last again, then the continuation but its last (which predicts nothing);
    # a row to keep feeds its last too when it fits, so its whole text is stored
    extra = [keep[i] and (not limit or len(ctx[i]) + len(cont[i]) <= limit) for i in range(n)]
    fed = [(ctx[i][-1],) + cont[i][: len(cont[i]) - 1 + extra[i]] for i in range(n)]
    chain_list = [
        chains.chain_of(handle, c, store, prefix=keys.prefix, special_tokens=keys.special_tokens) for c in ctx
    ]
    # a press reads the context but its last token: its derived entries are that context's
    pressing = any(v.press is not None for v in variants) and store is not None
    scored = tuple(
        chains.chain_of(handle, c[:-1], store, prefix=keys.prefix, special_tokens=keys.special_tokens) for c in ctx
    ) if pressing else ()  # fmt: skip
    requests = RowSet(tuple(chain_list), tuple(fed), 0, scored)
    order = sorted(range(n), key=lambda i: (len(ctx[i]), chain_list[i].key, i))
    sizes = [len(ctx[i]) + len(fed[i]) for i in range(n)]
    writer = Writer(store) if (store is not None and not store.readonly) else None
    path = check_supported(handle, store)
    work = BatchSetup(store, writer, Decoding(), tuple(variants), Scoring(tuple(cont), options.token_logprobs, keep))
    row_logits = vocab_size(handle) * 4
    todo = list(row_batches(order, [p.key for p in chain_list], sizes, [len(f) for f in fed], options.batch_size,
                            options.max_batch_tokens, row_logits))  # fmt: skip
    # the next batch's load runs on a worker while this one scores, as sampling's does
    ahead = store is not None and path.supports("load_ahead")
    try:
        parts, waited = run_batches(
            handle, ScoringBatches(handle, path, work, requests), todo, ahead=ahead,
            progress=(lambda b: progress(len(b), sum(sizes[i] for i in b))) if progress else None,
        )  # fmt: skip
    finally:
        if writer is not None:
            writer.close()
    return _collect(rows, variants, parts, waited)


@dataclass(frozen=True)
class ScoringBatches(Generic[PreparedT]):
    """Scoring's work on each batch (a :class:`~kvstore.model.pipelines.batches.BatchWork`):
    planned without fixed shapes, prepared by ``path`` and scored under every variant."""

    handle: ModelHandle
    path: CachePath[PreparedT]
    work: BatchSetup
    requests: RowSet

    def plan(self, rows: list[int]) -> BatchPlan:
        w = self.work
        return plan_batch(rows, self.requests, w.store, w.writer, False, w.variants)

    def load(self, plan: BatchPlan) -> Loaded:
        return load(self.handle, plan, self.work.store, self.work.writer)

    def prepare(self, plan: BatchPlan, loaded: Loaded | None) -> PreparedT:
        return self.path.prepare(self.handle, plan, self.work, loaded)

    def finish(self, plan: BatchPlan, prepared: PreparedT) -> BatchScores:
        return self.path.score(self.handle, plan, self.work, prepared)


def _collect(
    rows: ScoreRows, variants: Sequence[Variant], parts: Sequence[tuple[BatchPlan, BatchScores]], waited: float = 0.0
) -> list[ScoreResult]:
    """The per-variant results of every batch, in the caller's row order (``waited``: seconds spent
    waiting for loads done ahead)."""
    n = len(rows.contexts)
    computed = sum(b.computed for _, b in parts)
    scoring = sum((b.scoring for _, b in parts), ScoringTokens())
    saved = sum(len(c) for c in rows.contexts) - computed
    out = []
    for j, v in enumerate(variants):
        scored: list[ScoredRow | None] = [None] * n
        kept = [0] * n
        nbytes = 0
        for plan, b in parts:
            nbytes += b.nbytes[j]
            for r, i in enumerate(plan.rows):
                total, greedy, per_token = b.rows[j][r]
                scored[i] = ScoredRow(total, greedy, len(rows.continuations[i]), per_token, b.cached_tokens[r])
                kept[i] = b.kept_tokens[j][r]
        done_rows = [r for r in scored if r is not None]
        assert len(done_rows) == n
        out.append(
            ScoreResult(
                rows=done_rows,
                prefill_tokens_computed=computed,
                prefill_tokens_saved=saved,
                variant=v.name,
                kept_tokens=kept,
                cache_bytes=nbytes,
                window_tokens_computed=scoring.window,
                scoring_tokens_computed=scoring.total,
                replay_tokens_computed=scoring.replay,
                load_wait_seconds=waited,
            )
        )
    return out


def score_rolling(
    handle: ModelHandle, texts: Sequence[TextOrIds], options: ScoreOptions, variant: Variant, store: KVStore | None,
    window: tuple[int | None, bool] = (None, True), progress: Progress | None = None,
) -> RollingResults:  # fmt: skip
    """Log-likelihood of whole documents, as lm-eval's ``loglikelihood_rolling`` computes it (see
    :meth:`kvstore.model.adapter.Adapter.score_rolling`); ``window`` = ``(max_length,
    store_documents)``."""
    max_length, store_documents = window
    limit = max_length or handle.max_positions
    head = prefix_token_id(handle)
    docs = [handle.encode_question(t) for t in texts]
    ctx: list[tuple[int, ...]] = []
    cont: list[tuple[int, ...]] = []
    owner: list[int] = []
    keep: list[bool] = []
    for d, toks in enumerate(docs):
        for w, (c, y) in enumerate(rolling_windows(toks, head, limit) if limit else [([head], toks)] if toks else []):
            ctx.append(tuple(c))
            cont.append(tuple(y))
            owner.append(d)
            keep.append(store_documents and w == 0)
    scored = score_rows(handle, ScoreRows(tuple(ctx), tuple(cont), tuple(keep)), options, [variant], store,
                        progress=progress)[0]  # fmt: skip
    out = RollingResults()
    out.prefill_tokens_computed, out.prefill_tokens_saved = scored.prefill_tokens_computed, scored.prefill_tokens_saved
    out.load_wait_seconds = scored.load_wait_seconds
    windows_of: list[list[int]] = [[] for _ in texts]
    for j, d in enumerate(owner):
        windows_of[d].append(j)
    for d, text in enumerate(texts):
        mine = windows_of[d]
        parts = [scored.rows[j] for j in mine]
        per_token = tuple(x for p in parts for x in (p.token_logprobs or ())) if options.token_logprobs else None
        out.append(
            RollingResult(
                math.fsum(p.logprob for p in parts), len(docs[d]), len(text) if isinstance(text, str) else None,
                per_token, sum(p.cached_tokens for p in parts), sum(len(ctx[j]) for j in mine), len(parts),
            )
        )  # fmt: skip
    return out


__all__ = ["ScoreRows", "encode_rows", "score_rolling", "score_rows"]
