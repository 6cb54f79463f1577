"""The score stage: log-probabilities of continuations over a batch's contexts, under a variant.

A row is a context ``x`` of ``c`` tokens and a continuation ``y``. The log-probs of ``y[0]`` come
from the hidden state at the context's last position, which a KV cache does not hold, so the
context is read as ``x[:-1]`` (:func:`scored_contexts`: its last slot masked) and ``x[-1]`` is fed
again, followed by ``y[:-1]``: the fed tokens sit right-padded in the slots after the contexts, at
positions ``c - 1, c, ...``, and one forward gives logits at every fed slot (fed slot ``j``
predicts ``y[j]``). Fed pads come *after* each row's real tokens, so every query sees at least one
real key (a fully masked query row gives NaN under eager float64 attention, and NaN poisons real
rows through ``0 * NaN``). A press reads the same ``x[:-1]``, so what it keeps is what is scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import BatchCache, PreallocatedCache
from kvstore.model.io import chains
from kvstore.model.press.heads import per_head_masks
from kvstore.model.scoring.rows import gather_logprobs
from kvstore.model.variants import hooks
from kvstore.model.variants.variant import Variant

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.io.writer import Writer
    from kvstore.model.plan.batch import BatchPlan
    from kvstore.store.kvstore import KVStore

# per row: (sum of the continuation's log-probs, greedy, per-token log-probs or None)
RowScore = tuple[float, bool, tuple | None]


def scored_contexts(cache: BatchCache) -> BatchCache:
    """The contexts as scoring reads them: each row's ``x[:-1]`` (its last slot left out, and its
    position ``c - 1`` where the fed tokens start)."""
    return BatchCache(
        cache.bufs,
        tuple((a, b - 1) for a, b in cache.spans),
        tuple(c - 1 for c in cache.lengths),
        cache.first_free,
        tuple(ids[:-1] for ids in cache.ids),
    )


@torch.inference_mode()
def score_fed(
    handle: ModelHandle, cache: BatchCache, fed: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
    variant: Variant, token_logprobs: bool,
) -> list[RowScore]:  # fmt: skip
    """Feed ``fed[r]`` (``x[-1]`` then ``y[:-1]``, maybe ``y[-1]`` too) after row ``r``'s context
    in ``cache`` (as :func:`scored_contexts` gives it) under ``variant`` and score ``targets[r]``
    (``y``) from the logits at the fed slots. Writes only slots from ``cache.first_free`` on."""
    B = len(fed)
    P = cache.first_free
    q_len = [len(f) for f in fed]
    Q = max(q_len)
    mask = torch.zeros((B, P + Q), dtype=torch.long)
    pos = torch.empty((B, Q), dtype=torch.long)
    ids = torch.full((B, Q), handle.pad_id, dtype=torch.long)
    for r in range(B):
        (a, b), c, q = cache.spans[r], cache.lengths[r], q_len[r]
        mask[r, a:b] = 1
        mask[r, P : P + q] = 1
        pos[r] = c - 1 + q  # pads after the row: its last position again (masked, in range)
        pos[r, :q] = torch.arange(c, c + q)
        ids[r, :q] = torch.as_tensor(fed[r], dtype=torch.long)
    dev = handle.device
    with hooks.running(variant, handle.model), per_head_masks(handle.model, cache):
        out = handle.model(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
            **{handle.layout.cache_arg: PreallocatedCache(cache.bufs, cache.context_slots)}, use_cache=True,
            logits_to_keep=0,
        )  # fmt: skip
    return [gather_logprobs(out.logits[r, : len(targets[r])], targets[r], token_logprobs) for r in range(B)]


def keep_rows(
    handle: ModelHandle, store: KVStore, writer: Writer, plan: BatchPlan, cache: BatchCache, keep: Sequence[bool]
) -> None:
    """Store each kept row's context + fed tokens (``keep`` by caller row) as a chain, from the KV
    the scoring forward left in the batch's dense buffers (the context's slots but its last, then the
    fed slots); chains stored whole already are left alone."""
    P = cache.first_free
    for r, i in enumerate(plan.rows):
        if not keep[i]:
            continue
        ctx, fed = plan.contexts[r].ids, plan.fed[r]
        target = chains.chain_of(handle, ctx[:-1] + fed, store)
        if store.contains(target.key):
            continue
        c, q = len(ctx), len(fed)
        layers = tuple(
            (torch.cat([kb[r, :, P - c : P - 1], kb[r, :, P : P + q]], dim=1),
             torch.cat([vb[r, :, P - c : P - 1], vb[r, :, P : P + q]], dim=1))
            for kb, vb in cache.bufs
        )  # fmt: skip
        writer.put_chunks(handle, target, layers)


__all__ = ["RowScore", "keep_rows", "score_fed", "scored_contexts"]
