"""How each press scores a context's tokens, and which it keeps.

Every scorer works on one row and one layer: ``keys`` ``[kv_heads, c, head_dim]`` of the row's
``c`` context tokens (as the model cached them, after its rotary embedding), and for the presses
that read queries, :class:`Observation` (queries of an observation window of the context's last
tokens, or of the question). It returns scores ``[kv_heads, c]``: higher is kept. :func:`kept`
then keeps the ``int(c * (1 - ratio))`` best of every head (ties broken by the lower position:
a stable sort), in position order.

The formulas, and the kvpress 0.5.5 press each follows (defaults included):

* ``knorm`` (KnormPress; Devoto et al. 2024, arXiv 2406.11430): ``-||k||``, the keys with the
  smallest norms are kept;
* ``streaming_llm`` (StreamingLLMPress; Xiao et al., arXiv 2309.17453): 1 on the first ``n_sink``
  (4) tokens and on the most recent ones, 0 on the ``c - kept`` tokens after the sinks;
* ``random`` (RandomPress): uniform draws from a generator seeded with ``seed`` (0), the same
  draws for every layer (kvpress re-seeds per layer too);
* ``keydiff`` (KeyDiffPress; arXiv 2504.15364): ``-cos(k, a)`` with ``a`` the mean of the unit
  keys of the head: keys least like the head's mean direction are kept;
* ``snapkv`` (SnapKVPress; Li et al., arXiv 2404.14469): the softmax attention (``1/sqrt(d)``
  scaling, causal within the window, the softmax in float32, float64 for float64 models) of the last ``window``
  (64) queries over the context, averaged over the window's queries, smoothed by an average pool
  of width ``kernel`` (5, zero padded), averaged over the query heads of each KV head (GQA); the
  window's own tokens score above every other token, so they are kept first;
* ``tova`` (TOVAPress; Oren et al., arXiv 2401.06104): the attention of the last token over the
  others averaged over every query head, the same for each KV head; the last token scores highest.

Question-aware (``:q``, ``snapkv`` and ``tova``): the question's queries replace the observation
window (attention over the context and the question before each query, only the context's scored;
no token is protected). Queries and keys differ per KV head, so heads keep different tokens, except
for ``tova``, ``streaming_llm`` and ``random`` (one choice for every head of a layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kvstore.model.press.spec import Press


@dataclass(frozen=True)
class Observation:
    """Queries that score a row's context at one layer: ``queries`` ``[heads, w, head_dim]`` of ``w``
    tokens; ``keys`` ``[kv_heads, w, head_dim]``: those tokens' own keys when they are not part of
    the context (the question's, with ``:q``), else None (the window: the context's last ``w``)."""

    queries: torch.Tensor
    keys: torch.Tensor | None = None


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16, torch.float32) else dtype


def observed_attention(obs: Observation, keys: torch.Tensor) -> torch.Tensor:
    """``[heads, w, c']`` softmax attention of the observation's queries over the context's keys
    (and, for a question, its own keys), causal within the observed tokens; only the columns of
    context tokens outside a window are returned (``c' = c - w`` for a window, ``c`` for a question)."""
    q = obs.queries
    heads, w, d = q.shape
    ctx = keys.shape[1]
    all_keys = keys if obs.keys is None else torch.cat([keys, obs.keys], dim=1)
    groups = heads // all_keys.shape[0]
    k = all_keys.repeat_interleave(groups, dim=0).to(q.dtype)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # in the model's dtype, as kvpress computes it
    n = all_keys.shape[1]
    first = n - w  # observed token j sits at key index first + j and sees keys up to it
    cols = torch.arange(n, device=q.device)[None, :]
    rows = torch.arange(w, device=q.device)[:, None] + first
    logits = logits.masked_fill(cols > rows, -math.inf)
    attn = torch.softmax(logits, dim=-1, dtype=_work_dtype(q.dtype)).to(q.dtype)
    return attn[..., : ctx - (w if obs.keys is None else 0)]


def _snapkv(press: Press, keys: torch.Tensor, obs: Observation | None) -> torch.Tensor:
    assert obs is not None
    kv_heads, c, _ = keys.shape
    attn = observed_attention(obs, keys)  # [heads, w, c - w] (window) or [heads, w, c] (question)
    scores = attn.mean(dim=-2)
    kernel = press.param("kernel")
    if scores.shape[-1]:
        scores = F.avg_pool1d(scores[:, None], kernel_size=kernel, padding=kernel // 2, stride=1)[:, 0]
    scores = scores.view(kv_heads, -1, scores.shape[-1]).mean(dim=1)
    return _with_window(scores, c)


def _tova(press: Press, keys: torch.Tensor, obs: Observation | None) -> torch.Tensor:
    assert obs is not None
    kv_heads, c, _ = keys.shape
    last = Observation(obs.queries[:, -1:], None if obs.keys is None else obs.keys)
    attn = observed_attention(last, keys)[:, -1]  # the last observed token's row
    scores = attn.mean(dim=0, keepdim=True).expand(kv_heads, -1)
    return _with_window(scores, c)


def _with_window(scores: torch.Tensor, c: int) -> torch.Tensor:
    """Scores of the observed context tokens followed by the window's own, above every other score."""
    n = scores.shape[-1]
    if n == c:
        return scores
    top = (scores.max() + 1) if n else torch.ones((), dtype=scores.dtype, device=scores.device)
    return torch.cat([scores, top.expand(scores.shape[0], c - n)], dim=-1)


def _knorm(press: Press, keys: torch.Tensor, obs: Observation | None) -> torch.Tensor:
    return -keys.norm(dim=-1)


def _keydiff(press: Press, keys: torch.Tensor, obs: Observation | None) -> torch.Tensor:
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=-2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


def _random(press: Press, keys: torch.Tensor, obs: Observation | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(press.param("seed"))
    return torch.rand((1, *keys.shape[:-1]), generator=gen, dtype=keys.dtype)[0].to(keys.device)


def _streaming_llm(press: Press, keys: torch.Tensor, obs: Observation | None) -> torch.Tensor:
    kv_heads, c, _ = keys.shape
    scores = torch.ones((kv_heads, c), dtype=torch.float32, device=keys.device)
    sinks = press.param("n_sink")
    scores[:, sinks : sinks + c - press.kept(c)] = 0
    return scores


SCORERS: dict[str, Callable[[Press, torch.Tensor, Observation | None], torch.Tensor]] = {
    "knorm": _knorm,
    "streaming_llm": _streaming_llm,
    "random": _random,
    "keydiff": _keydiff,
    "snapkv": _snapkv,
    "tova": _tova,
}
# scores that do not depend on the ratio, so every ratio of one method shares them
RATIO_FREE = frozenset(SCORERS) - {"streaming_llm"}


def score(press: Press, keys: torch.Tensor, obs: Observation | None = None) -> torch.Tensor:
    """``[kv_heads, c]`` scores of a row's context at one layer under ``press`` (higher: kept)."""
    return SCORERS[press.method](press, keys, obs)


def kept(scores: torch.Tensor, n_kept: int) -> torch.Tensor:
    """``[kv_heads, n_kept]`` int64 positions each head keeps: its ``n_kept`` highest ``scores``
    (ties: the lower position first), in increasing order."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :n_kept]
    return order.sort(dim=-1).values


__all__ = ["RATIO_FREE", "SCORERS", "Observation", "kept", "observed_attention", "score"]
