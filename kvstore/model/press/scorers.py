"""How each built-in press scores a context's tokens (higher is kept).

Two kinds of scorer (:class:`kvstore.model.press.registry.PressMethod`):

* **per layer** (presses that read ``keys`` or a ``window``): ``scorer(inputs: LayerInputs) ->
  [kv_heads, c]`` for one row and layer, from the keys and values as the model cached them (after
  their rotary embedding) and, for window presses, the queries of the observation window (the
  context's last ``window`` tokens) or of the question (``:q``);
* **per row** (``context`` and ``replay`` presses): ``scorer(row: RowContext) -> per layer
  [kv_heads, c]``; the :class:`RowContext` runs the forwards they need (a re-run of the context's
  tokens, a replay of the context after a prompt) on top of the row's cache.

The formulas, and the kvpress 0.5.5 press each follows (defaults included; the registry's
records say the same in one line each):

* ``knorm``: ``-||k||``; ``keydiff``: ``-cos(k, a)``, ``a`` the mean unit key of the head;
* ``random``: uniform draws from a generator seeded with ``seed`` (0), the same draws for every
  layer (kvpress re-seeds per layer too);
* ``streaming_llm``: 1 on the first ``n_sink`` (4) tokens and on the most recent ones, 0 on the
  ``c - kept`` after the sinks (its scores depend on the ratio);
* ``snapkv``: the softmax attention (``1/sqrt(d)`` scaling, causal within the window, the softmax in
  float32, float64 for float64 models) of the last ``window`` (64) queries over the context,
  averaged over the window's queries, smoothed by an average pool of width ``kernel`` (5, zero
  padded), averaged over the query heads of each KV head; the window's own tokens score above every
  other token;
* ``tova``: the attention of the last token over the others averaged over every query head, the
  same for each KV head; the last token scores highest;
* ``expected_attention`` (ExpectedAttentionPress): the mean ``mu`` and covariance ``Sigma`` of the
  context's queries before their rotary embedding (tokens ``n_sink`` on; kvstore recovers them by
  undoing the rotation of the queries a re-run of those tokens computes), both rotated by the mean
  rotation of the next ``n_future_positions`` (512) positions; a token's score is the softmax over
  the context (sinks left out) of ``k.mu / sqrt(d) + k Sigma k / (2d)``, averaged over each KV
  head's query heads, times ``||v||`` (``(s + epsilon) ||v||``); the sinks score above every other
  token. Computed in the model's dtype, as kvpress does.

``kvzip`` (a replay) is :mod:`kvstore.model.press.kvzip`.

Question-aware (``:q``, window presses): the question's queries replace the observation window
(attention over the context and the question before each query, only the context's scored; no
token is protected).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from kvstore.errors import PressError
from kvstore.model.press.spec import Press

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.codecs.prerope import Rotary

# (layer, queries [heads, n, d], keys [kv_heads, S, d], values [kv_heads, S, d], module) during a forward
OnLayer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.nn.Module], None]


@dataclass(frozen=True)
class LayerInputs:
    """What a per-layer scorer reads, for one row and layer: ``keys`` and ``values`` ``[kv_heads, c,
    head_dim]`` of the row's ``c`` context tokens as cached; for window presses ``queries`` ``[heads,
    w, head_dim]`` (after the rotary embedding) of the observation window (the context's last ``w``
    tokens) or of the question, and with a question ``query_keys`` ``[kv_heads, w, head_dim]``, its
    own keys (None for a window: those are the context's last ``w``)."""

    press: Press
    layer: int
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None
    query_keys: torch.Tensor | None = None


class RowContext:
    """One row of a batch, dense, as a per-row scorer sees it: the press, the context's ids and
    length ``c``, each layer's cached keys and values, the model's rotary embedding and tokenizer,
    and :meth:`run`, a forward of extra tokens on top of the row's cache (counted as scoring
    tokens of ``kind``, never prefill; the cached values are never written)."""

    def __init__(self, press: Press, ids: Sequence[int], layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 runner: Callable[..., None], handle: Any):  # fmt: skip
        self.press = press
        self.ids = tuple(ids)
        self._layers = layers
        self._runner = runner
        self._handle = handle

    @property
    def c(self) -> int:
        return len(self.ids)

    @property
    def n_layers(self) -> int:
        return len(self._layers)

    def keys(self, layer: int) -> torch.Tensor:
        """``[kv_heads, c, head_dim]``, as cached (a view: do not write it)."""
        return self._layers[layer][0]

    def values(self, layer: int) -> torch.Tensor:
        return self._layers[layer][1]

    @property
    def model(self) -> torch.nn.Module:
        return self._handle.model

    @property
    def tokenizer(self) -> Any:
        return self._handle.tokenizer

    @property
    def dtype(self) -> torch.dtype:
        return self._handle.dtype

    @property
    def rotary(self) -> Rotary | None:
        return self._handle.rotary

    def run(self, ids: Sequence[int], start: int, on_layer: OnLayer, kind: str) -> None:
        """Run ``ids`` at positions ``start..`` on top of the row's first ``start`` cached tokens
        (``start <= c``; ``c``: after the whole context), calling ``on_layer`` at every layer with
        its queries and the keys and values it attends over (the ``start`` cached ones, then the new
        ones). ``kind`` names the count the tokens go to (``window``, ``context``, ``replay``)."""
        self._runner(ids, start, on_layer, kind)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16, torch.float32) else dtype


