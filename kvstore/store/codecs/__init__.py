"""Codecs: how an entry's tensors become stored bytes, and back.

A codec has two parts, named together in one spec string joined by ``+``:

* a **quantizer** decides how each key/value tensor is stored: as it is (``none``, implied when
  the spec names no quantizer), or as integer codes plus scales and zeros (lossy). It encodes one
  KV tensor into one or more stored tensors and decodes them straight into a destination buffer
  (a strided view of the batch buffers), in the model's dtype;
* a **packing** decides how the payload's bytes are laid out: ``raw`` (a plain safetensors file),
  ``zstd[:LEVEL]`` (one zstd frame per tensor), ``zstd-shuffle[:LEVEL]`` (one frame per byte
  plane of each tensor) or ``zstd-split[:LEVEL[:BITS]]`` (each float's low bytes as they are, its
  high byte plane in one frame). Packings are lossless.

Specs: ``raw``, ``zstd:3``, ``zstd-shuffle:1``, ``zstd-split:1:16`` (the default: see
``docs/codecs.md``), and with a quantizer e.g. ``int8:64+zstd``. Only a lossy quantizer is part of
an entry's identity (its key): entries under different lossless codecs are interchangeable.

A new codec is one module that defines a :class:`Quantizer` or :class:`Packing` and calls
:func:`register_quantizer` / :func:`register_packing` from :mod:`kvstore.store.codecs.base` (never
from this package, which imports the built-in codec modules: that would be an import cycle); add
its import below. Codecs see tensors and bytes, never keys or stores.
"""

from __future__ import annotations

# The built-in codecs register themselves on import; each imports only ``base`` and ``records``.
from kvstore.store.codecs import asym as _asym  # noqa: F401
from kvstore.store.codecs import entropy as _entropy  # noqa: F401
from kvstore.store.codecs import hadamard as _hadamard  # noqa: F401
from kvstore.store.codecs import plain as _plain  # noqa: F401
from kvstore.store.codecs import prerope as _prerope  # noqa: F401
from kvstore.store.codecs import quant as _quant  # noqa: F401
from kvstore.store.codecs import split as _split  # noqa: F401
from kvstore.store.codecs import zstd as _zstd  # noqa: F401
from kvstore.store.codecs.base import (
    DEFAULT_CODEC,
    KV_ROLES,
    LEGACY_CODEC,
    Codec,
    DecodedPayload,
    Packing,
    Quantizer,
    StoredTensor,
    TensorRecord,
    choices,
    codec_from_params,
    get_codec,
    identity_of,
    register_packing,
    register_quantizer,
    spec_of,
)
from kvstore.store.codecs.records import StoredTensorBase

__all__ = [
    "DEFAULT_CODEC",
    "LEGACY_CODEC",
    "KV_ROLES",
    "Codec",
    "DecodedPayload",
    "Packing",
    "Quantizer",
    "StoredTensor",
    "StoredTensorBase",
    "TensorRecord",
    "choices",
    "codec_from_params",
    "get_codec",
    "identity_of",
    "register_packing",
    "register_quantizer",
    "spec_of",
]
