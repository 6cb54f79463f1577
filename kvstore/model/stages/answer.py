"""The answer stage: the question forward and the greedy loop over a batch's contexts, under a
variant; and the reference's dense in-memory prefill that feeds it without a store.

:func:`answer` takes a :class:`~kvstore.model.compute.cache.BatchCache` (contexts in slots before
``first_free``: left-padded from stored caches, right-padded by :func:`prefill_contexts`, or
pressed), puts the questions left-padded into the slots from ``first_free`` on at positions
``lengths[r] + j``, then the generated tokens, all under the variant's generation context and decode
attention (:func:`kvstore.model.variants.hooks.running`). Only slots from ``first_free`` on are
written, so a sweep answers every variant from the same buffers.

A question-aware press (``:q``) runs here: the question forward runs over the whole context with
its queries captured, the press keeps the context tokens those queries attend to, and decoding
continues over the kept tokens and the question (whose keys and values are never pruned). The
question forward and the scores it gives are shared by every ratio of the press (:class:`QuestionMemo`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import BatchCache, PreallocatedCache, new_buffers
from kvstore.model.compute.forward import DecodeSlots, Decoding, greedy_loop, right_padded
from kvstore.model.compute.static import StaticSteps, bucket_slots
from kvstore.model.press.heads import per_head_masks
from kvstore.model.press.prune import press_cache
from kvstore.model.press.select import PressMemo
from kvstore.model.press.window import capturing, record_queries
from kvstore.model.variants import hooks
from kvstore.model.variants.variant import Variant

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


@dataclass(frozen=True)
class Answer:
    """One variant's answers to a batch: ``tokens`` ``[B, new_tokens]`` int64, per-row step logits
    (or None), ``seconds`` spent (question forward and decode steps), and the context tokens each
    row answered over (``kept_tokens``) and the bytes of their keys and values."""

    tokens: torch.Tensor
    scores: list[torch.Tensor | None]
    seconds: float
    kept_tokens: tuple[int, ...]
    cache_bytes: int


@dataclass
class QuestionMemo:
    """A batch's question forwards over the whole context, shared by the ratios of a
    question-aware press: per (variant hooks, press method and parameters) the first logits, the
    question's keys and values, and the captured queries."""

    passes: dict[tuple, tuple[torch.Tensor, list, dict[int, torch.Tensor]]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Prompt:
    """The question forward's inputs for a batch: ids ``[B, Q]``, mask ``[B, slots]`` (contexts,
    real question tokens and every generated slot), positions ``[B, Q]`` and each row's next
    position, all on the device."""

    ids: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    next_pos: torch.Tensor
    Q: int


def _prompt(handle: ModelHandle, cache: BatchCache, questions: Sequence[Sequence[int]], decoding: Decoding) -> _Prompt:
    B = len(questions)
    q_len = [len(q) for q in questions]
    Q, P = max(q_len), cache.first_free
    if min(q_len) == 0:
        raise ValueError("every question needs at least one token")
    mask = torch.zeros((B, cache.slots), dtype=torch.long)
    pos = torch.empty((B, Q), dtype=torch.long)
    ids = torch.full((B, Q), handle.pad_id, dtype=torch.long)
    for r in range(B):
        (a, b), c, q = cache.spans[r], cache.lengths[r], q_len[r]
        mask[r, a:b] = 1
        mask[r, P + Q - q : P + Q] = 1
        pos[r] = c  # pad slots: any in-range position, they are masked
        pos[r, Q - q :] = torch.arange(c, c + q)
        ids[r, Q - q :] = torch.as_tensor(questions[r], dtype=torch.long)
    mask[:, P + Q : P + Q + decoding.new_tokens] = 1
    dev = handle.device
    next_pos = torch.tensor([c + q for c, q in zip(cache.lengths, q_len)], device=dev)
    return _Prompt(ids.to(dev), mask.to(dev), pos.to(dev), next_pos, Q)


def _loop(handle: ModelHandle, cache: BatchCache, prompt: _Prompt, logits: torch.Tensor, decoding: Decoding):
    first = cache.first_free + prompt.Q
    step = None
    if decoding.fixed:
        step = StaticSteps(
            handle, cache.bufs, prompt.mask, first, prompt.next_pos, compiled=decoding.steps == "compiled"
        )
    filled = [P + prompt.Q for P in cache.context_slots]
    slots = DecodeSlots(PreallocatedCache(cache.bufs, filled), prompt.mask, prompt.next_pos, first, step)
    return greedy_loop(handle, logits, slots, decoding)


@torch.inference_mode()
def answer(
    handle: ModelHandle, cache: BatchCache, questions: Sequence[Sequence[int]], decoding: Decoding, variant: Variant,
    memo: QuestionMemo | None = None,
) -> Answer:  # fmt: skip
    """Answer ``questions`` (one per row) over ``cache`` under ``variant`` (see the module
    docstring). Writes only slots from ``cache.first_free`` on."""
    if variant.press is not None and variant.press.question:
        return _answer_question_aware(handle, cache, questions, decoding, variant, memo or QuestionMemo())
    t0 = time.perf_counter()
    prompt = _prompt(handle, cache, questions, decoding)
    with hooks.running(variant, handle.model), per_head_masks(handle.model, cache):
        out = _question_forward(handle, cache, prompt)
        tokens, scores = _loop(handle, cache, prompt, out.logits[:, -1], decoding)
    return Answer(tokens, scores, time.perf_counter() - t0, cache.kept_tokens, cache.nbytes())


def _question_forward(handle: ModelHandle, cache: BatchCache, prompt: _Prompt):
    P = cache.first_free
    return handle.model(
        input_ids=prompt.ids,
        attention_mask=prompt.mask[:, : P + prompt.Q],
        position_ids=prompt.pos,
        **{handle.layout.cache_arg: PreallocatedCache(cache.bufs, cache.context_slots)},
        use_cache=True,
        logits_to_keep=1,
    )


def _answer_question_aware(
    handle: ModelHandle, cache: BatchCache, questions: Sequence[Sequence[int]], decoding: Decoding, variant: Variant,
    memo: QuestionMemo,
) -> Answer:  # fmt: skip
    assert variant.press is not None
    t0 = time.perf_counter()
    prompt = _prompt(handle, cache, questions, decoding)
    P, Q = cache.first_free, prompt.Q
    hooked = (variant.context, variant.decode_attention)
    key = (id(variant.context), variant.decode_attention, variant.press.scorer_key())
    if key not in memo.passes:  # the question over the whole context: shared by every ratio
        queries: dict[int, torch.Tensor] = {}
        with hooks.running(variant, handle.model), capturing(handle.model, record_queries(queries)):
            out = _question_forward(handle, cache, prompt)
        qkv = [(kb[:, :, P : P + Q].clone(), vb[:, :, P : P + Q].clone()) for kb, vb in cache.bufs]
        memo.passes[key] = (out.logits[:, -1], qkv, queries)
    first_logits, qkv, queries = memo.passes[key]
    del hooked
    q_len = [len(q) for q in questions]

    def observe(row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        q = q_len[row]
        return [(queries[i][row, :, Q - q :], qkv[i][0][row, :, Q - q :]) for i in range(len(cache.bufs))]

    context = BatchCache(cache.bufs, cache.spans, cache.lengths, P, cache.ids)
    kept = press_cache(handle, context, variant.press, PressMemo(), observe)
    for (kb, vb), (qk, qv), first in zip(kept.bufs, qkv, kept.context_slots):  # the question, never pruned
        kb[:, :, first : first + Q].copy_(qk)
        vb[:, :, first : first + Q].copy_(qv)
    prompt = _prompt(handle, kept, questions, decoding)
    with hooks.running(variant, handle.model), per_head_masks(handle.model, kept):
        tokens, scores = _loop(handle, kept, prompt, first_logits, decoding)
    return Answer(tokens, scores, time.perf_counter() - t0, kept.kept_tokens, kept.nbytes())


@torch.inference_mode()
def prefill_contexts(
    handle: ModelHandle, contexts: Sequence[Sequence[int]], tail: int, fixed_slots: bool
) -> BatchCache:
    """The reference's contexts: prefilled densely in memory (right-padded together, outside every
    hook), row ``r``'s context in slots ``0 .. c_r``, ``tail`` free slots after the longest (rounded
    up to a bucket for fixed-shape steps). Pad slots are zeroed like the cached layout's."""
    B = len(contexts)
    lengths = tuple(len(c) for c in contexts)
    L = max(lengths)
    dev = handle.device
    bufs = new_buffers(handle.kv_shapes(), B, bucket_slots(L + tail, fixed_slots), handle.dtype, dev)
    input_ids, mask = right_padded(handle.pad_id, contexts)
    handle.model(
        input_ids=input_ids.to(dev),
        attention_mask=mask.to(dev),
        position_ids=torch.arange(L, device=dev).expand(B, L),
        **{handle.layout.cache_arg: PreallocatedCache(bufs, 0)},
        use_cache=True,
        logits_to_keep=1,
    )
    for kb, vb in bufs:  # pad slots: masked, zeroed like the cached layout's
        for r, c in enumerate(lengths):
            kb[r, :, c:L].zero_()
            vb[r, :, c:L].zero_()
    return BatchCache(bufs, tuple((0, c) for c in lengths), lengths, L, tuple(tuple(c) for c in contexts))


__all__ = ["Answer", "QuestionMemo", "answer", "prefill_contexts"]
