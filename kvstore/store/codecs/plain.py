"""The identity quantizer (tensors stored as they are) and the ``raw`` packing (a plain
safetensors file, readable by ``safetensors.torch.load``)."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import register_packing, register_quantizer
from kvstore.store.codecs.records import (
    DecodedPayload,
    TensorRecord,
    buffer_view,
    build_header,
    parse_header,
    tensor_bytes,
)


class Identity:
    """Stores each key/value tensor as it is (lossless)."""

    name = "none"
    lossless = True
    spec = "none"

    def params(self) -> dict:
        return {}

    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        return [("", tensor)]

    def stored_names(self, name: str) -> list[str]:
        return [name]

    def bits_per_value(self, head_dim: int, dtype_bits: int, n_layers: int = 0) -> float:
        return float(dtype_bits)

    def reader(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype,
        start: int = 0, positions: torch.Tensor | None = None,
    ) -> TensorRecord:  # fmt: skip
        rec = records.get(name)
        if rec is None:
            raise CorruptEntryError(f"entry lacks tensor {name}")
        if rec.shape != shape or rec.dtype != dtype:
            raise CorruptEntryError(f"tensor {name} is {rec.shape} {rec.dtype}, header says {shape} {dtype}")
        return rec


class RawPacking:
    """A plain safetensors file."""

    name = "raw"
    spec = "raw"

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> tuple[bytes, dict, int]:
        parts = [build_header(tensors, metadata)] + [tensor_bytes(t) for _, t in tensors]
        payload = b"".join(parts)
        return payload, {"name": "raw"}, len(payload)

    def unpack(
        self, payload: memoryview | bytes, params: Mapping, raw_bytes: int, threads: int, lazy: bool = False
    ) -> DecodedPayload:
        if len(payload) != raw_bytes:
            raise CorruptEntryError(f"raw payload is {len(payload)} bytes, header says {raw_bytes}")
        (n,) = struct.unpack_from("<Q", payload, 0) if len(payload) >= 8 else (None,)
        if n is None or 8 + n > len(payload):
            raise CorruptEntryError("payload too short for its safetensors header")
        records, metadata = parse_header(payload, len(payload) - 8 - n)
        whole, base = buffer_view(payload), 8 + n
        out = {
            name: TensorRecord(name, dtype, shape, whole[base + begin : base + end])
            for name, dtype, shape, begin, end in records
        }
        return DecodedPayload(out, metadata)


def _identity(args: str) -> Identity:
    if args:
        raise CodecError("the identity quantizer takes no arguments")
    return Identity()


def _raw(args: str) -> RawPacking:
    if args:
        raise CodecError("raw takes no level")
    return RawPacking()


register_quantizer("none", _identity)
register_packing("raw", _raw, from_params=lambda params: RawPacking())