def observed_attention(inputs: LayerInputs) -> torch.Tensor:
    """``[heads, w, c']`` softmax attention of the observation's queries over the context's keys
    (and, for a question, its own keys), causal within the observed tokens; only the columns of
    context tokens outside a window are returned (``c' = c - w`` for a window, ``c`` for a question)."""
    q = inputs.queries
    assert q is not None
    keys = inputs.keys
    heads, w, d = q.shape
    ctx = keys.shape[1]
    all_keys = keys if inputs.query_keys is None else torch.cat([keys, inputs.query_keys], dim=1)
    groups = heads // all_keys.shape[0]
    k = all_keys.repeat_interleave(groups, dim=0).to(q.dtype)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # in the model's dtype, as kvpress computes it
    n = all_keys.shape[1]
    first = n - w  # observed token j sits at key index first + j and sees keys up to it
    cols = torch.arange(n, device=q.device)[None, :]
    rows = torch.arange(w, device=q.device)[:, None] + first
    logits = logits.masked_fill(cols > rows, -math.inf)
    attn = torch.softmax(logits, dim=-1, dtype=_work_dtype(q.dtype)).to(q.dtype)
    return attn[..., : ctx - (w if inputs.query_keys is None else 0)]


def _with_window(scores: torch.Tensor, c: int) -> torch.Tensor:
    """Scores of the observed context tokens followed by the window's own, above every other score."""
    n = scores.shape[-1]
    if n == c:
        return scores
    top = (scores.max() + 1) if n else torch.ones((), dtype=scores.dtype, device=scores.device)
    return torch.cat([scores, top.expand(scores.shape[0], c - n)], dim=-1)


