"""Passages stored once, position-independent, and placed at any offset of a composed context.

A passage is stored as its own chain of chunks (:func:`passage_chain`), computed alone at
positions ``0..n-1`` with nothing before it, under the seed :func:`kvstore.store.keys.passage_seed`
(so it never answers for an ordinary context starting with the same tokens), and recorded with a
context record flagged ``passage``: ``ls``, ``verify``, ``gc``, ``rm``, ``export`` and ``sync``
manage it as they manage any context. Its keys still hash the model's identity, dtype, numerics,
tokens and lossy codec.

Placing it at offset ``p`` (:func:`place`) rotates its keys by their rotary embedding: a key stored
at position ``i`` was rotated by the model's float32 angle ``i * inv_freq``; it is turned back by
that angle and forward by the model's angle of ``p + i``, in float64 (the same float32 angles the
model computes at ``p + i``, so only the stored float32 rounding remains; rotations compose). Values
carry no position. Models whose keys are not rotated this way (learned or ALiBi positions, a
dynamic RoPE, windowed or recurrent layers) are refused in one line (:func:`check_composable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.errors import ComposeError
from kvstore.model.compute.cache import LayerKV
from kvstore.model.compute.forward import prefill
from kvstore.model.family.rope import rotary_refusal
from kvstore.model.io.chains import Chain, chunk_entries, fits
from kvstore.store.codecs.prerope import Rotary
from kvstore.store.keys import DEFAULT_CHUNK_TOKENS, cache_key, chain_keys, chunk_spans, passage_seed
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def check_composable(handle: ModelHandle) -> Rotary:
    """The model's rotary embedding; ComposeError (one line naming why) for a model whose stored
    passages cannot be moved to another offset."""
    if not handle.layout.dense:
        raise ComposeError(
            f"cannot compose passages on {handle.name}: it has sliding-window, chunked or state layers, whose "
            "cache depends on everything before a passage"
        )
    rotary = handle.rotary
    if rotary is None:
        raise ComposeError(
            f"cannot compose passages on {handle.name}: its keys cannot be moved to another position by a rotation "
            f"({rotary_refusal(handle.model)})"
        )
    return rotary


def passage_chain(handle: ModelHandle, ids: Sequence[int], store: KVStore | None) -> Chain:
    """A passage's chain: chunks of the store's size (512 without one) from position 0, keyed from
    the passage seed of this model, numerics and the store's lossy codec."""
    chunk_tokens = store.chunk_tokens if store is not None else DEFAULT_CHUNK_TOKENS
    lossy = store.codec.identity if store is not None else ""
    spans = chunk_spans(len(ids), chunk_tokens)
    keys = chain_keys(passage_seed(handle.chain_seed(lossy)), ids, spans)
    return Chain(tuple(ids), tuple(spans), tuple(keys), cache_key(handle.fingerprint, handle.dtype, ids), lossy)


def stored_kv(handle: ModelHandle, store: KVStore, chain: Chain) -> LayerKV | None:
    """The whole chain's keys and values ``[kv_heads, n, head_dim]`` per layer as stored (every
    chunk verified and checked against the chain), or None when a chunk is missing or foreign."""
    with store.open_chain(chain.keys) as views:
        if len(views) < len(chain.keys) or not all(fits(handle, v, chain, j) for j, v in enumerate(views)):
            return None
        n, dev = chain.n_tokens, handle.device
        out = []
        for i, (h, dk, dv) in enumerate(handle.kv_shapes()):
            k = torch.empty((h, n, dk), dtype=handle.dtype, device=dev)
            v = torch.empty((h, n, dv), dtype=handle.dtype, device=dev)
            for (s, e), view in zip(chain.spans, views):
                sk, sv = view.layer(i)
                sk.copy_into(k[:, s:e])
                sv.copy_into(v[:, s:e])
            out.append((k, v))
    store.touch(chain.keys)
    return tuple(out)


def computed_kv(handle: ModelHandle, store: KVStore | None, chain: Chain, *, passage: bool) -> LayerKV:
    """The chain's keys and values computed from position 0 with nothing before them, stored (its
    chunks, then its record, flagged ``passage``) unless ``store`` is None or read-only."""
    layers = prefill(handle, [chain.ids])[0]
    if store is not None and not store.readonly:
        for entry in chunk_entries(handle, chain, layers):
            store.put(entry)
        store.put_context(chain.key, chain.keys, chain.n_tokens, passage=passage)
    return layers


def chain_kv(handle: ModelHandle, store: KVStore | None, chain: Chain, *, passage: bool) -> tuple[LayerKV, bool]:
    """``(keys and values of the chain from position 0, whether they came from the store)``."""
    got = stored_kv(handle, store, chain) if store is not None else None
    if got is not None:
        return got, True
    return computed_kv(handle, store, chain, passage=passage), False


def shift_keys(keys: torch.Tensor, rotary: Rotary, offset: int, start: int = 0) -> torch.Tensor:
    """Keys ``[kv_heads, n, head_dim]`` of positions ``start..`` as the model rotates them at
    positions ``start + offset..``: each pair of rotated channels turned by the difference of the
    model's float32 angles (computed in float64); channels past the rotary dimension kept."""
    if offset == 0:
        return keys
    n, r, half = keys.shape[1], rotary.dim, rotary.dim // 2
    freq = torch.tensor(rotary.inv_freq, dtype=torch.float32)
    src = torch.arange(start, start + n, dtype=torch.float64).float()
    dst = torch.arange(start + offset, start + offset + n, dtype=torch.float64).float()
    angle = (dst[:, None] * freq).double() - (src[:, None] * freq).double()
    cos, sin = (t.to(keys.device) for t in (angle.cos(), angle.sin()))
    x = keys.double()
    a, b = x[..., :half], x[..., half:r]
    out = x.clone()
    out[..., :half] = a * cos - b * sin
    out[..., half:r] = b * cos + a * sin
    return out.to(keys.dtype)


def place(layers: LayerKV, rotary: Rotary, offset: int) -> LayerKV:
    """A passage's keys and values (positions ``0..n-1``) placed at ``offset..offset+n-1``."""
    return tuple((shift_keys(k, rotary, offset), v) for k, v in layers)


__all__ = [
    "chain_kv",
    "check_composable",
    "computed_kv",
    "passage_chain",
    "place",
    "shift_keys",
    "stored_kv",
]
