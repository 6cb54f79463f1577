"""The transform stage: what a variant does to a batch's loaded contexts before answering.

Today that is a press (:mod:`kvstore.model.press`): the contexts' buffers are replaced by buffers
holding only the tokens it keeps. It runs after the batch is loaded and any missing part computed
and handed to the writer, so it never changes a stored byte, and on the whole context (a
question-aware press runs inside the answer stage instead, once the question's queries exist).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.model.compute.cache import BatchCache
from kvstore.model.press.prune import press_cache
from kvstore.model.press.select import PressMemo
from kvstore.model.variants.variant import Variant

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def transform(handle: ModelHandle, cache: BatchCache, variant: Variant, memo: PressMemo) -> BatchCache:
    """``cache`` as ``variant`` answers from it: pressed by its press (unless question-aware), else as is."""
    if variant.press is None or variant.press.question:
        return cache
    return press_cache(handle, cache, variant.press, memo)


__all__ = ["transform"]
