"""Answering a batch whose contexts are already in its KV buffers: the question forward and the
greedy loop, under a variant's generation context (:mod:`kvstore.model.variants.hooks`).

:func:`answer` is the second half of every dense decode (:mod:`kvstore.model.pipelines.sample`): the
contexts sit in slots before ``P`` (left-padded from stored caches, or right-padded by the
reference's own prefill, :func:`reference_split`), the questions go left-padded into the slots
from ``P`` on, then the generated tokens; only slots from ``P`` on are written, so a sweep runs
every variant over the same buffers. The generation context is entered around the question
forward and the decode steps, never around a prefill.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import Buffers, PreallocatedCache, new_buffers
from kvstore.model.compute.forward import Stop, greedy_loop, right_padded
from kvstore.model.compute.static import StaticSteps, bucket_slots
from kvstore.model.variants import hooks
from kvstore.model.variants.hooks import Variant

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def answer(adapter: ModelHandle, bufs: Buffers, spans: Sequence[tuple[int, int]], P: int, q_ids, N, stop: Stop,
            return_scores, variant: Variant):  # fmt: skip
    """Answer a batch whose row ``r`` has its context in slots ``spans[r]`` (all before ``P``):
    the questions left-padded into slots ``P .. P + Q``, then the greedy loop, all under
    ``variant``'s generation context. Writes only slots from ``P`` on. Returns ``(tokens, scores,
    seconds)``."""
    t0 = time.perf_counter()
    B = len(q_ids)
    q_len = [len(q) for q in q_ids]
    c_len = [b - a for a, b in spans]
    Q = max(q_len)
    T = P + Q + N
    dev = adapter.device
    cache = PreallocatedCache(bufs, P)
    mask = torch.zeros((B, T), dtype=torch.long)
    pos = torch.empty((B, Q), dtype=torch.long)
    input_ids = torch.full((B, Q), adapter.pad_id, dtype=torch.long)
    for r in range(B):
        (a, b), c, q = spans[r], c_len[r], q_len[r]
        mask[r, a:b] = 1
        mask[r, P + Q - q : P + Q] = 1
        pos[r] = c  # pad slots: any in-range position, they are masked
        pos[r, Q - q :] = torch.arange(c, c + q)
        input_ids[r, Q - q :] = torch.as_tensor(q_ids[r], dtype=torch.long)
    mask[:, P + Q :] = 1
    mask = mask.to(dev)
    next_pos = torch.tensor([c + q for c, q in zip(c_len, q_len)], device=dev)
    with hooks.running(variant, adapter.model):
        out = adapter.model(
            input_ids=input_ids.to(dev),
            attention_mask=mask[:, : P + Q],
            position_ids=pos.to(dev),
            **{adapter.layout.cache_arg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        step = fixed_steps(adapter, bufs, mask, P + Q, next_pos, stop)
        tokens, scores = greedy_loop(
            adapter, cache, mask, out.logits[:, -1], next_pos, P + Q, N, stop, return_scores, step
        )
    return tokens, scores, time.perf_counter() - t0


def fixed_steps(adapter: ModelHandle, bufs: Buffers, mask, first_slot: int, next_pos, stop: Stop) -> StaticSteps | None:
    """The fixed-shape step callback for ``greedy_loop`` (None: eager steps)."""
    if stop.steps == "dynamic":
        return None
    return StaticSteps(adapter, bufs, mask, first_slot, next_pos, compiled=stop.steps == "compiled")


@torch.inference_mode()
def reference_split(adapter: ModelHandle, c_ids, q_ids, N, stop: Stop, return_scores, variants: Sequence[Variant]):
    """The reference under generation contexts: the batch's contexts prefilled densely together
    (right-padded, outside every hook), then each variant answers on top of them
    (:func:`answer`). Returns ``(tokens, scores, seconds)`` per variant."""
    B = len(c_ids)
    c_len = [len(c) for c in c_ids]
    L, Q = max(c_len), max(len(q) for q in q_ids)
    if Q == 0:
        raise ValueError("every question needs at least one token")
    dev = adapter.device
    bufs = new_buffers(adapter.kv_shapes(), B, bucket_slots(L + Q + N, stop.steps != "dynamic"), adapter.dtype, dev)
    input_ids, mask = right_padded(adapter.pad_id, c_ids)
    adapter.model(
        input_ids=input_ids.to(dev),
        attention_mask=mask.to(dev),
        position_ids=torch.arange(L, device=dev).expand(B, L),
        **{adapter.layout.cache_arg: PreallocatedCache(bufs, 0)},
        use_cache=True,
        logits_to_keep=1,
    )
    for kb, vb in bufs:  # pad slots: masked, zeroed like the cached layout's
        for r, c in enumerate(c_len):
            kb[r, :, c:L].zero_()
            vb[r, :, c:L].zero_()
    spans = [(0, c) for c in c_len]
    return [answer(adapter, bufs, spans, L, q_ids, N, stop, return_scores, v) for v in variants]


__all__ = ["answer", "fixed_steps", "reference_split"]
