"""The codec registry and the codec object: quantizer and packing protocols, specs and header params.

The package (:mod:`kvstore.store.codecs`) re-exports everything here and imports the built-in codecs,
which register themselves by importing this module (never the package: no import cycle).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.records import DecodedPayload, TensorRecord

# measured per dtype (docs/codecs.md): 16-bit KV split and compressed, wider floats stored as they are
DEFAULT_CODEC = "zstd-split:1:16"
# the default of the releases whose store descriptions did not record one (before phase 2)
LEGACY_CODEC = "zstd-shuffle:1"
KV_ROLES = ("keys", "values")


@runtime_checkable
class StoredTensor(Protocol):
    """A stored tensor ready to be read: into a destination buffer, or into a fresh tensor."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device_decode(self) -> bool:
        """Whether ``copy_into`` takes ``stage=`` and decodes on the destination's device."""
        ...

    def copy_into(self, dest: torch.Tensor) -> None: ...
    def materialize(self) -> torch.Tensor: ...
    def raw_bytes(self) -> torch.Tensor | None:
        """The stored bytes (1-D uint8) when they are the values as they are, else None
        (:class:`~kvstore.store.codecs.records.StoredTensorBase` gives the defaults)."""
        ...


class Quantizer(Protocol):
    """How one key or value tensor ``[kv_heads, n_tokens, head_dim]`` is stored.

    ``role`` is ``"keys"`` or ``"values"``: a quantizer may treat them on different axes."""

    name: str
    lossless: bool

    @property
    def spec(self) -> str:
        """This quantizer with its parameters, e.g. ``int8:64`` (``none`` for the identity)."""
        ...

    def params(self) -> dict:
        """What an entry header records to decode (JSON-serialisable)."""
        ...

    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """The stored tensors for ``tensor`` (a chunk starting at context position ``start``):
        ``(suffix, tensor)`` pairs, stored under ``name + suffix`` (suffix ``""``: under the
        tensor's own name). ``positions`` (int64 ``[n_tokens]``, ascending), when given, are the
        context positions of the tensor's tokens, which need not be contiguous (a pressed cache's
        kept tokens) and replace ``start``. Raises CodecError for a tensor this quantizer cannot
        store."""
        ...

    def reader(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype,
        start: int = 0, positions: torch.Tensor | None = None,
    ) -> StoredTensor:  # fmt: skip
        """Check the stored parts of ``name`` against the ``shape`` and ``dtype`` the entry header
        declares and return a reader for them (``start`` or ``positions``: the tokens' context
        positions, as given to ``encode``). Raises CorruptEntryError when they do not fit."""
        ...

    def stored_names(self, name: str) -> list[str]:
        """The names under which ``encode`` stores tensor ``name``."""
        ...

    def bits_per_value(self, head_dim: int, dtype_bits: int, n_layers: int = 0) -> float:
        """Stored bits per key/value element, scales and zeros included (averaged over keys and
        values and over the model's ``n_layers`` layers, 0 when unknown; a context's first few tokens
        and partial groups aside): size estimates use it. Raises CodecError when the figure depends
        on the layer count (a spec giving some layers other widths) and ``n_layers`` is 0."""
        ...


class Packing(Protocol):
    """How a payload's bytes are laid out (lossless)."""

    name: str

    @property
    def spec(self) -> str: ...

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> tuple[bytes, dict, int]:
        """Serialize named CPU tensors: ``(payload, params, raw_bytes)``. ``params`` go into the
        entry header and are what ``unpack`` needs; ``raw_bytes`` is the safetensors file's size."""
        ...

    def unpack(
        self, payload: memoryview | bytes, params: Mapping, raw_bytes: int, threads: int, lazy: bool = False
    ) -> DecodedPayload:
        """Records viewing ``payload`` (or buffers decompressed from it). Memory allocated is bounded
        by ``raw_bytes``; anything inconsistent raises CorruptEntryError. ``lazy``: records may
        decompress when copied (and raise CorruptEntryError then), so that a load decodes each
        tensor straight into place."""
        ...


# The entry format that chains of chunks started with (2), and the format each later quantizer or
# packing came with: an entry is written in the newest format among its codec's parts, so that a
# kvstore that does not know a part refuses the entry ("upgrade kvstore") instead of taking it for
# corrupt (which would make it recompute and overwrite the entry, or let gc remove it).
BASE_FORMAT = 2
QUANTIZER, PACKING = "quantizer", "packing"


