"""Scoring: log-likelihoods of continuations given contexts, from stored caches or without them.

Layouts (B rows; a row is a context ``x`` of ``c`` tokens and a continuation ``y`` of ``q``):

* **Cached** (``use_cache=True``): each distinct context's longest stored chain prefix is copied
  into left-padded KV buffers and the rest computed and stored, exactly as decoding does
  (:func:`kvstore.model.pipelines.sample.load_batch` and :func:`~kvstore.model.pipelines.sample.complete`); rows that
  share a context share one load. The log-probs of ``y[0]`` come from the hidden state at the
  context's *last* position, which a KV cache does not hold, so that slot (``P - 1``) is masked and
  ``x[-1]`` is fed again, followed by ``y[:-1]``: the fed tokens sit right-padded in the slots
  after the contexts, at positions ``c - 1, c, ...``, and one forward gives logits at every fed
  slot (fed slot ``j`` predicts ``y[j]``). Fed pads come *after* each row's real tokens, so every
  query sees at least one real key (a fully masked query row gives NaN under eager float64
  attention, and NaN poisons real rows through ``0 * NaN``).
* **Reference** (``use_cache=False``): ``x + y[:-1]`` right-padded from position 0 through the
  model in one forward, as lm-evaluation-harness's ``hf`` model runs it; logits at positions
  ``c - 1 .. c + q - 2``.

Both gather ``log_softmax`` of the logits (float32 and float64 models in their own dtype, 16-bit
ones upcast to float32) at the continuation's tokens and sum them in float64; a row is greedy when
the argmax at every continuation position is that token. The tests compare both paths with each
other and with a plain Hugging Face forward over context + continuation.

Rolling log-likelihood (:func:`score_rolling`) splits each document into lm-eval's
``loglikelihood_rolling`` windows (:func:`rolling_windows`) and scores them as rows. The result
types and the tokenization rules live in :mod:`kvstore.model.scoring.scores` (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.errors import ContextTooLongError, DatasetError, ModelError
from kvstore.model.compute.attention import uses_grouped_kv
from kvstore.model.compute.cache import PreallocatedCache
from kvstore.model.compute.forward import Stop
from kvstore.model.compute.writer import Writer
from kvstore.model.pipelines import sample as decode
from kvstore.model.scoring.rows import gather, row_batches, run_halving, score_reference, vocab_size
from kvstore.model.scoring.scores import (
    RollingResult,
    RollingResults,
    ScoredRow,
    ScoreResult,
    encode_pair,
    prefix_token_id,
    rolling_windows,
)
from kvstore.model.variants import hooks
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle, TextOrIds

GenerationContext = hooks.GenerationContext


@uses_grouped_kv
def score(
    adapter: ModelHandle,
    contexts: Sequence[TextOrIds],
    continuations: Sequence[TextOrIds],
    *,
    generation_context: GenerationContext | None = None,
    decode_attention: Any = None,
    **kwargs: Any,
) -> ScoreResult:
    """Log-likelihood of ``continuations[i]`` given ``contexts[i]``: per row the sum of the
    continuation tokens' log-probabilities, whether greedy decoding would have produced it,
    and (``token_logprobs``) each token's log-probability (:class:`ScoreResult`).

    Contexts and continuations are text or token ids, split as lm-eval's ``hf`` model splits
    them (:func:`kvstore.model.pipelines.score.encode_pair`: ids as given; for text, whitespace ending
    the context moves to the continuation, whose ids are those of context + continuation past
    the context's; an empty context is scored from the BOS, or EOS, token).

    ``use_cache=True`` loads each distinct context's longest stored prefix from ``store`` once
    per batch for every continuation of it, computes and stores the rest (``prefix``,
    ``special_tokens``: as for ``Adapter.generate_kv_cache``, so the keys match); ``use_cache=False``
    is the reference: context + continuation through the model in one forward. Both agree to
    rounding (float64 1e-10, float32 1e-4 in the tests). Rows run in batches of up to
    ``batch_size`` rows and ``max_batch_tokens`` padded tokens, the continuations of one
    context together; a batch that runs out of memory runs again as two halves.
    ``generation_context(model)`` and ``decode_attention`` (as for ``Adapter.greedy_sample``), if
    given, are entered around the continuation forwards only, never a context's prefill; the
    reference then splits the same way (nothing stored), so both paths agree under a hook.

    Raises DatasetError (naming the row with ``labels``) for an empty continuation,
    ContextTooLongError when context + continuation exceed the model's positions (unless
    ``truncate``, which drops the context's first tokens as lm-eval does), ModelError for a
    model whose cache kvstore cannot reuse exactly (windowed and state models: with
    ``use_cache=False`` only). The keyword arguments are :func:`score_sweep`'s.
    """
    variant = hooks.hook_variant(generation_context, decode_attention)
    return score_sweep(adapter, contexts, continuations, variants=[variant], **kwargs)[variant.name]


@uses_grouped_kv
def score_sweep(
    adapter: ModelHandle,
    contexts: Sequence[TextOrIds],
    continuations: Sequence[TextOrIds],
    *,
    variants: Sequence[Any],
    store: KVStore | None = None,
    use_cache: bool = True,
    batch_size: int = 8,
    special_tokens: bool = True,
    prefix: TextOrIds | None = None,
    token_logprobs: bool = False,
    max_batch_tokens: int | None = None,
    progress: Progress | None = None,
    labels: Sequence[str] | None = None,
    truncate: bool = False,
) -> dict[str, ScoreResult]:
    """:func:`score` under each of ``variants`` (decode-attention specs such as ``dense``,
    ``topk:K``, ``sparq:R:K``, attention functions, or :class:`kvstore.model.variants.hooks.Variant`) from
    one load of each batch: every variant scores from the same loaded buffers (no second load or
    prefill). Results by variant name, in the order given; each equals a :func:`score` run with
    that variant alone (``decode_attention`` / ``generation_context``)."""
    chosen = hooks.variants(variants)
    ctx, cont = _encode_rows(adapter, contexts, continuations, special_tokens, labels, truncate)
    results = _score_many(
        adapter, ctx, cont, chosen, store=store, use_cache=use_cache, batch_size=batch_size,
        special_tokens=special_tokens, prefix=prefix, token_logprobs=token_logprobs,
        max_batch_tokens=max_batch_tokens, progress=progress, keep=None,
    )  # fmt: skip
    return {v.name: r for v, r in zip(chosen, results)}


def _encode_rows(adapter: ModelHandle, contexts, continuations, special_tokens: bool, labels, truncate: bool):
    """Token ids of each (context, continuation) row, split as lm-eval splits them and fitted to
    the model's positions; DatasetError naming a row whose continuation is empty."""
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    pairs = [encode_pair(adapter, c, y, special_tokens=special_tokens) for c, y in zip(contexts, continuations)]
    ctx, cont = [p[0] for p in pairs], [p[1] for p in pairs]
    for i in range(len(pairs)):
        label = adapter.row_label(labels, i)
        if not cont[i]:
            raise DatasetError(f"{label}: the continuation is empty after tokenization; there is nothing to score")
        ctx[i] = _fit(adapter, ctx[i], len(cont[i]), truncate, label)
    return ctx, cont


def _fit(adapter: ModelHandle, ctx: list[int], n_cont: int, truncate: bool, label: str) -> list[int]:
    """``ctx`` such that context + continuation - 1 tokens fit the model's positions: as is, or
    left-truncated (lm-eval's rule: the last ``max_positions + 1`` tokens of the pair) with
    ``truncate``; else ContextTooLongError naming the row."""
    limit = adapter.max_positions
    if not limit or len(ctx) + n_cont - 1 <= limit:
        return ctx
    if truncate and n_cont <= limit:
        return ctx[len(ctx) + n_cont - 1 - limit :]
    raise ContextTooLongError(
        f"{label}: context ({len(ctx)}) + continuation ({n_cont}) tokens exceed the model's {limit} positions"
        + ("" if n_cont > limit else "; shorten it or ask for left-truncation (truncate=True / --truncate)")
    )


def score_ids(
    adapter: ModelHandle,
    ctx: Sequence[Sequence[int]],
    cont: Sequence[Sequence[int]],
    *,
    generation_context: GenerationContext | None = None,
    decode_attention: Any = None,
    **kwargs: Any,
) -> ScoreResult:
    """Score tokenized rows (each context at least 1 token, each continuation at least 1, both
    fitting the model's positions); the other keyword arguments are :func:`_score_many`'s
    (``keep[i]``: also store row ``i``'s context + continuation as a chain, from the KV the
    scoring forward computed). ``generation_context`` and ``decode_attention`` as for
    :func:`score`."""
    return _score_many(adapter, ctx, cont, [hooks.hook_variant(generation_context, decode_attention)], **kwargs)[0]


def _score_many(
    adapter: ModelHandle, ctx, cont, chosen: Sequence[hooks.Variant], *, store: KVStore | None = None,
    use_cache: bool = True, batch_size: int = 8, special_tokens: bool = True, prefix: TextOrIds | None = None,
    token_logprobs: bool = False, max_batch_tokens: int | None = None, progress: Progress | None = None,
    keep: Sequence[bool] | None = None,
) -> list[ScoreResult]:  # fmt: skip
    """One :class:`ScoreResult` per variant in ``chosen``, every variant scored from each batch's
    one load. Rows are kept (``keep``) only from a dense variant's forward: a hooked one's keys and
    values are not what the model computes."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    adapter.check_supported(store if use_cache else None)
    hooked = [v for v in chosen if not v.dense]
    hooks.check_model(adapter, bool(hooked))
    if use_cache and not adapter.path.supports("scoring"):
        raise ModelError(
            f"scoring from stored caches supports models whose every layer is full attention; {adapter.name} "
            f"({adapter.model.config.model_type}) has sliding-window, chunked or state layers: score it without the "
            "cache (use_cache=False / --no-cache)"
        )
    n = len(ctx)
    ctx = [list(map(int, c)) for c in ctx]
    cont = [list(map(int, y)) for y in cont]
    rows: list[list[ScoredRow | None]] = [[None] * n for _ in chosen]
    computed = 0
    if use_cache or hooked:  # a hooked reference: the cached layout with nothing loaded or stored
        computed = _score_cached(
            adapter, ctx, cont, rows, store if use_cache else None, batch_size, special_tokens, prefix,
            token_logprobs, max_batch_tokens, progress, chosen, keep or [False] * n,
        )  # fmt: skip
    else:
        computed = score_reference(adapter, ctx, cont, rows[0], batch_size, token_logprobs, max_batch_tokens, progress)
        for other in rows[1:]:  # dense variants named twice are refused; several dense ones share it
            other[:] = rows[0]
    out = []
    for v, mine in zip(chosen, rows):
        done = [r for r in mine if r is not None]
        assert len(done) == n
        out.append(ScoreResult(done, computed, sum(len(c) for c in ctx) - computed, v.name))
    return out


@torch.inference_mode()
def _score_cached(
    adapter: ModelHandle, ctx, cont, rows: list, store: KVStore | None, batch_size: int, special_tokens: bool, prefix,
    token_logprobs: bool, max_batch_tokens: int | None, progress: Progress | None, chosen: Sequence[hooks.Variant],
    keep: Sequence[bool],
) -> int:  # fmt: skip
    n = len(ctx)
    limit = adapter.max_positions
    # fed tokens: the context's last again, then the continuation but its last (which predicts nothing);
    # a row to keep feeds its last too when it fits, so its whole text is stored
    extra = [bool(keep[i]) and (not limit or len(ctx[i]) + len(cont[i]) <= limit) for i in range(n)]
    fed = [[ctx[i][-1]] + cont[i][: len(cont[i]) - 1 + extra[i]] for i in range(n)]
    plans = [adapter.plan(c, store, prefix=prefix, special_tokens=special_tokens) for c in ctx]
    keys = [p.key for p in plans]
    order = sorted(range(n), key=lambda i: (len(ctx[i]), keys[i], i))
    sizes = [len(ctx[i]) + len(fed[i]) for i in range(n)]
    row_logits = vocab_size(adapter) * 4
    writer = Writer(store, None) if (store is not None and not store.readonly) else None
    computed = 0
    seen: set[str] = set()
    dev = adapter.device

    def run(batch: list[int]) -> None:
        nonlocal computed
        bplans = [plans[i] for i in batch]
        if writer is not None and any(keys[i] in seen for i in batch):
            writer.flush()  # a context split over batches: the next part loads what the first stored
        seen.update(keys[i] for i in batch)
        pre = decode.load_batch(adapter, bplans, [fed[i] for i in batch], 0, store, Stop())
        computed += decode.complete(adapter, bplans, pre, store, writer)
        B = len(batch)
        c_len = [len(ctx[i]) for i in batch]
        q_len = [len(fed[i]) for i in batch]
        P, Q = max(c_len), max(q_len)
        mask = torch.zeros((B, P + Q), dtype=torch.long)
        pos = torch.empty((B, Q), dtype=torch.long)
        input_ids = torch.full((B, Q), adapter.pad_id, dtype=torch.long)
        for r, i in enumerate(batch):
            c, q = c_len[r], q_len[r]
            mask[r, P - c : P - 1] = 1  # the context's last slot is fed again below
            mask[r, P : P + q] = 1
            pos[r] = c - 2 + q  # pads after the row: its last position again (masked, in range)
            pos[r, :q] = torch.arange(c - 1, c - 1 + q)
            input_ids[r, :q] = torch.as_tensor(fed[i], dtype=torch.long)
        input_ids, mask, pos = input_ids.to(dev), mask.to(dev), pos.to(dev)  # once for every variant
        kept = False
        for j, v in enumerate(chosen):  # each variant writes only the fed slots, from P on: contexts stay
            cache = PreallocatedCache(pre.bufs, P)
            with hooks.running(v, adapter.model):
                out = adapter.model(
                    input_ids=input_ids, attention_mask=mask, position_ids=pos,
                    **{adapter.layout.cache_arg: cache}, use_cache=True, logits_to_keep=0,
                )  # fmt: skip
            for r, i in enumerate(batch):
                total, greedy, per_token = gather(out.logits[r, : len(cont[i])], cont[i], token_logprobs)
                rows[j][i] = ScoredRow(total, greedy, len(cont[i]), per_token, pre.loaded[keys[i]])
            if writer is not None and v.dense and not kept:  # the fed slots hold what the model computes
                _keep_rows(adapter, store, writer, batch, ctx, fed, pre.bufs, P, keep)
                kept = True
            del out, cache
        if progress:
            progress(B, sum(sizes[i] for i in batch))

    try:
        for batch in row_batches(order, keys, sizes, [len(f) for f in fed], batch_size, max_batch_tokens, row_logits):
            run_halving(run, batch, adapter)
    finally:
        if writer is not None:
            writer.close()
    return computed


def _keep_rows(adapter: ModelHandle, store, writer: Writer, batch, ctx, fed, bufs, P: int, keep) -> None:
    """Store each kept row's context + fed tokens as a chain, from the KV the scoring forward left
    in ``bufs`` (the context's slots but its last, then the fed slots); chains stored whole already
    are left alone."""
    for r, i in enumerate(batch):
        if not keep[i]:
            continue
        ids = ctx[i][:-1] + fed[i]
        plan = adapter.plan(ids, store)
        if store.contains(plan.key):
            continue
        c, q = len(ctx[i]), len(fed[i])
        layers = tuple(
            (torch.cat([kb[r, :, P - c : P - 1], kb[r, :, P : P + q]], dim=1),
             torch.cat([vb[r, :, P - c : P - 1], vb[r, :, P : P + q]], dim=1))
            for kb, vb in bufs
        )  # fmt: skip
        writer.put_chunks(adapter, plan, layers)


def score_rolling(
    adapter: ModelHandle,
    texts: Sequence[TextOrIds],
    *,
    store: KVStore | None = None,
    use_cache: bool = True,
    max_length: int | None = None,
    token_logprobs: bool = False,
    batch_size: int = 8,
    max_batch_tokens: int | None = None,
    progress: Progress | None = None,
    generation_context: GenerationContext | None = None,
    store_documents: bool = True,
    decode_attention: Any = None,
) -> RollingResults:
    """Log-likelihood of whole documents, as lm-eval's ``loglikelihood_rolling`` computes it:
    text encoded without special tokens, the first token scored from the BOS (or EOS) token,
    documents longer than ``max_length`` (default: the model's positions) in lm-eval's windows
    (:func:`kvstore.model.pipelines.score.rolling_windows`). A list of one :class:`RollingResult` per
    document (perplexity, bits per token and, for text, bits per character) that also carries
    the run's ``prefill_tokens_computed`` and ``prefill_tokens_saved``.

    With the cache, each window's context (the prefix token; a last short window's overlap) is
    loaded from or stored in ``store``, so a second run computes no context token; every scored
    token is computed on every run (its log-probability needs the hidden state at its
    position, which stored keys and values do not give). With ``store_documents`` the keys and
    values that forward computed for a document's first window (``[BOS or EOS] + document``)
    are stored as a chain too, at no extra compute, for later requests whose context starts
    with it."""
    limit = max_length or adapter.max_positions
    head = prefix_token_id(adapter)
    docs = [adapter.encode_question(t) for t in texts]
    ctx: list[list[int]] = []
    cont: list[list[int]] = []
    owner: list[int] = []
    keep: list[bool] = []
    for d, toks in enumerate(docs):
        for w, (c, y) in enumerate(rolling_windows(toks, head, limit) if limit else [([head], toks)] if toks else []):
            ctx.append(c)
            cont.append(y)
            owner.append(d)
            keep.append(store_documents and w == 0)
    scored = score_ids(
        adapter, ctx, cont, store=store, use_cache=use_cache, batch_size=batch_size, token_logprobs=token_logprobs,
        max_batch_tokens=max_batch_tokens, progress=progress, generation_context=generation_context, keep=keep,
        decode_attention=decode_attention,
    )  # fmt: skip
    out = RollingResults()
    out.prefill_tokens_computed, out.prefill_tokens_saved = scored.prefill_tokens_computed, scored.prefill_tokens_saved
    windows_of: list[list[int]] = [[] for _ in texts]
    for j, d in enumerate(owner):
        windows_of[d].append(j)
    for d, text in enumerate(texts):
        mine = windows_of[d]
        parts = [scored.rows[j] for j in mine]
        per_token = tuple(x for p in parts for x in (p.token_logprobs or ())) if token_logprobs else None
        out.append(
            RollingResult(
                math.fsum(p.logprob for p in parts), len(docs[d]), len(text) if isinstance(text, str) else None,
                per_token, sum(p.cached_tokens for p in parts), sum(len(ctx[j]) for j in mine), len(parts),
            )
        )  # fmt: skip
    return out


__all__ = [
    "RollingResult",
    "RollingResults",
    "ScoreResult",
    "ScoredRow",
    "encode_pair",
    "prefix_token_id",
    "rolling_windows",
    "score",
    "score_ids",
    "score_rolling",
    "score_sweep",
]
