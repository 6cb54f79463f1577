"""A model's rotary embedding, as the pre-rotation codecs (``int4r``, ``int8r``) undo it.

:func:`rotary_of` reads the inverse frequencies a model rotates its keys with from its own rotary
module (``inv_freq``: transformers computes it from ``rope_parameters`` / ``rope_theta``, partial
rotary such as GPT-NeoX's ``rotary_pct``, and static scalings such as ``linear`` or ``llama3``),
for the model types whose attention rotates channel pairs ``(j, j + R/2)`` of the first ``R``
channels of every layer the same way. Other models are refused in one line
(:func:`rotary_refusal`): the codecs would still round-trip within their bound (un-rotating and
re-rotating by any angles is exact), but keys that were not rotated that way gain nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstore.facts import ROTATE_HALF_TYPES, STATIC_ROPE_TYPES
from kvstore.store.codecs.prerope import Rotary


def _rope_type(model: Any) -> str:
    cfg = model.config
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return str(params.get("rope_type") or params.get("type") or "default") if isinstance(params, dict) else "default"


def rotary_refusal(model: Any) -> str | None:
    """Why the pre-rotation codecs cannot serve ``model`` (one phrase), or None when they can."""
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in ROTATE_HALF_TYPES:
        known = ", ".join(sorted(ROTATE_HALF_TYPES))
        return f"{model_type} models are not among those whose rotary layout kvstore undoes ({known})"
    if _rope_type(model) not in STATIC_ROPE_TYPES:
        return f"its {_rope_type(model)} RoPE changes its frequencies with the input length"
    freqs = {
        tuple(m.inv_freq.tolist()) for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)
    }
    if len(freqs) != 1:
        return f"it has {len(freqs)} rotary embeddings, not one shared by every layer"
    return None


def rotary_of(model: Any) -> Rotary | None:
    """The rotary embedding every layer of ``model`` applies to its keys, or None when
    :func:`rotary_refusal` refuses the model."""
    if rotary_refusal(model) is not None:
        return None
    for m in model.modules():
        freq = getattr(m, "inv_freq", None)
        if isinstance(freq, torch.Tensor):
            return Rotary(tuple(float(f) for f in freq.float().tolist()))
    return None  # pragma: no cover - rotary_refusal found one


__all__ = ["rotary_of", "rotary_refusal"]