@dataclass(frozen=True)
class Registered:
    """One codec part kvstore knows: its ``kind`` (quantizer or packing) and spec ``name``; the
    ``factory`` that builds it from a spec's arguments (CodecError for bad ones); ``from_params``,
    which builds it from an entry header's params when they hold more than the arguments
    (CorruptEntryError); and ``since``, the entry format it came with (:data:`BASE_FORMAT`)."""

    kind: str
    name: str
    factory: Callable[[str], Any]
    from_params: Callable[[Mapping], Any] | None = None
    since: int = BASE_FORMAT


# the one registry: (kind, name) -> the part
_REGISTRY: dict[tuple[str, str], Registered] = {}


def registered(kind: str, name: str) -> Registered | None:
    """The registered part ``name`` of ``kind`` (QUANTIZER or PACKING), or None."""
    return _REGISTRY.get((kind, name))


def _names(kind: str) -> list[str]:
    return [name for k, name in _REGISTRY if k == kind]


def register_quantizer(
    name: str, factory: Callable[[str], Quantizer], *, from_params: Callable[[Mapping], Quantizer] | None = None,
    since: int = BASE_FORMAT,
) -> None:  # fmt: skip
    """Make ``name[:ARGS]`` a quantizer spec; ``factory(ARGS)`` builds it (``""`` when none given)
    and raises CodecError for bad arguments. ``from_params`` builds it from an entry header's quant
    params (its ``params()``) when they hold more than ``args``; it raises CorruptEntryError.
    ``since``: the entry format it came with (see :data:`BASE_FORMAT`)."""
    _REGISTRY[QUANTIZER, name] = Registered(QUANTIZER, name, factory, from_params, since)


def register_packing(
    name: str, factory: Callable[[str], Packing], *, from_params: Callable[[Mapping], Packing] | None = None,
    since: int = BASE_FORMAT,
) -> None:  # fmt: skip
    """Make ``name[:ARGS]`` a packing spec (``factory(ARGS)`` builds it). ``from_params`` builds the
    packing an entry header's codec params describe, for entries whose params ``name`` is ``name``.
    ``since``: the entry format it came with (see :data:`BASE_FORMAT`)."""
    _REGISTRY[PACKING, name] = Registered(PACKING, name, factory, from_params, since)


def _quantizer(name: str, args: str = "") -> Quantizer:
    return _REGISTRY[QUANTIZER, name].factory(args)


def _packing(name: str, args: str = "") -> Packing:
    return _REGISTRY[PACKING, name].factory(args)


def _since(kind: str, name: str) -> int:
    part = _REGISTRY.get((kind, name))
    return part.since if part is not None else BASE_FORMAT


@dataclass(frozen=True)
class Codec:
    """A quantizer and a packing. Build one from a spec with :func:`get_codec`."""

    quantizer: Quantizer
    packing: Packing
    threads: int = 0  # decode threads; 0 = one per CPU core, at most 8 (not part of the format)

    @property
    def spec(self) -> str:
        if self.quantizer.name == "none":
            return self.packing.spec
        if self.packing.name == "raw" and not getattr(self.quantizer, "default_packing", None):
            return self.quantizer.spec
        return f"{self.quantizer.spec}+{self.packing.spec}"

    @property
    def lossless(self) -> bool:
        return self.quantizer.lossless

    @property
    def identity(self) -> str:
        """What of this codec is part of an entry's identity: the lossy quantizer's spec, or ``""``."""
        return "" if self.lossless else self.quantizer.spec

    @property
    def entry_format(self) -> int:
        """The format an entry encoded with this codec is written in: the newest its parts came with."""
        return max(_since(QUANTIZER, self.quantizer.name), _since(PACKING, self.packing.name))

    def decode_threads(self) -> int:
        return self.threads if self.threads > 0 else max(1, min(8, os.cpu_count() or 1))

    def params(self, packing_params: Mapping) -> dict:
        """The header's codec record: the packing's params, plus the quantizer's when it is not the identity."""
        out = dict(packing_params)
        if self.quantizer.name != "none":
            out["quant"] = self.quantizer.params()
        return out

    def encode(
        self, tensors: Sequence[tuple[str, torch.Tensor, str | None]], metadata: Mapping[str, str], start: int = 0
    ) -> tuple[bytes, dict, int]:
        """Serialize ``(name, tensor, role)`` triples (``role`` ``keys``/``values`` for KV tensors,
        ``None`` for anything stored as is) of a chunk starting at context position ``start``.
        Returns ``(payload, header codec params, raw_bytes)``."""
        stored: list[tuple[str, torch.Tensor]] = []
        for name, tensor, role in tensors:
            if role in KV_ROLES:
                stored += [(name + suffix, t) for suffix, t in encode_named(self.quantizer, name, role, tensor, start)]
            else:
                stored.append((name, tensor))
        payload, packing_params, raw_bytes = self.packing.pack(stored, metadata)
        return payload, self.params(packing_params), raw_bytes


