"""The transform stage: what a variant does to a batch's contexts before answering or scoring.

Today that is a press (:mod:`kvstore.model.press`): each row's buffers are replaced by buffers
holding only the tokens it keeps, read from the stored pressed entry the plan found for it
(``plan.entries(variant)``, opened by the path) or pressed now from the dense cache (through the
request's lossy codec where it has one, so that both give the same tokens). It runs after the
batch is loaded and any missing part computed and handed to the writer, so it never changes a
stored byte, and on the whole context (a question-aware press runs inside the answer stage
instead, once the question's queries exist).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import BatchCache
from kvstore.model.plan.batch import BatchPlan
from kvstore.model.press.prune import Geometry, Sources, press_batch
from kvstore.model.press.select import PressMemo
from kvstore.model.variants.variant import Variant
from kvstore.store.codecs import Codec
from kvstore.store.owned import DerivedView

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def plan_geometry(handle: ModelHandle, plan: BatchPlan) -> Geometry:
    """The shape of ``plan``'s batch without its dense buffers (every row read from an entry): the
    contexts its entries are filed under (scoring's: the context but its last token)."""
    shapes = tuple((h, dk, dv) for h, dk, dv in handle.kv_shapes())
    read = plan.derived_chains
    return Geometry(tuple(c.n_tokens for c in read), tuple(c.ids for c in read), plan.slots - plan.context_slots,
                    shapes, handle.dtype, torch.device(handle.device))  # fmt: skip


def transform(
    handle: ModelHandle, plan: BatchPlan, cache: BatchCache | None, variant: Variant, memo: PressMemo,
    entries: Mapping[str, DerivedView], codec: Codec | None,
) -> BatchCache:  # fmt: skip
    """The batch's cache as ``variant`` answers from it: pressed by its press (unless
    question-aware), else ``cache`` as is. ``entries``: the open pressed entries of this variant by
    context key; ``codec``: the request's codec (a lossy one also encodes rows pressed now)."""
    press = variant.press
    if press is None or press.question:
        assert cache is not None, "a variant without a press reads the dense cache"
        return cache
    rows = {r: entries[c.key] for r, c in enumerate(plan.contexts) if c.key in entries}
    geometry = Geometry.of(cache) if cache is not None else plan_geometry(handle, plan)
    sources = Sources(cache, rows, codec if codec is not None and not codec.lossless else None, plan.contexts)
    return press_batch(handle, geometry, press, memo, sources)


__all__ = ["plan_geometry", "transform"]
