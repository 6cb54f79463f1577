"""Attention over a pressed cache whose layers and KV heads keep different counts.

After a press with a non-uniform budget (:mod:`kvstore.model.press.select`: AdaKV, PyramidKV,
KVzip's global cut), layer ``l`` holds ``P_l`` context slots and each head of a row its own count,
left-padded with zeros (:class:`~kvstore.model.compute.cache.HeadCounts`). The model builds one
attention mask per forward, for layer 0's geometry; :func:`per_head_masks` wraps the model's
attention (or a decode attention's) so that each layer instead attends under its own mask: per
KV head (repeated over its query heads) the context slots that head keeps, then the question and
generated slots as the model's mask has them (padding and causality), every query seeing at least
its own slot (a left-padded question's pad queries would otherwise see nothing, and a fully masked
row is NaN under eager float64 attention, which poisons real rows through ``0 * NaN``).

The wrapper is entered around the question forward and the decode steps only, and undone on exit
(:func:`kvstore.model.variants.hooks.switched`); a cache without ``heads`` needs none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kvstore.errors import PressError
from kvstore.model.compute.cache import BatchCache
from kvstore.model.press.window import inner_attention
from kvstore.model.variants import hooks
from kvstore.model.variants.sparse import allowed_keys

HEADS_PREFIX = "kvstore-heads:"


@contextlib.contextmanager
def per_head_masks(model: torch.nn.Module, cache: BatchCache) -> Iterator[None]:
    """Within the block, ``model`` attends over ``cache`` (answering from it) with each layer's own
    per-head mask (see the module docstring); nothing for a cache without ``heads``."""
    if cache.heads is None:
        yield
        return
    current = str(getattr(model.config, "_attn_implementation", None) or "eager")
    if current.startswith("flash"):
        raise PressError(
            f"presses whose heads keep different counts need per-head masks, which {current} attention does not take; "
            "load the model with sdpa or eager attention"
        )
    device = cache.bufs[0][0].device
    masks = cache.heads.masks(device)
    slots = cache.heads.slots
    reference = cache.first_free

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        layer = int(module.layer_idx)
        B, heads, q, _ = query.shape
        context = masks[layer]  # [B, kv_heads, P_l]
        kv_heads, P = context.shape[1], slots[layer]
        tail_len = key.shape[2] - P
        allowed = allowed_keys(attention_mask, q, reference + tail_len, query.device)
        tail = allowed[..., reference : reference + tail_len].expand(B, 1, q, tail_len)
        own = torch.eye(q, dtype=torch.bool, device=query.device)  # query j's own slot: the last q
        tail = tail.clone()
        tail[..., tail_len - q :] |= own
        mask = torch.cat([context[:, :, None, :].expand(B, kv_heads, q, P), tail.expand(B, kv_heads, q, tail_len)],
                         dim=-1)  # fmt: skip
        mask = mask.repeat_interleave(heads // kv_heads, dim=1)
        if current == "eager":  # transformers' eager attention adds a float mask
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min
            )
        return inner_attention(current, module)(module, query, key, value, mask, *args, **kwargs)

    with hooks.switched(model, HEADS_PREFIX + current, attention):
        yield


__all__ = ["HEADS_PREFIX", "per_head_masks"]
