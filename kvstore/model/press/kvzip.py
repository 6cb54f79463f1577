"""KVzip: scores from a replay of the context (query-agnostic, one forward pass per chunk).

KVzip (Kim et al. 2025, arXiv 2505.23416; kvpress's ``KVzipPress``) asks the model to repeat the
context it has cached and keeps the cached tokens that the repetition attends to most. For a row
whose context has ``c`` tokens, the first ``p`` of which are the chat template's opening (the
text before the user's message, when the context starts with it; else ``p = 0``), the context
after it is cut into chunks of ``chunk`` (2048) tokens; chunk ``i`` is replayed as the ids of

* ``"\\n\\nRepeat the previous context exactly."`` for the first chunk, or
  ``"\\n\\nRepeat the part of the previous context exactly, starting with"`` followed by the last 8
  ids of the chunk before;
* the chat template's text after a user message (its end-of-turn and the assistant's header;
  ``"\\n"`` for a tokenizer without a chat template);
* the chunk's own ids (teacher-forced),

in one forward at positions ``c, c + 1, ...`` on top of the whole cached context (so each chunk's
replay sees the context and itself, causally), computed as scoring tokens, never prefill; the
cache is not written. At every layer, each replay query's softmax attention (``1/sqrt(d)`` scaling,
in the model's dtype) over only the first ``min(n_sink, start)`` context tokens, the chunk's
tokens and the replay's own (causal) gives each chunk token a weight; its score is the largest
weight over the replay's queries and the query heads of its KV head. With ``plus`` (KVzip+), a
weight is first divided by the norm of the query's hidden state entering the attention and
multiplied by ``||W_o v||`` of the key's value for that query head. Tokens of the template's
opening after the sinks score 0; the first ``n_sink`` (4) tokens score above everything.

The budget (:mod:`kvstore.model.press.select`) then keeps the best scores over every layer and head
together (``global``, the default: ``int(L H c ratio)`` pairs dropped), per layer (``layer``), or
any other budget. The scores do not depend on the ratio: a sweep of ratios runs the replay once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.errors import PressError
from kvstore.model.press.scorers import RowContext

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # ids of the previous chunk that the next chunk's prompt repeats
_DUMMY = "dummy context"


def template_parts(tokenizer: Any) -> tuple[list[int], list[int]]:
    """``(opening ids, suffix ids)`` of ``tokenizer``'s chat template around one user message
    (without special tokens added), found by rendering a dummy message as kvpress does; ``([],
    ids of "\\n")`` without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return [], list(tokenizer.encode("\n", add_special_tokens=False))
    separator = "\n" + "#" * len(_DUMMY)
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _DUMMY + separator}], add_generation_prompt=True, tokenize=False,
            enable_thinking=False,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - jinja errors of third-party templates
        raise PressError(f"press kvzip: the chat template failed to render ({type(exc).__name__})") from None
    head, _, suffix = rendered.partition(separator)
    opening = head.split(_DUMMY)[0]
    return (list(tokenizer.encode(opening, add_special_tokens=False)),
            list(tokenizer.encode(suffix, add_special_tokens=False)))  # fmt: skip


def replays(tokenizer: Any, ids: Sequence[int], chunk: int) -> tuple[int, list[tuple[int, int, list[int]]]]:
    """``(p, [(start, end, replay ids), ...])``: the opening's length in ``ids`` and, per chunk of
    the context after it, its span and the ids replayed for it (see the module docstring)."""
    opening, suffix = template_parts(tokenizer)
    p = len(opening) if opening and list(ids[: len(opening)]) == opening and len(opening) < len(ids) else 0
    first = list(tokenizer.encode(FIRST_PROMPT, add_special_tokens=False))
    nxt = list(tokenizer.encode(NEXT_PROMPT, add_special_tokens=False))
    out = []
    body = list(ids[p:])
    for i, a in enumerate(range(0, len(body), chunk)):
        piece = body[a : a + chunk]
        prompt = first if i == 0 else nxt + body[max(0, a - OVERLAP) : a]
        out.append((p + a, p + a + len(piece), prompt + suffix + piece))
    return p, out