def encode_named(
    q: Quantizer, name: str, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """``q.encode`` of the tensor stored as ``name``: a quantizer with an ``encode_named`` (``int4h``
    with per-layer bits) is told the name, as its reader is."""
    named = getattr(q, "encode_named", None)
    if named is not None:
        return named(name, role, tensor, start, positions)
    return q.encode(role, tensor, start) if positions is None else q.encode(role, tensor, positions=positions)


def codec_from_params(params: Mapping) -> Codec:
    """The codec an entry header's codec record describes. Raises CorruptEntryError."""
    name = params.get("name") if isinstance(params, Mapping) else None
    part = registered(PACKING, name) if isinstance(name, str) else None
    if part is None or part.from_params is None:
        raise CorruptEntryError(f"unknown codec {name!r} in entry header")
    packing = part.from_params(params)
    quant = params.get("quant")
    if quant is None:
        return Codec(_quantizer("none"), packing)
    qpart = (
        registered(QUANTIZER, quant["name"])
        if isinstance(quant, Mapping) and isinstance(quant.get("name"), str)
        else None
    )
    if qpart is None:
        raise CorruptEntryError("entry header names an unknown quantizer")
    try:
        if qpart.from_params is not None:
            quantizer = qpart.from_params(quant)
        else:
            quantizer = qpart.factory(str(quant.get("args", "")))
    except CodecError as exc:
        raise CorruptEntryError(f"entry header has invalid quantizer parameters ({exc})") from None
    return Codec(quantizer, packing)


def spec_of(params: Mapping) -> str:
    """The codec spec an entry header's codec record describes (``zstd-shuffle:1``, ``int8:64``...).
    Raises CorruptEntryError."""
    return codec_from_params(params).spec


def identity_of(params: Mapping) -> str:
    """What of an entry's codec is part of its identity: its lossy quantizer's spec, or ``""``.
    Raises CorruptEntryError."""
    if isinstance(params, Mapping) and params.get("quant") is None:
        return ""
    return codec_from_params(params).identity


_ALIASES = {"default": DEFAULT_CODEC, "none": "raw"}


def _split(part: str) -> tuple[str, str]:
    base, _, args = part.partition(":")
    return base.strip(), args.strip()


def get_codec(spec: str | Codec | None = None, *, threads: int = 0) -> Codec:
    """Parse a codec spec (see the module docstring); ``None`` or ``default`` is the default codec.
    Raises CodecError naming the choices."""
    if isinstance(spec, Codec):
        return spec
    text = (spec or "default").strip().lower()
    text = _ALIASES.get(text, text)
    parts = text.split("+")
    quantizer: Quantizer | None = None
    packing: Packing | None = None
    for i, part in enumerate(parts):
        base, args = _split(part)
        try:
            if i == 0 and registered(QUANTIZER, base) and base != "none":
                quantizer = _quantizer(base, args)
            elif registered(PACKING, base) and i == len(parts) - 1:
                packing = _packing(base, args)
            else:
                known = registered(QUANTIZER, base) or registered(PACKING, base)
                raise CodecError(f"{base!r} cannot go there" if known else "")
        except CodecError as exc:
            if not str(exc):
                raise CodecError(f"unknown codec {spec!r}; use {choices()}") from None
            raise CodecError(f"codec {spec!r} is not valid ({exc}); use {choices()}") from None
    default_packing = getattr(quantizer, "default_packing", None)
    if packing is None and default_packing:
        packing = get_codec(default_packing).packing  # e.g. ecq's codes need an entropy coder
    return Codec(quantizer or _quantizer("none"), packing or _packing("raw"), threads)


def choices() -> str:
    """The codec specs this kvstore accepts, for messages and ``--help``."""
    quant = [q for q in _names(QUANTIZER) if q != "none"]
    packings = ", ".join(f"{p}[:LEVEL]" if p != "raw" else p for p in _names(PACKING))
    return packings + (f", or a quantizer ({', '.join(quant)}) optionally followed by +PACKING" if quant else "")


__all__ = [
    "DEFAULT_CODEC",
    "LEGACY_CODEC",
    "KV_ROLES",
    "Codec",
    "Packing",
    "Quantizer",
    "Registered",
    "StoredTensor",
    "choices",
    "codec_from_params",
    "encode_named",
    "get_codec",
    "identity_of",
    "register_packing",
    "register_quantizer",
    "registered",
    "spec_of",
]
