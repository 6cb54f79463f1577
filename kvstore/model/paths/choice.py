"""Which cache path a model takes, and the one-line refusals for what it cannot do.

:func:`path_of` is the one dispatch on a model's cache layout (dense or not). :func:`check_supported`
refuses a model kvstore cannot serve exactly, or a store codec its path does not offer;
:func:`check_variants` refuses variants (generation contexts, decode attention, presses, sweeps) on
a path without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore.errors import ModelError
from kvstore.model.family import families
from kvstore.model.family.rope import rotary_refusal
from kvstore.model.paths.base import CachePath
from kvstore.model.paths.dense import DENSE_PATH
from kvstore.model.paths.families import FAMILIES_PATH
from kvstore.model.variants.variant import Variant
from kvstore.store.codecs.hadamard import layer_refusal
from kvstore.store.codecs.prerope import needs_rotary
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


def path_of(handle: ModelHandle) -> CachePath[Any]:
    """The cache path of the handle's model: dense when every layer is full attention."""
    return DENSE_PATH if handle.layout.dense else FAMILIES_PATH


def check_supported(handle: ModelHandle, store: KVStore | None = None) -> CachePath[Any]:
    """The model's cache path; ModelError (one line naming the family and why) unless kvstore can
    store and reuse this model's caches exactly (:mod:`kvstore.model.family.families`) and, with
    ``store``, in that store's codec: lossy codecs are measured on models whose every layer is full
    attention, and refused for the others; a codec naming layers the model lacks (``int4h:k8=L``) too."""
    reason = families.refusal(handle.model.config)
    if reason is not None:
        raise ModelError(reason)
    path = path_of(handle)  # a windowed or recurrent model is probed once here (its layout); raises ModelError
    if store is not None and not store.codec.lossless and not path.supports("lossy"):
        raise ModelError(
            f"lossy codec {store.codec.spec} is only for models whose every layer is full attention "
            f"(this {handle.model.config.model_type} model has windowed or recurrent layers); use a lossless codec"
        )
    if store is not None and (why := layer_refusal(store.codec, len(families.describe(handle.model.config).kinds))):
        raise ModelError(why)
    if store is not None and needs_rotary(store.codec) and handle.rotary is None:
        raise ModelError(
            f"lossy codec {store.codec.spec} quantizes keys before their rotary embedding, and this model cannot "
            f"have its rotation undone ({rotary_refusal(handle.model)}); use int4 or int8"
        )
    return path


def check_variants(handle: ModelHandle, variants: Sequence[Variant]) -> None:
    """ModelError (one line) when generation contexts, decode attention, presses or a variant sweep
    would run on a model with sliding-window, chunked or state layers: they are for models whose
    every layer is full attention."""
    needed = len(variants) > 1 or any(not v.dense for v in variants)
    if needed and not path_of(handle).supports("variants"):
        raise ModelError(
            f"{handle.name} ({handle.model.config.model_type}): generation contexts, decode attention, presses and "
            "variant sweeps need a model whose every layer is full attention; this one has sliding-window, chunked or "
            "state layers"
        )


__all__ = ["check_supported", "check_variants", "path_of"]