def kvzip_scores(row: RowContext) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, c]`` KVzip scores of ``row`` (see the module docstring)."""
    press = row.press
    c, sinks = row.c, int(press.param("n_sink"))
    plus = bool(press.param("plus"))
    _, chunks = replays(row.tokenizer, row.ids, int(press.param("chunk")))
    first_keys = row.keys(0)
    scores = [torch.zeros((row.keys(i).shape[0], c), dtype=first_keys.dtype, device=first_keys.device)
              for i in range(row.n_layers)]  # fmt: skip
    norms: dict[int, torch.Tensor] = {}
    for start, end, replay in chunks:
        on_layer = _chunk_scorer(scores, norms if plus else None, start, end, min(sinks, start), len(replay))
        hooks = _hidden_norms(row.model, norms) if plus else []
        try:
            row.run(replay, c, on_layer, "replay")
        finally:
            for h in hooks:
                h.remove()
    top = max(float(s.max()) for s in scores) + 1.0
    for s in scores:
        s[:, :sinks] = top  # the sinks are never evicted
    return scores


QUERY_BLOCK = 64  # replay queries scored at a time: a block's weights stay in the CPU's caches (a few MB)


def _chunk_scorer(
    scores: list[torch.Tensor], norms: dict[int, torch.Tensor] | None, start: int, end: int, sink: int, q_len: int
):
    """The ``on_layer`` of one chunk's replay: writes each layer's scores of context tokens
    ``start..end`` into ``scores`` (``norms``: the hidden-state norms of KVzip+, else None). The
    replay's queries are taken :data:`QUERY_BLOCK` at a time (each query's softmax is its own row,
    so the blocks give the same weights as one pass) and only the running maximum is kept."""
    replay = torch.arange(q_len)
    # per query block: which replay keys each of its queries may not see (causal within the replay);
    # made once per chunk, moved to the model's device at the first layer
    blocks = [(a, min(q_len, a + QUERY_BLOCK)) for a in range(0, q_len, QUERY_BLOCK)]
    masks: list[torch.Tensor] = [replay[None, :] > torch.arange(a, b)[:, None] for a, b in blocks]

    def on_layer(layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, module) -> None:
        heads, _, d = queries.shape
        kv_heads = keys.shape[0]
        groups = heads // kv_heads
        picked = torch.cat([keys[:, :sink], keys[:, start:end], keys[:, -q_len:]], dim=1)  # [kv, n, d]
        n = picked.shape[1]
        # [kv, d, n] (a view of the keys): a block's product is one bmm per KV head over its query
        # group's rows (a matmul broadcast over the group would copy the keys for every block)
        keys_t = picked.to(queries.dtype).transpose(-1, -2)
        q = queries.view(kv_heads, groups, q_len, d)
        hidden = norms.pop(layer) if norms is not None else None
        wov = None
        if norms is not None:
            vals = torch.cat([values[:, :sink], values[:, start:end], values[:, -q_len:]], dim=1)
            wov = _output_norms(module, vals, groups)[:, :, None, :]  # [kv, groups, 1, n]
        best = scores[layer][:, start:end]
        best.fill_(-torch.inf)
        if masks[0].device != q.device:
            masks[:] = [m.to(q.device) for m in masks]
        for (a, b), own in zip(blocks, masks):
            rows = q[:, :, a:b].reshape(kv_heads, groups * (b - a), d)
            logits = torch.bmm(rows, keys_t).view(kv_heads, groups, b - a, n).div_(math.sqrt(d))
            logits[..., n - q_len :].masked_fill_(own, -math.inf)  # causal within the replay
            weights = torch.softmax(logits, dim=-1)
            if hidden is not None and wov is not None:
                weights = weights / hidden[a:b][None, None, :, None].to(weights.dtype) * wov.to(weights.dtype)
            block = weights[..., sink : sink + end - start].amax(dim=(1, 2)).to(best.dtype)
            torch.maximum(best, block, out=best)

    return on_layer


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "o_proj")]


def _hidden_norms(model: torch.nn.Module, into: dict[int, torch.Tensor]) -> list:
    """Forward pre-hooks on every attention module recording the norm of each token's hidden state
    entering it (``[n]``, the replay's one row), by layer. PressError for a model without ``o_proj``."""
    modules = _attention_modules(model)
    if not modules:
        raise PressError("press kvzip: ':plus' needs attention modules with an o_proj (Llama-like models)")

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        into[module.layer_idx] = hidden[0].norm(dim=-1)

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]


def _output_norms(module: Any, values: torch.Tensor, groups: int) -> torch.Tensor:
    """``[kv_heads, groups, n]``: ``||W_o[:, head] v||`` of each value for each query head of its
    KV head (what the pair writes into the residual stream)."""
    kv_heads, n, d = values.shape
    weight: torch.Tensor = module.o_proj.weight  # [hidden, heads * d]
    wo = weight.view(weight.shape[0], kv_heads, groups, d)
    return torch.einsum("jhgi,hti->hgtj", wo.to(values.dtype), values).norm(dim=-1)


__all__ = ["FIRST_PROMPT", "NEXT_PROMPT", "OVERLAP", "kvzip_scores", "replays", "template_parts"]
