"""What a store holds for a model, probed through the chunks' own headers: how many leading chunks
of a chain are stored, intact and this model's (:func:`verified_depth`, which a build's plan and a
load agree on), those chunks materialized (:func:`load_prefix_kv`), and a format-1 entry holding a
whole context (:func:`has_v1`, :func:`load_v1`). Each probe checks every chunk with
:func:`kvstore.model.io.chains.fits`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import LayerKV
from kvstore.model.io.chains import Chain, fits
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def verified_depth(handle: ModelHandle, store: KVStore, chain: Chain) -> int:
    """How many leading chunks of ``chain`` are stored, intact and this model's (verified)."""
    with store.open_chain(chain.keys) as views:
        return sum(1 for _ in _fitting(handle, chain, views))


def _fitting(handle: ModelHandle, chain: Chain, views):
    for j, view in enumerate(views):
        if not fits(handle, view, chain, j):
            return
        yield view


def load_prefix_kv(handle: ModelHandle, store: KVStore, chain: Chain, depth: int) -> LayerKV | None:
    """The keys/values of ``chain``'s first ``depth`` chunks, materialized (None if they are no
    longer all stored intact)."""
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    with store.open_chain(chain.keys[:depth]) as views:
        for view in _fitting(handle, chain, views):
            pieces.append([(k.materialize(), v.materialize()) for k, v in filter(None, view.layers)])
    if len(pieces) < depth:
        return None
    return tuple(
        (torch.cat([p[i][0] for p in pieces], 1), torch.cat([p[i][1] for p in pieces], 1))
        for i in range(len(pieces[0]))
    )


def has_v1(handle: ModelHandle, store: KVStore, chain: Chain) -> bool:
    """Whether a format-1 entry holding exactly ``chain``'s context is stored, intact and this
    model's (nothing materialized)."""
    if not store.contains(chain.v1_key):
        return False
    whole = Chain(chain.ids, ((0, chain.n_tokens),), (chain.v1_key,), chain.v1_key)
    with store.open_entry(chain.v1_key) as view:
        return view is not None and view.header.format == 1 and fits(handle, view, whole, 0)


def load_v1(handle: ModelHandle, store: KVStore, chain: Chain) -> LayerKV | None:
    """The keys/values of a format-1 entry holding exactly ``chain``'s context, materialized (None
    when there is none, or it is corrupt or another model's)."""
    if not store.contains(chain.v1_key):
        return None
    whole = Chain(chain.ids, ((0, chain.n_tokens),), (chain.v1_key,), chain.v1_key)
    with store.open_entry(chain.v1_key) as view:
        if view is None or view.header.format != 1 or not fits(handle, view, whole, 0):
            return None
        return tuple((k.materialize(), v.materialize()) for k, v in filter(None, view.layers))


__all__ = ["has_v1", "load_prefix_kv", "load_v1", "verified_depth"]
