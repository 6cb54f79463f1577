"""Decode-time attention functions: exact top-k and SparQ, their specs, and plug-ins.

Each function has the transformers attention-function interface (what ``AttentionInterface``
holds; see ``transformers.integrations.sdpa_attention``)::

    fn(module, query, key, value, attention_mask, *, scaling, dropout=0.0, **kwargs)
        -> (attn_output [B, q, H, D], attn_weights or None)

``query`` is ``[B, H, q, D]``; ``key``/``value`` are ``[B, H_kv, S, D]`` with ``H_kv`` dividing
``H`` (grouped-query models: each KV head serves ``H / H_kv`` query heads); ``attention_mask`` is
what the model built for this implementation: :mod:`kvstore.model.variants.hooks` registers a mask
function that always gives a 4-D bool mask ``[B, 1, q, S]`` (True: may attend), but an additive
float mask (``0`` / very negative) and None (plain causal, no padding) are handled too.

Built-ins (:func:`parse` reads their specs):

* ``topk:K`` - per query and query head, the ``K`` keys with the highest exact scores among the
  ones the mask allows; softmax over those only. ``K`` at least the keys a query may see gives
  the dense result (the same keys, the same softmax).
* ``sparq:R:K`` - SparQ Attention (Ribar et al., arXiv 2312.04985): the ``R`` largest-magnitude
  components of each query approximate every score (softmax temperature
  ``sqrt(D * sum|q_R| / sum|q|)`` instead of ``sqrt(D)``), the ``K`` best keys by that estimate
  get exact attention, and the mean value over the allowed positions carries the estimated mass
  of the rest: ``out = alpha * out_K + (1 - alpha) * mean(v)``, ``alpha`` the estimated softmax
  mass of the chosen keys. This simulates the algorithm's arithmetic (which keys, which weights);
  it reads the whole cache, so it is not faster here: the paper's gain is memory traffic.

A masked position (a pad, a future slot) never enters a top-k and never counts in the mean.
Scores and softmax run in the query's dtype, in float32 for 16-bit models (as eager attention).

Plug-ins: any callable with the interface, or a ``module:function`` / ``module.function`` path
naming one (:func:`load_function`); ``dense`` is the model's own attention.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Any

import torch

from kvstore.errors import HookError

AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]
DENSE_NAME = "dense"

# kwargs the built-ins cannot honour: they change the scores in ways a plain softmax over q.k misses
_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "position_bias")


def allowed_keys(attention_mask: torch.Tensor | None, q: int, s: int, device: torch.device) -> torch.Tensor:
    """The ``[b, 1, q, s]`` bool "may attend" mask from what the model passed: a bool mask as
    is, an additive one where it is above half the dtype's most negative value, None as plain
    causal (the ``q`` queries are the last ``q`` of the ``s`` keys)."""
    if attention_mask is None:
        rows = torch.arange(q, device=device)[:, None] + (s - q)
        return (torch.arange(s, device=device)[None, :] <= rows)[None, None]
    mask = attention_mask[..., :s]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _bias(attention_mask: torch.Tensor | None, s: int) -> torch.Tensor | None:
    """An additive mask's finite part (e.g. a position bias), None for bool or no masks."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return None
    mask = attention_mask[..., :s]
    return torch.where(mask > torch.finfo(mask.dtype).min / 2, mask, torch.zeros((), dtype=mask.dtype))


def _grouped(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict):
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise HookError(f"decode attention does not support attention with {name} ({type(module).__name__})")
    groups = query.shape[1] // key.shape[1]
    if groups * key.shape[1] != query.shape[1]:
        raise HookError(f"{query.shape[1]} query heads do not group over {key.shape[1]} key/value heads")
    if groups > 1:  # each KV head serves `groups` consecutive query heads (transformers' repeat_kv order)
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    return query.to(work), key.to(work), value.to(work)


