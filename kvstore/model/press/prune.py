"""Pressing a batch's contexts: score every row's tokens, keep the best, gather them into new buffers.

:func:`press_cache` takes a :class:`~kvstore.model.compute.cache.BatchCache` whose rows hold whole
contexts and returns another whose buffers hold only the kept tokens: per row and layer, each KV
head's ``int(c * (1 - ratio))`` best tokens (:mod:`kvstore.model.press.scorers`), in position
order, left-padded to the batch's longest kept length (pads zero and masked). Every row keeps the
same count in every head, so one mask per row serves every head even where heads keep different
tokens. A kept token keeps the keys and values it was cached with (its rotary position included)
and its position: what follows continues at ``c``. The input buffers are never written (the window
forward's writes are undone), so every variant of a sweep presses the same dense cache.

A :class:`PressMemo` holds what one batch's presses share: the observation window's queries (one
short forward per distinct context and window size) and each method's scores (every ratio of a
method selects from the same scores), and counts the window tokens computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import BatchCache
from kvstore.model.press.scorers import RATIO_FREE, Observation, kept, score
from kvstore.model.press.spec import Press
from kvstore.model.press.window import window_queries

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

# per row, per layer: the observation that scores it (None: the press reads no queries)
Observations = Callable[[int], Sequence[Observation | None]]


@dataclass
class PressMemo:
    """What one batch's presses share (see the module docstring); ``window_tokens``: context tokens
    the window forwards ran (not prefill: the contexts were loaded or prefilled before)."""

    windows: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)
    scores: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)
    window_tokens: int = 0

    def window(self, handle: ModelHandle, cache: BatchCache, row: int, size: int) -> list[torch.Tensor]:
        key = (cache.ids[row], size)
        if key not in self.windows:
            self.windows[key] = window_queries(handle, cache, row, size)
            self.window_tokens += self.windows[key][0].shape[1] if self.windows[key] else 0
        return self.windows[key]


def row_scores(
    handle: ModelHandle, cache: BatchCache, press: Press, row: int, memo: PressMemo, observe: Observations | None
) -> list[torch.Tensor]:
    """Per layer, ``[kv_heads, c]`` scores of row ``row``'s context under ``press``."""
    a, b = cache.spans[row]
    shared = press.method in RATIO_FREE and observe is None
    key = (press.scorer_key(), cache.ids[row])
    if shared and key in memo.scores:
        return memo.scores[key]
    if observe is not None:
        obs: Sequence[Observation | None] = observe(row)
    elif press.needs_queries:
        queries = memo.window(handle, cache, row, press.window)
        obs = [Observation(q) for q in queries] if queries else [None] * len(cache.bufs)
    else:
        obs = [None] * len(cache.bufs)
    out = []
    for (kb, _), o in zip(cache.bufs, obs):
        keys = kb[row, :, a:b]
        if o is None and press.needs_queries:  # a one-token context: nothing observes it
            out.append(torch.zeros(keys.shape[:-1], dtype=keys.dtype, device=keys.device))
        else:
            out.append(score(press, keys, o))
    if shared:
        memo.scores[key] = out
    return out


@torch.inference_mode()
def press_cache(
    handle: ModelHandle, cache: BatchCache, press: Press, memo: PressMemo, observe: Observations | None = None
) -> BatchCache:
    """``cache`` with only the tokens ``press`` keeps (see the module docstring); ``cache`` itself
    when it keeps every token (a ratio of 0). ``observe(row)`` gives the queries of a
    question-aware press."""
    picks: list[list[torch.Tensor] | None] = []
    for r, (a, b) in enumerate(cache.spans):
        c = b - a
        n = press.kept(c)
        if n >= c:
            picks.append(None)
            continue
        picks.append([kept(s, n) for s in row_scores(handle, cache, press, r, memo, observe)])
    if all(p is None for p in picks):
        return cache
    return gather_kept(cache, picks)


def gather_kept(cache: BatchCache, picks: Sequence[Sequence[torch.Tensor] | None]) -> BatchCache:
    """New buffers holding, per row, the positions ``picks[r][layer]`` (``[kv_heads, n]``, relative
    to the row's span; None: all of them) left-padded to the longest; the free slots after the
    contexts as many as ``cache`` had."""
    counts = [b - a if p is None else int(p[0].shape[1]) for (a, b), p in zip(cache.spans, picks)]
    P = max(counts)
    slots = P + cache.slots - cache.first_free
    bufs = []
    for i, (kb, vb) in enumerate(cache.bufs):
        B, H, _, dk = kb.shape
        nk = kb.new_empty((B, H, slots, dk))
        nv = vb.new_empty((B, H, slots, vb.shape[-1]))
        for r, ((a, b), p) in enumerate(zip(cache.spans, picks)):
            n = counts[r]
            nk[r, :, : P - n].zero_()  # masked pads must be finite: 0 * NaN would still poison
            nv[r, :, : P - n].zero_()
            if p is None:
                nk[r, :, P - n : P].copy_(kb[r, :, a:b])
                nv[r, :, P - n : P].copy_(vb[r, :, a:b])
                continue
            idx = p[i].to(kb.device)
            nk[r, :, P - n : P].copy_(torch.gather(kb[r, :, a:b], 1, idx[..., None].expand(-1, -1, dk)))
            nv[r, :, P - n : P].copy_(torch.gather(vb[r, :, a:b], 1, idx[..., None].expand(-1, -1, vb.shape[-1])))
        bufs.append((nk, nv))
    spans = tuple((P - n, P) for n in counts)
    return BatchCache(bufs, spans, cache.lengths, P, cache.ids)


__all__ = ["Observations", "PressMemo", "gather_kept", "press_cache", "row_scores"]
