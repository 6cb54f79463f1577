"""Batched greedy decoding: from stored caches, and the reference without any cache.

Layouts (B rows; exactness depends on them):

* **Cached decode**: contexts are *left*-padded to the batch's longest ``P`` (pads are zero KV,
  masked), questions are left-padded to the longest ``Q`` and placed after the contexts, then
  ``N`` generated tokens follow: ``[pad | context_i | pad | question_i | new tokens]``. Explicit
  ``position_ids`` continue each row at its own context length (``c_i + j``); without them every
  row would continue at ``P``. The KV buffers are preallocated for ``P + Q + N`` slots, so no decode
  step copies the cache. Each distinct context's longest stored chain prefix is copied straight
  into its slots; what is missing is computed and written back: a whole context by a prefill, the
  rest of a partly stored one on top of its prefix (:func:`kvstore.model.plan.chains.extend`), so rows
  of one batch may hit at different depths.
* **Reference decode** (``use_cache=False``): context + question ids of each row right-padded in
  one sequence, the same preallocated cache, logits taken at each row's last real token.
  With a generation context (a hook, :mod:`kvstore.model.variants.hooks`) or several variants, the
  contexts are prefilled densely first (right-padded, outside any hook), then each variant answers
  on top of them as the cached decode does, so cached == no-cache under any hook.

**Variants** (a sweep): each batch's contexts are loaded (or computed and stored) once; then every
variant answers from the same buffers, its question and answer written into the slots after the
contexts (``P`` on), which each variant overwrites; the context slots are never written again.
A variant's generation context is entered around its question forward and decode steps only.

The two paths share :func:`greedy_loop` and differ in layout; the tests also compare both with
Hugging Face ``generate``, which shares nothing with them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.errors import ContextTooLongError
from kvstore.model.compute.attention import uses_grouped_kv
from kvstore.model.compute.cache import Buffers, PreallocatedCache, new_buffers
from kvstore.model.compute.forward import (
    Stop,
    batches,
    greedy_loop,
    is_out_of_memory,
    prefill,
    right_padded,
    row_length,
)
from kvstore.model.compute.staging import Staging
from kvstore.model.compute.static import bucket_slots
from kvstore.model.compute.writer import Writer
from kvstore.model.options import SampleOptions
from kvstore.model.plan import chains
from kvstore.model.stages.answer import answer, fixed_steps, reference_split
from kvstore.model.variants import hooks
from kvstore.model.variants.hooks import Variant
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
    ``variant``: the name of the variant that answered (``dense`` without a hook);
    ``decode_seconds``: time spent answering under it (question forwards and decode steps, every
    batch; loads and prefills are shared by the variants of a sweep and not counted).
    """

    tokens: torch.Tensor
    lengths: list[int]
    cache_hit: list[bool]
    scores: list[torch.Tensor] | None = None
    prefill_tokens_saved: int = 0
    prefill_tokens_computed: int = 0
    cached_tokens: list[int] = field(default_factory=list)
    codecs: list[str | None] = field(default_factory=list)
    variant: str = hooks.DENSE.name
    decode_seconds: float = 0.0


