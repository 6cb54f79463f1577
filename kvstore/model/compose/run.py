"""Answers over composed contexts: the head's chain, each passage placed at its offset, a policy's
recompute, then the question (``compose="none"``, ``"last:N"``, ``"blend:R"``; ``"full"`` is the
no-cache reference, run by the Adapter on the composed ids).

Per batch of rows, each row's composed keys and values are assembled (the head loaded or computed
as an ordinary chain from position 0, each passage loaded or computed once per run at positions
``0..n-1`` and placed at its offset: :mod:`kvstore.model.compose.passages`), the policy recomputes
what it selects over them (:mod:`kvstore.model.compose.recompute`), and the rows are left-padded
into one batch's buffers and answered by the answer stage, as a stored context's rows are.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.errors import ComposeError
from kvstore.model.compose.passages import chain_kv, check_composable, passage_chain, place
from kvstore.model.compose.recompute import recompute
from kvstore.model.compose.rows import Composed, ComposedRow
from kvstore.model.compose.spec import Compose
from kvstore.model.compute.attention import uses_grouped_kv
from kvstore.model.compute.cache import BatchCache, LayerKV, new_buffers
from kvstore.model.compute.forward import batches, row_length
from kvstore.model.io.chains import chain_of
from kvstore.model.options import SampleOptions
from kvstore.model.pipelines.sample import SampleResult, check_sample, sample_variants, tokenize_rows
from kvstore.model.stages.answer import answer
from kvstore.model.variants.variant import DENSE, Variant
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


@dataclass
class _Parts:
    """What a run read and computed: chains' keys and values from position 0 by key (each distinct
    head and passage once per run), and the token counts a result reports."""

    kv: dict[str, LayerKV] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)
    computed: int = 0
    recomputed: int = 0

    def get(self, handle: ModelHandle, store: KVStore | None, chain, passage: bool) -> LayerKV:
        if chain.key not in self.kv:
            kv, hit = chain_kv(handle, store, chain, passage=passage)
            self.kv[chain.key] = kv
            if hit:
                self.loaded[chain.key] = chain.n_tokens
            else:
                self.computed += chain.n_tokens
        return self.kv[chain.key]


def assemble(handle: ModelHandle, row: ComposedRow, store: KVStore | None, parts: _Parts) -> tuple[LayerKV, int]:
    """A row's composed keys and values ``[kv_heads, n, head_dim]`` per layer before any recompute,
    and how many of its tokens came from the store."""
    rotary = check_composable(handle)
    pieces: list[LayerKV] = []
    cached = 0
    if row.head:
        chain = chain_of(handle, row.head, store)
        pieces.append(parts.get(handle, store, chain, False))
        cached += parts.loaded.get(chain.key, 0)
    for ids, offset in zip(row.passages, row.offsets):
        chain = passage_chain(handle, ids, store)
        pieces.append(place(parts.get(handle, store, chain, True), rotary, offset))
        cached += parts.loaded.get(chain.key, 0)
    layers = tuple(
        (torch.cat([p[i][0] for p in pieces], dim=1), torch.cat([p[i][1] for p in pieces], dim=1))
        for i in range(len(pieces[0]))
    )
    return layers, cached


@uses_grouped_kv
def compose_sample(
    handle: ModelHandle, rows: Sequence[ComposedRow], questions: Sequence[Sequence[int]], options: SampleOptions,
    store: KVStore | None, progress: Progress | None = None,
) -> SampleResult:  # fmt: skip
    """Greedy answers to ``questions[i]`` (ids) over row ``i``'s composition under
    ``options.compose`` (not ``full``: the Adapter answers that without a cache). Passages and heads
    are read from ``store`` (computed and stored where missing; in memory without a store)."""
    policy = options.compose
    assert isinstance(policy, Compose) and not policy.exact
    check_composable(handle)
    decoding = options.decoding()
    use_store = store if options.use_cache else None
    parts = _Parts()
    n, N = len(rows), decoding.new_tokens
    tokens = torch.full((n, N), handle.pad_id, dtype=torch.long)
    lengths, cached = [0] * n, [0] * n
    seconds = 0.0
    sizes = [len(r.ids) + len(q) + N for r, q in zip(rows, questions)]
    for batch in batches(list(range(n)), sizes, options.batch_size, options.max_batch_tokens):
        contexts = []
        for i in batch:
            layers, cached[i] = assemble(handle, rows[i], use_store, parts)
            layers, redone = recompute(handle, rows[i], layers, policy)
            parts.recomputed += redone
            contexts.append(layers)
        cache = _batch_cache(handle, contexts, [rows[i].ids for i in batch], max(len(questions[i]) for i in batch) + N)
        t0 = time.perf_counter()
        got = answer(handle, cache, [questions[i] for i in batch], decoding, DENSE)
        seconds += time.perf_counter() - t0
        for r, i in enumerate(batch):
            tokens[i] = got.tokens[r]
            lengths[i] = row_length(handle, got.tokens[r], decoding)
        if progress:
            progress(len(batch), sum(len(rows[i].ids) + len(questions[i]) for i in batch))
    total = sum(len(r.ids) for r in rows)
    return SampleResult(
        tokens=tokens,
        lengths=lengths,
        cache_hit=[use_store is not None and cached[i] == len(rows[i].ids) for i in range(n)],
        prefill_tokens_computed=parts.computed + parts.recomputed,
        prefill_tokens_saved=total - parts.computed - parts.recomputed,
        cached_tokens=cached,
        codecs=[use_store.codec.spec if use_store is not None else None] * n,
        decode_seconds=seconds,
        kept_tokens=[len(r.ids) for r in rows],
        compose=policy.name,
    )


def sample_composed(
    handle: ModelHandle, composed: Composed | None, options: SampleOptions, variants: Sequence[Variant],
    store: KVStore | None, labels: Sequence[str] | None = None, progress: Progress | None = None,
) -> SampleResult:  # fmt: skip
    """:meth:`Adapter.sample` of rows whose contexts are passages, under ``options.compose``:
    ``full`` is the no-cache reference on the composed ids (exact), the other policies
    :func:`compose_sample`. ComposeError (one line) for ``compose`` without passage rows, with a
    press, decode attention, generation context or sweep (composition answers densely), or with
    fixed-shape steps."""
    policy = options.compose
    assert isinstance(policy, Compose)  # parsed by SampleOptions
    if composed is None:
        raise ComposeError(f"compose={policy.name!r} is for contexts given as passages (a list of strings per row)")
    if len(variants) != 1 or variants[0].name != DENSE.name or variants[0].context is not None:
        raise ComposeError("a composed context is answered densely: no press, decode attention, hook or sweep")
    if options.steps != "dynamic":
        raise ComposeError("a composed context is answered with dynamic steps (steps='dynamic')")
    assert composed.questions is not None
    if policy.exact:
        reference = SampleOptions.of(options, use_cache=False, compose=None)
        path = check_sample(handle, reference, variants, None)
        rows = tokenize_rows(handle, composed.contexts, composed.questions, reference, None, composed.keying, labels)
        result = sample_variants(handle, rows, reference, variants, None, path, progress)[0]
        return dataclasses.replace(result, compose=policy.name)
    check_sample(handle, options, variants, store)
    check_composable(handle)
    questions = [handle.encode_question(q) for q in composed.questions]
    return compose_sample(handle, composed.rows, questions, options, store, progress)


def _batch_cache(
    handle: ModelHandle, contexts: Sequence[LayerKV], ids: Sequence[Sequence[int]], tail: int
) -> BatchCache:
    """The rows' composed keys and values left-padded (zero pads) into one batch's buffers, with
    ``tail`` free slots after them for the question and the answer."""
    lengths = tuple(c[0][0].shape[1] for c in contexts)
    P = max(lengths)
    bufs = new_buffers(handle.kv_shapes(), len(contexts), P + tail, handle.dtype, handle.device)
    for r, layers in enumerate(contexts):
        c = lengths[r]
        for (kb, vb), (k, v) in zip(bufs, layers):
            kb[r, :, : P - c].zero_()
            vb[r, :, : P - c].zero_()
            kb[r, :, P - c : P].copy_(k)
            vb[r, :, P - c : P].copy_(v)
    return BatchCache(bufs, tuple((P - c, P) for c in lengths), lengths, P, tuple(tuple(i) for i in ids))


__all__ = ["assemble", "compose_sample", "sample_composed"]