def snapkv(inputs: LayerInputs) -> torch.Tensor:
    kv_heads, c, _ = inputs.keys.shape
    attn = observed_attention(inputs)  # [heads, w, c - w] (window) or [heads, w, c] (question)
    scores = attn.mean(dim=-2)
    kernel = int(inputs.press.param("kernel"))
    if scores.shape[-1]:
        scores = F.avg_pool1d(scores[:, None], kernel_size=kernel, padding=kernel // 2, stride=1)[:, 0]
    scores = scores.view(kv_heads, -1, scores.shape[-1]).mean(dim=1)
    return _with_window(scores, c)


def tova(inputs: LayerInputs) -> torch.Tensor:
    kv_heads, c, _ = inputs.keys.shape
    assert inputs.queries is not None
    last = LayerInputs(inputs.press, inputs.layer, inputs.keys, inputs.values, inputs.queries[:, -1:],
                       inputs.query_keys)  # fmt: skip
    attn = observed_attention(last)[:, -1]  # the last observed token's row
    scores = attn.mean(dim=0, keepdim=True).expand(kv_heads, -1)
    return _with_window(scores, c)


def knorm(inputs: LayerInputs) -> torch.Tensor:
    return -inputs.keys.norm(dim=-1)


def keydiff(inputs: LayerInputs) -> torch.Tensor:
    keys = inputs.keys
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=-2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


def random(inputs: LayerInputs) -> torch.Tensor:
    keys = inputs.keys
    gen = torch.Generator().manual_seed(int(inputs.press.param("seed")))
    return torch.rand((1, *keys.shape[:-1]), generator=gen, dtype=keys.dtype)[0].to(keys.device)


def streaming_llm(inputs: LayerInputs) -> torch.Tensor:
    kv_heads, c, _ = inputs.keys.shape
    scores = torch.ones((kv_heads, c), dtype=torch.float32, device=inputs.keys.device)
    sinks = int(inputs.press.param("n_sink"))
    scores[:, sinks : sinks + c - inputs.press.n_kept(c)] = 0
    return scores


# -- expected attention ----------------------------------------------------------------------------
def rotation_angles(rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[n, R]`` of the rotary embedding at ``positions``, computed as transformers'
    rotary modules compute them (float32, the ``R/2`` frequencies repeated for both halves), then
    cast to ``dtype``."""
    inv = torch.tensor(rotary.inv_freq, dtype=torch.float32, device=positions.device)
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def unrotate(queries: torch.Tensor, rotary: Rotary, positions: torch.Tensor) -> torch.Tensor:
    """``[heads, n, d]`` queries before their rotary embedding, from ``queries`` after it (at
    ``positions``): the inverse rotation of the first ``R`` channels, the others as they are."""
    R = rotary.dim
    cos, sin = rotation_angles(rotary, positions, queries.dtype)
    rot = queries[..., :R]
    back = rot * cos - _half(rot) * sin
    return torch.cat([back, queries[..., R:]], dim=-1)


def mean_rotation(rotary: Rotary, head_dim: int, first: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[d, d]``: the mean over positions ``first .. first + n - 1`` of the rotary embedding as a
    matrix (``x @ M.T`` rotates ``x``), the identity on channels past the rotary dimension."""
    R = rotary.dim
    cos, sin = rotation_angles(rotary, torch.arange(first, first + n, device=device), dtype)
    half = R // 2
    m = torch.zeros((n, head_dim, head_dim), dtype=dtype, device=device)
    idx = torch.arange(R, device=device)
    m[:, idx, idx] = cos
    lo = torch.arange(half, device=device)
    m[:, lo + half, lo] = sin[:, :half]  # x'[j + R/2] += x[j] sin
    m[:, lo, lo + half] = -sin[:, half:]  # x'[j] -= x[j + R/2] sin
    if R < head_dim:
        rest = torch.arange(R, head_dim, device=device)
        m[:, rest, rest] = 1
    return m.mean(dim=0)


def expected_attention(row: RowContext) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, c]`` ExpectedAttention scores of ``row`` (see the module docstring)."""
    press = row.press
    sinks, c = int(press.param("n_sink")), row.c
    rotary = row.rotary
    if rotary is None:
        raise PressError(
            f"press {press.name}: expected_attention needs the model's rotary embedding undone, and this model's "
            "cannot be (kvstore undoes the rotate-half RoPE of Llama-like and GPT-NeoX models)"
        )
    if c <= sinks:  # nothing after the sinks: every token is kept
        return [torch.ones((row.keys(i).shape[0], c), dtype=row.dtype, device=row.keys(i).device)
                for i in range(row.n_layers)]  # fmt: skip
    stats: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    covariance = bool(press.param("use_covariance"))

    def collect(layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, module) -> None:
        positions = torch.arange(sinks, c, device=queries.device)
        pre = unrotate(queries, rotary, positions)  # [heads, c - sinks, d]
        mu = pre.mean(dim=1, keepdim=True)
        cov = None
        if covariance:
            centered = pre - mu
            cov = torch.einsum("hsi,hsj->hij", centered, centered) / pre.shape[1]
        stats[layer] = (mu[:, 0], cov)

    row.run(row.ids[sinks:], sinks, collect, "context")
    out = []
    n_future = int(press.param("n_future_positions"))
    for i in range(row.n_layers):
        keys, values = row.keys(i)[:, sinks:], row.values(i)[:, sinks:]
        mu, cov = stats[i]
        d = keys.shape[-1]
        rot = mean_rotation(rotary, d, c, n_future, mu.dtype, mu.device)
        mu = mu @ rot.T
        groups = mu.shape[0] // keys.shape[0]
        k = keys.repeat_interleave(groups, dim=0).to(mu.dtype)  # [heads, c - sinks, d]
        logits = torch.einsum("hd,hnd->hn", mu, k) / math.sqrt(d)
        if cov is not None:
            cov = rot @ cov @ rot.T
            logits = logits + torch.einsum("hnd,hde,hne->hn", k, cov, k) / d / 2
        scores = torch.softmax(logits, dim=-1)
        scores = scores.view(keys.shape[0], groups, -1).mean(dim=1)
        if press.param("use_vnorm"):
            scores = (scores + float(press.param("epsilon"))) * values.norm(dim=-1).to(scores.dtype)
        top = scores.max() + 1
        out.append(torch.cat([top.expand(keys.shape[0], sinks), scores], dim=-1))
    return out


def record_shapes(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, int]]:
    """``(kv_heads, c)`` of each layer's ``(keys, values)`` ``[kv_heads, c, head_dim]``: the shape
    its scores must have."""
    return [(int(k.shape[0]), int(k.shape[1])) for k, _ in layers]


def check_scores(press: Press, scores: Sequence[torch.Tensor], shapes: Sequence[tuple[int, int]]) -> None:
    """PressError (one line, naming the spec) unless ``scores`` are one ``[kv_heads, c]`` tensor per
    layer, of the expected ``shapes``, floating point and free of NaN."""
    if len(scores) != len(shapes):
        raise PressError(f"press {press.name}: its scorer returned {len(scores)} layers of scores, not {len(shapes)}")
    for i, (s, shape) in enumerate(zip(scores, shapes)):
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != tuple(shape):
            got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise PressError(f"press {press.name}: its scorer returned scores of shape {got} at layer {i}, not "
                             f"[kv_heads, c] = {tuple(shape)}")  # fmt: skip
        if not s.is_floating_point() or bool(torch.isnan(s).any()):
            raise PressError(f"press {press.name}: its scorer returned {'NaN' if s.is_floating_point() else s.dtype} "
                             f"scores at layer {i}")  # fmt: skip


__all__ = [
    "LayerInputs",
    "OnLayer",
    "RowContext",
    "check_scores",
    "expected_attention",
    "keydiff",
    "knorm",
    "mean_rotation",
    "observed_attention",
    "random",
    "record_shapes",
    "rotation_angles",
    "snapkv",
    "streaming_llm",
    "tova",
    "unrotate",
]