@uses_grouped_kv
def sample_variants(
    adapter: ModelHandle,
    contexts: Sequence[TextOrIds],
    questions: Sequence[TextOrIds],
    options: SampleOptions | None = None,
    *,
    variants: Sequence[Variant] = (hooks.DENSE,),
    store: KVStore | None = None,
    special_tokens: bool = True,
    prefix: TextOrIds | None = None,
    labels: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> list[SampleResult]:
    """Greedy answers (see :meth:`kvstore.model.adapter.Adapter.sample`) under each of
    ``variants`` (:class:`kvstore.model.variants.hooks.Variant`), from one load of each batch: one
    :class:`SampleResult` per variant, in order."""
    options = options if options is not None else SampleOptions()
    num_new_tokens, use_cache, batch_size, max_batch_tokens = (
        options.num_new_tokens, options.use_cache, options.batch_size, options.max_batch_tokens
    )  # fmt: skip
    truncate, max_context_tokens, return_scores, steps = (
        options.truncate, options.max_context_tokens, options.return_scores, options.steps
    )  # fmt: skip
    variants = list(variants)
    if not variants:
        raise ValueError("no variant to answer with")
    hooked = any(not v.dense for v in variants)
    split = hooked or len(variants) > 1  # the reference prefills contexts apart from the answers
    hooks.check_steps(variants, steps)
    stop = Stop(options.stop_at_eos, tuple(s for s in options.stop_strings if s), steps)
    if steps != "dynamic" and not adapter.path.supports("compile"):
        raise ValueError(
            f"compiled decoding supports models whose every layer is full attention; {adapter.name} has "
            "sliding-window, chunked or state layers (decode it without compile)"
        )
    if len(contexts) != len(questions):
        raise ValueError(f"{len(contexts)} contexts but {len(questions)} questions")
    adapter.check_supported(store if use_cache else None)
    hooks.check_model(adapter, split)
    q_ids = [adapter.encode_question(q) for q in questions]
    c_ids = [
        adapter.context_ids(c, special_tokens=special_tokens, truncate=truncate, max_context_tokens=max_context_tokens,
                            label=adapter.row_label(labels, i))
        for i, c in enumerate(contexts)
    ]  # fmt: skip
    n = len(c_ids)
    if adapter.max_positions:
        for i in range(n):
            if len(c_ids[i]) + len(q_ids[i]) + num_new_tokens > adapter.max_positions:
                raise ContextTooLongError(
                    f"{adapter.row_label(labels, i)}: context ({len(c_ids[i])}) + question ({len(q_ids[i])}) + "
                    f"{num_new_tokens} new tokens exceed the model's {adapter.max_positions} positions; use a shorter "
                    "question, fewer new tokens or a lower max_context_tokens"
                )
    V = len(variants)
    out = [torch.full((n, num_new_tokens), adapter.pad_id, dtype=torch.long) for _ in range(V)]
    lengths = [[0] * n for _ in range(V)]
    cached = [0] * n
    codecs: list[str | None] = [None] * n
    scores: list[list[torch.Tensor]] | None = [[torch.empty(0)] * n for _ in range(V)] if return_scores else None
    seconds = [0.0] * V
    computed = 0
    plans = [adapter.plan(c, store, prefix=prefix, special_tokens=special_tokens) for c in c_ids] if use_cache else []
    keys = [p.key for p in plans] if use_cache else [""] * n
    # cluster rows of equal contexts, then by length, to share loads and waste little padding
    order = sorted(range(n), key=lambda i: (len(c_ids[i]), keys[i], i))
    writer = Writer(store, None) if (use_cache and store is not None and not store.readonly) else None

    def run(rows: list[int], box: list[Loaded | None] | None = None) -> None:
        nonlocal computed
        ahead = box.pop() if box else None  # the only reference: freed here on an out-of-memory retry
        try:
            if use_cache:
                answers, row_cached, row_computed, row_codecs = decode_cached(
                    adapter, [plans[i] for i in rows], [q_ids[i] for i in rows], num_new_tokens, store, writer,
                    stop, return_scores, variants, ahead,
                )  # fmt: skip
            elif split:
                answers = reference_split(
                    adapter, [c_ids[i] for i in rows], [q_ids[i] for i in rows], num_new_tokens, stop, return_scores,
                    variants,
                )  # fmt: skip
            else:
                t0 = time.perf_counter()
                tokens, step_scores = decode_reference(
                    adapter, [c_ids[i] + q_ids[i] for i in rows], num_new_tokens, stop, return_scores
                )
                answers = [(tokens, step_scores, time.perf_counter() - t0)]
        except Exception as exc:
            if not is_out_of_memory(exc) or len(rows) == 1:
                raise
            # out of memory: the same rows in two halves (answers do not depend on the batch)
            del exc, ahead
            if adapter.device.type == "cuda":
                torch.cuda.empty_cache()
            run(rows[: len(rows) // 2])
            run(rows[len(rows) // 2 :])
            return
        if use_cache:
            for i, got, spec in zip(rows, row_cached, row_codecs):
                cached[i] = got
                codecs[i] = spec
            computed += row_computed
        else:
            computed += sum(len(c_ids[i]) for i in rows)
        for v, (tokens, step_scores, secs) in enumerate(answers):
            seconds[v] += secs
            for j, i in enumerate(rows):
                out[v][i] = tokens[j]
                lengths[v][i] = row_length(adapter, tokens[j], stop)
                if scores is not None:
                    scores[v][i] = step_scores[j]
        if progress:
            progress(len(rows), sum(len(c_ids[i]) + len(q_ids[i]) for i in rows))

    sizes = [len(c_ids[i]) + len(q_ids[i]) + num_new_tokens for i in range(n)]
    todo = list(batches(order, sizes, batch_size, max_batch_tokens))
    # the next batch's stored prefixes load on a worker while this batch decodes
    overlap = (
        options.load_ahead and use_cache and store is not None and adapter.path.supports("load_ahead") and len(todo) > 1
    )
    loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load") if overlap else None

    def load_ahead(rows: list[int]) -> Future[Loaded] | None:
        if loader is None:
            return None
        return loader.submit(load_batch, adapter, [plans[i] for i in rows], [q_ids[i] for i in rows],
                             num_new_tokens, store, stop)  # fmt: skip

    try:
        pending = load_ahead(todo[0]) if todo else None
        for b, rows in enumerate(todo):
            if use_cache and store is not None and b + 1 < len(todo):  # a remote store fetches ahead
                store.prefetch(k for i in todo[b + 1] for k in plans[i].keys)
            box = [_result(pending)]
            pending = load_ahead(todo[b + 1]) if b + 1 < len(todo) else None
            run(rows, box)
    finally:
        if loader is not None:
            loader.shutdown(wait=True, cancel_futures=True)
        if writer is not None:
            writer.close()
    hits = [use_cache and cached[i] == len(c_ids[i]) for i in range(n)]
    saved = sum(len(c) for c in c_ids) - computed
    return [
        SampleResult(out[v], lengths[v], hits, scores[v] if scores is not None else None, saved, computed, cached,
                     codecs, variants[v].name, seconds[v])
        for v in range(V)
    ]  # fmt: skip


def _result(pending: Future[Loaded] | None) -> Loaded | None:
    """A batch loaded ahead, or None when there is none or it ran out of memory (the batch then
    loads itself, and halves on its own out-of-memory error)."""
    if pending is None:
        return None
    try:
        return pending.result()
    except Exception as exc:
        if is_out_of_memory(exc):
            return None
        raise


@dataclass
class Loaded:
    """A batch's stored prefixes, loaded ahead (:func:`load_batch`): the KV buffers, rows per
    distinct context key, context tokens loaded and codec specs per key."""

    bufs: Buffers
    rows_of: dict[str, list[int]]
    loaded: dict[str, int]
    codecs: dict[str, list[str]]


@torch.inference_mode()
def load_batch(adapter: ModelHandle, plans, q_ids, N, store, stop: Stop) -> Loaded:
    """Allocate a batch's KV buffers and copy each distinct context's longest stored prefix into
    its row (the first half of :func:`decode_cached`; ``sample`` runs it for the next batch on a
    worker while the current batch decodes)."""
    B = len(plans)
    c_len = [p.n_tokens for p in plans]
    P, Q = max(c_len), max(len(q) for q in q_ids)
    T = P + Q + N
    dev = adapter.device
    bufs = new_buffers(adapter.kv_shapes(), B, bucket_slots(T, stop.steps != "dynamic"), adapter.dtype, dev)
    rows_of: dict[str, list[int]] = {}
    for r, p in enumerate(plans):
        rows_of.setdefault(p.key, []).append(r)
    loaded: dict[str, int] = {}
    codecs: dict[str, list[str]] = {k: [] for k in rows_of}
    staging = Staging(dev)  # accelerator buffers: pinned host tensors, copies on a side stream
    for k, rs in rows_of.items():
        r0, c = rs[0], c_len[rs[0]]
        if store is not None:
            loaded[k] = chains.load_prefix(adapter, store, plans[r0], bufs, r0, P - c, codecs[k], staging)
        else:
            loaded[k] = 0
    staging.finish()
    return Loaded(bufs, rows_of, loaded, codecs)


@torch.inference_mode()
def decode_cached(adapter: ModelHandle, plans, q_ids, N, store, writer, stop: Stop, return_scores,
                  variants: Sequence[Variant] = (hooks.DENSE,), ahead: Loaded | None = None):  # fmt: skip
    """One batch from stored caches, the way the model's cache path answers
    (:mod:`kvstore.model.paths.base`). Returns ``(answers, cached tokens per row, context tokens
    computed, codec labels per row)``, ``answers`` holding ``(tokens, scores, seconds)`` per
    variant. ``ahead``: this batch's :func:`load_batch`, done already (dense models)."""
    return adapter.path.decode_cached(adapter, plans, q_ids, N, store, writer, stop, return_scores, variants, ahead)


def decode_cached_dense(adapter: ModelHandle, plans, q_ids, N, store, writer, stop: Stop, return_scores,
                        variants: Sequence[Variant] = (hooks.DENSE,), ahead: Loaded | None = None):  # fmt: skip
    """:func:`decode_cached` for full-attention models (see the module docstring)."""
    c_len = [p.n_tokens for p in plans]
    P, Q = max(c_len), max(len(q) for q in q_ids)
    if Q == 0:
        raise ValueError("every question needs at least one token")
    pre = ahead if ahead is not None else load_batch(adapter, plans, q_ids, N, store, stop)
    computed = complete(adapter, plans, pre, store, writer)
    spans = [(P - c, P) for c in c_len]
    answers = [answer(adapter, pre.bufs, spans, P, q_ids, N, stop, return_scores, v) for v in variants]
    return answers, [pre.loaded[p.key] for p in plans], computed, [codec_label(pre.codecs[p.key]) for p in plans]


def complete(adapter: ModelHandle, plans, pre: Loaded, store, writer) -> int:
    """The second half of loading a batch: compute what :func:`load_batch` did not find (a whole
    context by a prefill, the rest of a partly stored one on top of its prefix), write it into its
    row and hand it to ``writer``; then zero the pad slots and copy each context into the other
    rows sharing it. Returns the context tokens computed."""
    c_len = [p.n_tokens for p in plans]
    P = max(c_len)
    bufs, rows_of, loaded, codecs = pre.bufs, pre.rows_of, pre.loaded, pre.codecs
    lossy = store is not None and not store.codec.lossless
    missing = [k for k in rows_of if loaded[k] == 0]
    if missing:
        computed_rows = prefill(adapter, [plans[rows_of[k][0]].ids for k in missing])
        for k, layers in zip(missing, computed_rows):
            r0, c = rows_of[k][0], c_len[rows_of[k][0]]
            if lossy:  # answer from the values the stored codes give back, as every later run will
                chains.store_and_reload(adapter, store, plans[r0], layers, bufs, r0, P - c, 0, writer)
            else:
                for (kb, vb), (kl, vl) in zip(bufs, layers):
                    kb[r0, :, P - c : P].copy_(kl)
                    vb[r0, :, P - c : P].copy_(vl)
                if writer is not None:
                    writer.put_chunks(adapter, plans[r0], layers)
            if store is not None:
                codecs[k].append(store.codec.spec)
    partial = [k for k in rows_of if 0 < loaded[k] < c_len[rows_of[k][0]]]
    if partial:
        heads = [rows_of[k][0] for k in partial]
        spans = [(P - c_len[r0], P - c_len[r0] + loaded[k]) for k, r0 in zip(partial, heads)]
        prefixes = [tuple((kb[r0, :, a:b], vb[r0, :, a:b]) for kb, vb in bufs) for r0, (a, b) in zip(heads, spans)]
        rests = chains.extend(adapter, prefixes, [plans[r0].ids[loaded[k] :] for k, r0 in zip(partial, heads)])
        for k, r0, layers in zip(partial, heads, rests):
            start = P - c_len[r0] + loaded[k]
            depth = plans[r0].depth_of(loaded[k])
            if lossy:
                chains.store_and_reload(adapter, store, plans[r0], layers, bufs, r0, P - c_len[r0], depth, writer)
            else:
                for (kb, vb), (kl, vl) in zip(bufs, layers):
                    kb[r0, :, start:P].copy_(kl)
                    vb[r0, :, start:P].copy_(vl)
                if writer is not None:
                    writer.put_chunks(adapter, plans[r0], layers, depth, loaded[k])
            codecs[k].append(store.codec.spec)
    _fill_pads_and_repeats(bufs, rows_of, c_len, P)
    return sum(c_len[rows_of[k][0]] - loaded[k] for k in rows_of)


def codec_label(specs: Sequence[str]) -> str | None:
    """The codec spec of the entries a row's context came from (their distinct specs joined by
    ``,`` when its chunks differ; None without a store)."""
    return ",".join(dict.fromkeys(specs)) or None


def _fill_pads_and_repeats(bufs: Buffers, rows_of: dict[str, list[int]], c_len: Sequence[int], P: int) -> None:
    """Zero each row's pad slots (masked, but ``0 * NaN`` would still poison) and copy a context
    loaded once into the other rows that share it."""
    for rs in rows_of.values():
        r0, c = rs[0], c_len[rs[0]]
        for kb, vb in bufs:
            kb[r0, :, : P - c].zero_()
            vb[r0, :, : P - c].zero_()
            for r in rs[1:]:
                kb[r, :, :P].copy_(kb[r0, :, :P])
                vb[r, :, :P].copy_(vb[r0, :, :P])


@torch.inference_mode()
def decode_reference(adapter: ModelHandle, full_ids, N, stop: Stop, return_scores):
    """Each row's context and question through the model together (no cache), then ``N`` greedy
    steps, the way the model's cache path lays rows out. Returns ``(tokens, scores)``."""
    return adapter.path.decode_reference(adapter, full_ids, N, stop, return_scores)


@torch.inference_mode()
def decode_reference_dense(adapter: ModelHandle, full_ids, N, stop: Stop, return_scores):
    """:func:`decode_reference` for full-attention models."""
    B = len(full_ids)
    lens = [len(x) for x in full_ids]
    L = max(lens)
    T = L + N
    dev = adapter.device
    bufs = new_buffers(adapter.kv_shapes(), B, bucket_slots(T, stop.steps != "dynamic"), adapter.dtype, dev)
    for kb, vb in bufs:
        kb.zero_()
        vb.zero_()
    cache = PreallocatedCache(bufs, 0)
    input_ids, mask = right_padded(adapter.pad_id, full_ids, T)
    mask[:, L:] = 1
    mask = mask.to(dev)
    out = adapter.model(
        input_ids=input_ids.to(dev),
        attention_mask=mask[:, :L],
        position_ids=torch.arange(L, device=dev).expand(B, L),
        **{adapter.layout.cache_arg: cache},
        use_cache=True,
        logits_to_keep=torch.tensor([[n - 1] for n in lens], device=dev),
    )
    next_pos = torch.tensor(lens, device=dev)
    step = fixed_steps(adapter, bufs, mask, L, next_pos, stop)
    return greedy_loop(adapter, cache, mask, out.logits[:, -1], next_pos, L, N, stop, return_scores, step)


__all__ = [
    "Loaded",
    "SampleResult",
    "Stop",
    "complete",
    "is_out_of_memory",
    "decode_cached",
    "decode_reference",
    "greedy_loop",
    "load_batch",
    "sample_variants",
    "row_length",
]
