"""Dtypes in one place: canonical names, aliases, widths, safetensors codes, and the KV-bytes formula.

Names are torch's without the ``torch.`` prefix (``float32``, ``bfloat16``...). This module imports
no torch at load time (``kvstore size`` and ``kvstore --help`` must stay light); :func:`to_torch`
imports it when called.

::

    KV bytes = 2 (keys, values) x layer_tokens x kv_heads x head_dim x bits per element / 8

where ``layer_tokens`` is the sum over layers of the tokens each layer caches (``layers x tokens``
when no layer is windowed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.errors import DtypeError

if TYPE_CHECKING:  # pragma: no cover
    import torch

# What a model runs in and caches its keys/values in.
KV_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
# What ``--dtype all`` means in size reports: the widths models are run in.
INFERENCE_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
# ``--dtype`` choices for commands that load a model ("auto": the dtype its config declares).
MODEL_DTYPE_CHOICES: tuple[str, ...] = (*KV_DTYPES, "auto")

# Bits per element of every dtype kvstore stores (KV dtypes, token ids, codec parts).
BITS: dict[str, int] = {
    "float64": 64,
    "float32": 32,
    "float16": 16,
    "bfloat16": 16,
    "float8_e4m3fn": 8,
    "int64": 64,
    "int32": 32,
    "int16": 16,
    "int8": 8,
    "uint8": 8,
}
ALIASES: dict[str, str] = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
}
# safetensors' dtype codes
SAFETENSORS: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
}
FROM_SAFETENSORS: dict[str, str] = {code: name for name, code in SAFETENSORS.items()}


def name(dtype: Any) -> str:
    """The canonical name of a dtype given as a torch dtype or a name/alias (any case, with or
    without ``torch.``). Raises :class:`DtypeError` for anything kvstore does not store."""
    text = str(dtype).strip().lower().removeprefix("torch.")
    text = ALIASES.get(text, text)
    if text not in BITS:
        raise DtypeError(f"unknown dtype {dtype!r}; use one of {', '.join(KV_DTYPES)}")
    return text


def label(dtype: Any) -> str:
    """Any torch dtype's name without ``torch.`` (no validation: weights may use dtypes kvstore
    never stores)."""
    return str(dtype).removeprefix("torch.")


def parse_kv(dtype: Any) -> str:
    """The canonical name of a dtype a model can run and cache KV in (``KV_DTYPES``).
    Raises :class:`DtypeError` naming the choices."""
    try:
        text = name(dtype)
    except DtypeError:
        text = ""
    if text not in KV_DTYPES:
        raise DtypeError(f"unknown or unsupported KV dtype {dtype!r}; use one of {', '.join(KV_DTYPES)}")
    return text


def bits(dtype: Any) -> int:
    """Bits per element."""
    return BITS[name(dtype)]


def to_torch(dtype: Any) -> torch.dtype:
    """The torch dtype of a name (or a torch dtype, returned as is)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, name(dtype))


def kv_bytes(layer_tokens: int, kv_heads: int, head_dim: int, dtype: Any) -> int:
    """Bytes of keys and values: ``2 x layer_tokens x kv_heads x head_dim`` elements of ``dtype``
    (rounded up to whole bytes for sub-byte widths). ``layer_tokens`` is the sum over layers of
    the tokens each caches."""
    return -(-2 * layer_tokens * kv_heads * head_dim * bits(dtype) // 8)


__all__ = [
    "ALIASES",
    "BITS",
    "FROM_SAFETENSORS",
    "INFERENCE_DTYPES",
    "KV_DTYPES",
    "MODEL_DTYPE_CHOICES",
    "SAFETENSORS",
    "bits",
    "kv_bytes",
    "label",
    "name",
    "parse_kv",
    "to_torch",
]
