"""The ``zstd-split[:LEVEL[:BITS]]`` packing: compress only the bytes of each float that compress.

In a float32 KV tensor the three low bytes of every element are mantissa bits that zstd cannot
shrink (measured stored/raw 0.99 per byte plane); only the top byte (sign and seven exponent bits)
compresses, to ~0.37. Decompressing the incompressible bytes costs as much as the rest, so this
packing stores each element's low bytes **as they are** and compresses only its high byte plane;
a load copies the raw planes straight out of the payload (a zero-copy view of the LMDB map) into
their byte columns of the destination and decompresses one plane per tensor
(``experiments/codec_split.py`` measured the layouts; ``docs/codecs.md`` quotes the figures).

Planes per dtype (little-endian bytes; each plane is a run of ``width``-byte units whose offset
inside the element is a multiple of its width, so that it is one strided copy):

========= ===================================== ===========================================
dtype     split (``zstd-split:L``)               not split (``zstd-split:L:16`` for F32/F64)
========= ===================================== ===========================================
F32       bytes 0-1 raw, byte 2 raw, byte 3 zstd the element as it is (raw)
BF16, F16 byte 0 raw, byte 1 zstd                (always split)
F64       bytes 0-3 raw, 4-5 raw, 6-7 zstd       the element as it is (raw)
other     the whole tensor in one zstd frame (token ids, quantized codes and scales)
========= ===================================== ===========================================

Spec: ``zstd-split[:LEVEL[:BITS]]``: ``BITS`` lists the float widths whose high plane is
compressed (``16``, ``32``, ``64``, comma-separated; default all); wider floats left out are stored
as they are. The store default, ``zstd-split:1:16``, compresses 16-bit KV only: on the measured
2-core CPU a float32 load that decompresses anything misses the 1.2x-of-the-floor budget, while
16-bit models spend far longer in the forward than in the load (``docs/codecs.md``).

Payload: a zstd frame holding the safetensors header (the tensors' offsets are those of the plain
safetensors file), then per tensor in file order its planes: raw bytes, or one zstd frame.
Header params: ``{"name": "zstd-split", "level": L, "planes": {"BF16": [[1, 0], [1, 1]], "F32":
[[4, 0]], ...}, "parts": [[stored, raw], ...]}`` (``[width, compressed]`` per plane, by safetensors
dtype code; a dtype not listed is one zstd frame; one ``parts`` row per frame or raw plane, header
frame first). Decoding follows the params, so a later layout stays readable.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import register_packing
from kvstore.store.codecs.records import (
    DecodedPayload,
    TensorRecord,
    _decompress,
    buffer_view,
    build_header,
    check_frame_claim,
    parse_header,
    table_views,
    tensor_bytes,
)

Planes = tuple[tuple[int, bool], ...]  # (width in bytes, compressed) per plane, in byte order
# measured: experiments/codec_split.py (results/codec_split.json)
SPLIT: dict[str, Planes] = {
    "F16": ((1, False), (1, True)),
    "BF16": ((1, False), (1, True)),
    "F32": ((2, False), (1, False), (1, True)),
    "F64": ((4, False), (2, False), (2, True)),
}
_BITS = {"F16": 16, "BF16": 16, "F32": 32, "F64": 64}
WIDTHS: tuple[int, ...] = (16, 32, 64)
_UNITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def plane_table(widths: tuple[int, ...]) -> dict[str, Planes]:
    """The planes of each float dtype when the high planes of ``widths``-bit floats are compressed
    (the others stored as they are)."""
    return {code: SPLIT[code] if bits in widths else ((bits // 8, False),) for code, bits in _BITS.items()}


@dataclass(frozen=True)
class SplitRecord(TensorRecord):
    """A tensor stored as byte planes (``pieces``: per plane its width, its bytes or zstd frame,
    its size, and whether it is compressed); copied into place one strided copy per plane."""

    pieces: tuple[tuple[int, Any, int, bool], ...] = ()

    def copy_into(self, dest: torch.Tensor) -> None:
        if tuple(dest.shape) != self.shape or dest.dtype != self.dtype:
            raise ValueError(f"{self.name}: destination {tuple(dest.shape)}/{dest.dtype} != {self.shape}/{self.dtype}")
        if dest.numel() == 0:
            return
        rows = self.shape[0] if len(self.shape) > 1 else 1
        target = dest
        if dest.device.type != "cpu" or not _rows_viewable(dest, rows):
            target = torch.empty(self.shape, dtype=self.dtype)
        size, offset = self.dtype.itemsize, 0
        for width, data, nbytes, compressed in self.pieces:
            plane = buffer_view(_decompress(data, nbytes) if compressed else data)
            unit = _UNITS[width]
            columns = target.view(rows, -1).view(unit).view(rows, -1, size // width)
            columns[:, :, offset // width].copy_(plane.view(unit).view(rows, -1))
            offset += width
        if target is not dest:
            dest.copy_(target)


def _rows_viewable(t: torch.Tensor, rows: int) -> bool:
    try:
        t.view(rows, -1)
    except RuntimeError:
        return False
    return True


def _check_planes(planes: Any, itemsize: int) -> Planes:
    """``planes`` (from a spec table or an entry header) as a :data:`Planes`, or CorruptEntryError."""
    try:
        out = tuple((int(w), bool(c)) for w, c in planes)
    except (TypeError, ValueError, OverflowError):
        raise CorruptEntryError("zstd-split plane table is malformed") from None
    offset = 0
    for width, _ in out:
        if width not in _UNITS or offset % width:
            raise CorruptEntryError(f"zstd-split plane of {width} bytes at byte {offset} cannot be copied")
        offset += width
    if offset != itemsize:
        raise CorruptEntryError(f"zstd-split planes cover {offset} bytes of {itemsize}-byte elements")
    return out


class SplitPacking:
    """Each float tensor's raw low byte planes, then its high byte plane in one zstd frame."""

    name = "zstd-split"

    def __init__(self, level: int, widths: tuple[int, ...] = WIDTHS):
        self.level, self.widths = level, tuple(sorted(widths))
        self.planes = plane_table(self.widths)

    @property
    def spec(self) -> str:
        tail = "" if self.widths == WIDTHS else ":" + ",".join(map(str, self.widths))
        return f"zstd-split:{self.level}{tail}"

    def _planes(self, dtype: torch.dtype) -> Planes:
        return self.planes.get(_code(dtype), ((dtype.itemsize, True),))

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> tuple[bytes, dict, int]:
        import zstandard

        cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        head = build_header(tensors, metadata)
        parts: list[bytes | memoryview] = [cctx.compress(head)]
        table = [[len(parts[0]), len(head)]]
        for _, t in tensors:
            t = t.detach().to("cpu").contiguous()
            planes = self._planes(t.dtype)
            if len(planes) == 1:
                data = [tensor_bytes(t)]
            else:
                b = t.reshape(-1).view(torch.uint8).view(-1, t.element_size())
                offsets = [sum(w for w, _ in planes[:i]) for i in range(len(planes))]
                data = [b[:, o : o + w].contiguous().reshape(-1).numpy().data for o, (w, _) in zip(offsets, planes)]
            for d, (_, compressed) in zip(data, planes):
                stored = cctx.compress(d) if compressed and len(d) else d
                parts.append(stored)
                table.append([len(stored), len(d)])
        params = {
            "name": self.name,
            "level": self.level,
            "planes": {code: [[w, int(c)] for w, c in planes] for code, planes in sorted(self.planes.items())},
            "parts": table,
        }
        return b"".join(parts), params, sum(d for _, d in table)

    def unpack(
        self, payload: memoryview | bytes, params: Mapping, raw_bytes: int, threads: int, lazy: bool = False
    ) -> DecodedPayload:

        views, sizes = _parts(payload, params, raw_bytes)

        head = bytes(_decompress(*_frame(views, sizes, 0)))
        (n,) = struct.unpack_from("<Q", head, 0) if len(head) >= 8 else (None,)
        if n is None or len(head) != 8 + n:
            raise CorruptEntryError("first zstd-split frame is not exactly the safetensors header")
        records, metadata = parse_header(head, raw_bytes - len(head))
        planes_by_dtype = params.get("planes")
        if not isinstance(planes_by_dtype, Mapping):
            raise CorruptEntryError("zstd-split entry has no plane table")
        out: dict[str, TensorRecord] = {}
        expected, i = 0, 1
        for name, dtype, shape, begin, end in records:
            if begin != expected:
                raise CorruptEntryError("zstd-split parts are not aligned with the tensors")
            expected = end
            size = dtype.itemsize
            table_row = planes_by_dtype.get(_code(dtype))
            planes = ((size, True),) if table_row is None else _check_planes(table_row, size)
            if i + len(planes) > len(sizes):
                raise CorruptEntryError("zstd-split parts are not aligned with the tensors")
            numel = (end - begin) // size
            pieces = []
            for width, compressed in planes:
                if sizes[i][1] != numel * width or (not compressed and sizes[i][0] != sizes[i][1]):
                    raise CorruptEntryError("zstd-split parts are not aligned with the tensors")
                data, nbytes = _frame(views, sizes, i) if compressed else (views[i], sizes[i][1])
                if compressed and not lazy:
                    data, compressed = _decompress(data, nbytes), False
                pieces.append((width, data, nbytes, compressed))
                i += 1
            if len(pieces) == 1 and not pieces[0][3]:  # stored as it is, or decompressed already
                out[name] = TensorRecord(name, dtype, shape, buffer_view(pieces[0][1]))
            elif len(pieces) == 1:
                out[name] = TensorRecord(name, dtype, shape, None, frames=((pieces[0][1], pieces[0][2]),))
            else:
                out[name] = SplitRecord(name, dtype, shape, None, pieces=tuple(pieces))
        if i != len(sizes):
            raise CorruptEntryError("zstd-split parts are not aligned with the tensors")
        return DecodedPayload(out, metadata)