def top_keys(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Bool ``[..., S]``: per row the ``k`` highest ``scores`` among the ``allowed`` positions
    (all allowed ones when fewer). Masked positions are never chosen, whatever their score."""
    if k >= scores.shape[-1]:
        return allowed.expand(scores.shape)
    masked = scores.masked_fill(~allowed, -math.inf)
    idx = masked.topk(k, dim=-1).indices
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, idx, True)
    return chosen & allowed  # a row with fewer than k allowed keys picked some -inf ones: drop them


def _softmax_over(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax of ``logits`` over the ``keep`` positions (zeros elsewhere; an empty row is all
    zeros, as SDPA gives for a fully masked query, never NaN)."""
    w = torch.softmax(logits.masked_fill(~keep, -math.inf), dim=-1)
    return torch.nan_to_num(w, nan=0.0)


def _finish(out: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, None]:
    return out.to(dtype).transpose(1, 2).contiguous(), None


def topk_attention(k: int) -> AttentionFunction:
    """The ``topk:K`` attention function (see the module docstring)."""
    if k < 1:
        raise HookError(f"topk:{k}: K must be at least 1")

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q, keys, values = _grouped(module, query, key, value, kwargs)
        s = keys.shape[-2]
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        logits = (q @ keys.transpose(-1, -2)) * scale
        bias = _bias(attention_mask, s)
        if bias is not None:
            logits = logits + bias
        allowed = allowed_keys(attention_mask, q.shape[-2], s, q.device)
        w = _softmax_over(logits, top_keys(logits, allowed, k))
        return _finish(w @ values, query.dtype)

    attention.__qualname__ = attention.__name__ = f"topk_{k}"
    return attention


def sparq_attention(r: int, k: int) -> AttentionFunction:
    """The ``sparq:R:K`` attention function (see the module docstring)."""
    if r < 1 or k < 1:
        raise HookError(f"sparq:{r}:{k}: R and K must be at least 1")

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q, keys, values = _grouped(module, query, key, value, kwargs)
        d, s = q.shape[-1], keys.shape[-2]
        allowed = allowed_keys(attention_mask, q.shape[-2], s, q.device)
        bias = _bias(attention_mask, s)
        # step 1: the R largest-|q| components of each query, scores estimated from them alone
        if r < d:
            comp = q.abs().topk(r, dim=-1).indices
            q_r = torch.zeros_like(q).scatter_(-1, comp, q.gather(-1, comp))
        else:
            q_r = q
        l1 = q.abs().sum(-1, keepdim=True)
        temp = torch.sqrt(d * q_r.abs().sum(-1, keepdim=True) / l1.clamp_min(torch.finfo(q.dtype).tiny))
        approx = (q_r @ keys.transpose(-1, -2)) / temp.clamp_min(torch.finfo(q.dtype).tiny)
        if bias is not None:
            approx = approx + bias
        s_hat = _softmax_over(approx, allowed)
        # step 2: exact attention over the K keys the estimate ranks highest
        chosen = top_keys(approx, allowed, k)
        alpha = (s_hat * chosen).sum(-1, keepdim=True)
        scale = scaling if scaling is not None else d**-0.5
        exact = (q @ keys.transpose(-1, -2)) * scale
        if bias is not None:
            exact = exact + bias
        y = _softmax_over(exact, chosen) @ values
        # step 3: the mean value over each query's allowed positions carries the rest's mass
        valid = allowed.to(values.dtype).expand(*q.shape[:-1], s)
        mean_v = (valid @ values) / valid.sum(-1, keepdim=True).clamp_min(1)
        return _finish(alpha * y + (1 - alpha) * mean_v, query.dtype)

    attention.__qualname__ = attention.__name__ = f"sparq_{r}_{k}"
    return attention


# name -> factory taking the spec's integer arguments
ATTENTION_METHODS: dict[str, Callable[..., AttentionFunction]] = {"topk": topk_attention, "sparq": sparq_attention}
_ARITY = {"topk": 1, "sparq": 2}
_PATH = re.compile(r"^[A-Za-z_][\w.]*([:.])[A-Za-z_]\w*$")


def register_method(name: str, factory: Callable[..., AttentionFunction], arity: int) -> None:
    """Make ``name:A:B...`` a spec: ``factory(*ints)`` gives its attention function."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == DENSE_NAME:
        raise HookError(f"{name!r} is not a usable method name (lower-case letters, digits, _; not 'dense')")
    ATTENTION_METHODS[name] = factory
    _ARITY[name] = arity


def load_function(path: str) -> AttentionFunction:
    """The callable a ``module:function`` or ``module.function`` path names (HookError if it
    cannot be imported or is not callable)."""
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise HookError(
            f"decode attention {path!r}: cannot load it ({type(exc).__name__}: {exc}); give topk:K, sparq:R:K, "
            "dense or an importable module:function"
        ) from None
    if not callable(fn):
        raise HookError(f"decode attention {path!r} is not callable")
    return fn


def is_attention_spec(spec: str) -> bool:
    """Whether ``spec`` is meant as a decode attention: ``dense``, a method's name first, or a
    ``module:function`` path (it may still be a bad one: :func:`parse` says how)."""
    spec = spec.strip()
    return spec == DENSE_NAME or spec.partition(":")[0] in ATTENTION_METHODS or bool(_PATH.match(spec))


def parse(spec: str) -> AttentionFunction | None:
    """The attention function of a spec: ``dense`` (None: the model's own), ``topk:K``,
    ``sparq:R:K``, a method added with :func:`register_method`, or a plug-in path. HookError
    (one line) for anything else."""
    spec = spec.strip()
    if spec == DENSE_NAME:
        return None
    head, _, rest = spec.partition(":")
    if head in ATTENTION_METHODS:
        parts = rest.split(":") if rest else []
        if len(parts) != _ARITY[head] or not all(p.isascii() and p.isdigit() for p in parts):
            shape = ":".join(["N"] * _ARITY[head])
            raise HookError(
                f"decode attention {spec!r}: expected {head}:{shape} with positive integers in ASCII digits"
            )
        return ATTENTION_METHODS[head](*(int(p) for p in parts))
    if _PATH.match(spec):
        return load_function(spec)
    raise HookError(
        f"decode attention {spec!r} is not dense, topk:K, sparq:R:K or a module:function path "
        f"(methods: {', '.join(sorted(ATTENTION_METHODS))})"
    )


__all__ = [
    "DENSE_NAME",
    "is_attention_spec",
    "ATTENTION_METHODS",
    "AttentionFunction",
    "allowed_keys",
    "load_function",
    "parse",
    "register_method",
    "sparq_attention",
    "top_keys",
    "topk_attention",
]
