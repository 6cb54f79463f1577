"""Scoring: log-likelihoods of continuations given contexts, from stored caches or without them.

Layouts (B rows; a row is a context ``x`` of ``c`` tokens and a continuation ``y`` of ``q``):

* **Cached** (``use_cache=True``): each distinct context's longest stored chain prefix is copied
  into left-padded KV buffers and the rest computed and stored, exactly as decoding does
  (:func:`kvstore.model.decode.load_batch` and :func:`~kvstore.model.decode.complete`); rows that
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
types and the tokenization rules live in :mod:`kvstore.model.scores` (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from kvstore.errors import ContextTooLongError, DatasetError, ModelError
from kvstore.model import decode
from kvstore.model.attention import uses_grouped_kv
from kvstore.model.cache import PreallocatedCache
from kvstore.model.forward import Stop, is_out_of_memory
from kvstore.model.scores import (
    RollingResult,
    RollingResults,
    ScoredRow,
    ScoreResult,
    encode_pair,
    prefix_token_id,
    rolling_windows,
)
from kvstore.model.writer import Writer
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.adapter import Adapter, TextOrIds

GenerationContext = Callable[[Any], AbstractContextManager]
# float32 logits one scoring forward may hold ([rows, fed tokens, vocab]); a batch takes fewer rows
# rather than exceed it (one row always runs)
LOGITS_BYTES = 512 << 20


@uses_grouped_kv
def score(
    adapter: Adapter,
    contexts: Sequence[TextOrIds],
    continuations: Sequence[TextOrIds],
    *,
    store: KVStore | None = None,
    use_cache: bool = True,
    batch_size: int = 8,
    special_tokens: bool = True,
    prefix: TextOrIds | None = None,
    token_logprobs: bool = False,
    max_batch_tokens: int | None = None,
    progress: Progress | None = None,
    labels: Sequence[str] | None = None,
    generation_context: GenerationContext | None = None,
    truncate: bool = False,
) -> ScoreResult:
    """See :meth:`kvstore.model.adapter.Adapter.score`."""
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    pairs = [encode_pair(adapter, c, y, special_tokens=special_tokens) for c, y in zip(contexts, continuations)]
    ctx, cont = [p[0] for p in pairs], [p[1] for p in pairs]
    for i in range(len(pairs)):
        label = adapter.row_label(labels, i)
        if not cont[i]:
            raise DatasetError(f"{label}: the continuation is empty after tokenization; there is nothing to score")
        ctx[i] = _fit(adapter, ctx[i], len(cont[i]), truncate, label)
    return score_ids(
        adapter, ctx, cont, store=store, use_cache=use_cache, batch_size=batch_size, special_tokens=special_tokens,
        prefix=prefix, token_logprobs=token_logprobs, max_batch_tokens=max_batch_tokens, progress=progress,
        generation_context=generation_context,
    )  # fmt: skip


def _fit(adapter: Adapter, ctx: list[int], n_cont: int, truncate: bool, label: str) -> list[int]:
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
    adapter: Adapter,
    ctx: Sequence[Sequence[int]],
    cont: Sequence[Sequence[int]],
    *,
    store: KVStore | None = None,
    use_cache: bool = True,
    batch_size: int = 8,
    special_tokens: bool = True,
    prefix: TextOrIds | None = None,
    token_logprobs: bool = False,
    max_batch_tokens: int | None = None,
    progress: Progress | None = None,
    generation_context: GenerationContext | None = None,
    keep: Sequence[bool] | None = None,
) -> ScoreResult:
    """Score tokenized rows (each context at least 1 token, each continuation at least 1, both
    fitting the model's positions). ``keep[i]``: also store row ``i``'s context + continuation as
    a chain (cached path; the KV the scoring forward computed, nothing recomputed)."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    adapter.check_supported(store if use_cache else None)
    if use_cache and not adapter.layout.dense:
        raise ModelError(
            f"scoring from stored caches supports models whose every layer is full attention; {adapter.name} "
            f"({adapter.model.config.model_type}) has sliding-window, chunked or state layers: score it without the "
            "cache (use_cache=False / --no-cache)"
        )
    n = len(ctx)
    ctx = [list(map(int, c)) for c in ctx]
    cont = [list(map(int, y)) for y in cont]
    rows: list[ScoredRow | None] = [None] * n
    computed = 0
    if use_cache:
        computed = _score_cached(
            adapter, ctx, cont, rows, store, batch_size, special_tokens, prefix, token_logprobs, max_batch_tokens,
            progress, generation_context, keep or [False] * n,
        )  # fmt: skip
    else:
        computed = _score_reference(
            adapter, ctx, cont, rows, batch_size, token_logprobs, max_batch_tokens, progress, generation_context
        )
    done = [r for r in rows if r is not None]
    assert len(done) == n
    return ScoreResult(done, computed, sum(len(c) for c in ctx) - computed)


def _entered(generation_context: GenerationContext | None, model) -> AbstractContextManager:
    return generation_context(model) if generation_context is not None else nullcontext()


def _vocab(adapter: Adapter) -> int:
    out = adapter.model.get_output_embeddings()
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    return int(adapter.model.config.get_text_config(decoder=True).vocab_size)


def _groups(
    order: Sequence[int], keys: Sequence[str], sizes: Sequence[int], fed: Sequence[int], batch_size: int,
    max_batch_tokens: int | None, row_logits: int,
) -> Iterator[list[int]]:  # fmt: skip
    """Batches of rows in ``order`` (rows of one key consecutive) that keep a key's rows together
    whenever they fit in one batch: at most ``batch_size`` rows, ``max_batch_tokens`` padded tokens
    (rows x longest ``sizes``) and :data:`LOGITS_BYTES` of logits (rows x longest ``fed`` x
    ``row_logits`` bytes per fed token). A key with more rows than fit is split over batches."""
    runs: list[list[int]] = []
    for i in order:
        if runs and keys[runs[-1][0]] == keys[i]:
            runs[-1].append(i)
        else:
            runs.append([i])

    def fits(batch: list[int]) -> bool:
        if len(batch) > batch_size:
            return False
        if max_batch_tokens and max(sizes[j] for j in batch) * len(batch) > max_batch_tokens and len(batch) > 1:
            return False
        return len(batch) == 1 or max(fed[j] for j in batch) * len(batch) * row_logits <= LOGITS_BYTES

    batch: list[int] = []
    for run in runs:
        if batch and fits(batch + run):
            batch += run
            continue
        if batch:
            yield batch
            batch = []
        for i in run:
            if batch and not fits(batch + [i]):
                yield batch
                batch = []
            batch.append(i)
    if batch:
        yield batch


def _halving(run: Callable[[list[int]], None], batch: list[int], adapter: Adapter) -> None:
    """``run(batch)``; on an out-of-memory error, the same rows in two halves (scores do not depend
    on the batch), down to one row."""
    try:
        run(batch)
    except Exception as exc:
        if not is_out_of_memory(exc) or len(batch) == 1:
            raise
        del exc
        if adapter.device.type == "cuda":
            torch.cuda.empty_cache()
        _halving(run, batch[: len(batch) // 2], adapter)
        _halving(run, batch[len(batch) // 2 :], adapter)


def _gather(logits: torch.Tensor, targets: Sequence[int], per_token: bool) -> tuple[float, bool, tuple | None]:
    """``(sum of log-probs, greedy, per-token log-probs)`` of ``targets`` from ``logits`` ``[n, V]``."""
    ftype = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    lp = torch.log_softmax(logits.to(ftype), dim=-1)
    t = torch.as_tensor(list(targets), dtype=torch.long, device=lp.device)
    picked = lp.gather(-1, t[:, None])[:, 0]
    greedy = bool((lp.argmax(dim=-1) == t).all())
    tokens = tuple(picked.double().cpu().tolist()) if per_token else None
    return float(picked.double().sum()), greedy, tokens


@torch.inference_mode()
def _score_cached(
    adapter: Adapter, ctx, cont, rows: list, store: KVStore | None, batch_size: int, special_tokens: bool, prefix,
    token_logprobs: bool, max_batch_tokens: int | None, progress: Progress | None,
    generation_context: GenerationContext | None, keep: Sequence[bool],
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
    row_logits = _vocab(adapter) * 4
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
        cache = PreallocatedCache(pre.bufs, P)
        with _entered(generation_context, adapter.model):
            out = adapter.model(
                input_ids=input_ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                past_key_values=cache, use_cache=True, logits_to_keep=0,
            )  # fmt: skip
        for r, i in enumerate(batch):
            total, greedy, per_token = _gather(out.logits[r, : len(cont[i])], cont[i], token_logprobs)
            rows[i] = ScoredRow(total, greedy, len(cont[i]), per_token, pre.loaded[keys[i]])
        if writer is not None:
            _keep_rows(adapter, store, writer, batch, ctx, fed, pre.bufs, P, keep)
        del out, cache
        if progress:
            progress(B, sum(sizes[i] for i in batch))

    try:
        for batch in _groups(order, keys, sizes, [len(f) for f in fed], batch_size, max_batch_tokens, row_logits):
            _halving(run, batch, adapter)
    finally:
        if writer is not None:
            writer.close()
    return computed


def _keep_rows(adapter: Adapter, store, writer: Writer, batch, ctx, fed, bufs, P: int, keep) -> None:
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


@torch.inference_mode()
def _score_reference(
    adapter: Adapter, ctx, cont, rows: list, batch_size: int, token_logprobs: bool, max_batch_tokens: int | None,
    progress: Progress | None, generation_context: GenerationContext | None,
) -> int:  # fmt: skip
    n = len(ctx)
    seqs = [ctx[i] + cont[i][:-1] for i in range(n)]
    order = sorted(range(n), key=lambda i: (len(seqs[i]), i))
    sizes = [len(s) for s in seqs]
    row_logits = _vocab(adapter) * 4
    dev = adapter.device
    computed = 0

    def run(batch: list[int]) -> None:
        nonlocal computed
        B = len(batch)
        L = max(sizes[i] for i in batch)
        lo = min(len(ctx[i]) - 1 for i in batch)  # first position whose logits are needed
        input_ids = torch.full((B, L), adapter.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for r, i in enumerate(batch):
            input_ids[r, : sizes[i]] = torch.as_tensor(seqs[i], dtype=torch.long)
            mask[r, : sizes[i]] = 1
        with _entered(generation_context, adapter.model):
            out = adapter.model(
                input_ids=input_ids.to(dev), attention_mask=mask.to(dev),
                position_ids=torch.arange(L, device=dev).expand(B, L), use_cache=False, logits_to_keep=L - lo,
            )  # fmt: skip
        for r, i in enumerate(batch):
            a = len(ctx[i]) - 1 - lo
            total, greedy, per_token = _gather(out.logits[r, a : a + len(cont[i])], cont[i], token_logprobs)
            rows[i] = ScoredRow(total, greedy, len(cont[i]), per_token, 0)
        computed += sum(len(ctx[i]) for i in batch)
        del out
        if progress:
            progress(B, sum(sizes[i] for i in batch))

    for batch in _groups(order, [str(i) for i in range(n)], sizes, sizes, batch_size, max_batch_tokens, row_logits):
        _halving(run, batch, adapter)
    return computed


def score_rolling(
    adapter: Adapter,
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
) -> RollingResults:
    """See :meth:`kvstore.model.adapter.Adapter.score_rolling`."""
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
]