def _parts(payload: memoryview | bytes, params: Mapping, raw_bytes: int) -> tuple[list[Any], list[tuple[int, int]]]:
    """Each part of ``payload`` (a view) and its ``(stored, decoded)`` sizes, checked against the
    entry's part table and the header's raw size; CorruptEntryError otherwise."""
    return table_views(payload, params.get("parts"), raw_bytes, what="zstd-split", part="part")


def _frame(views: Sequence[Any], sizes: Sequence[tuple[int, int]], i: int) -> tuple[Any, int]:
    """Part ``i`` as a zstd frame whose own size claim matches the table (a frame claiming more
    than the table says would otherwise be allocated in full when decompressed)."""
    view, (c, d) = views[i], sizes[i]
    if c == 0 and d == 0:
        return view, 0
    check_frame_claim(view, d, "zstd-split")
    return view, d


def _code(dtype: torch.dtype) -> str:
    return dtypes.SAFETENSORS.get(dtypes.name(dtype), "")


def _factory(args: str) -> SplitPacking:
    level_text, colon, widths_text = args.partition(":")
    try:
        level = int(level_text) if level_text else 1
    except ValueError:
        level = -1
    if not 1 <= level <= 22:
        raise CodecError("zstd level must be an integer from 1 to 22")
    try:
        widths = tuple(sorted({int(w) for w in widths_text.split(",")})) if colon else WIDTHS
    except ValueError:
        widths = ()
    if not widths or any(w not in WIDTHS for w in widths):
        raise CodecError("zstd-split widths are float bit widths: 16, 32 and/or 64, comma-separated")
    return SplitPacking(level, widths)


def _from_params(params: Mapping) -> SplitPacking:
    """The packing an entry header describes (its spec: what ``spec_of`` reports); decoding reads
    the header's plane table itself."""
    level = params.get("level")
    planes = params.get("planes")
    widths: tuple[int, ...] = WIDTHS
    if isinstance(planes, Mapping):
        split = {_BITS.get(c) for c, p in planes.items() if isinstance(p, list) and len(p) > 1}
        widths = tuple(b for b in WIDTHS if b in split)
    return SplitPacking(level if isinstance(level, int) and not isinstance(level, bool) else 0, widths or WIDTHS)


register_packing("zstd-split", _factory, from_params=_from_params, since=3)

__all__ = ["SPLIT", "SplitPacking", "SplitRecord", "plane_table"]
