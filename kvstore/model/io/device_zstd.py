"""The lossless codecs' zstd frames decoded on the accelerator: a chunk crosses compressed.

A ``zstd-split`` chunk stores each 16-bit float's low byte plane as it is and its high byte plane
in one zstd frame per tensor (:mod:`kvstore.store.codecs.split`); a ``zstd`` chunk one frame per
tensor. Decoding those frames on the CPU runs at ~0.6 GB/s per thread, far below the copy engine.
Here, instead, the chunk's stored bytes (raw planes and zstd frames, as they lie in the store) are
copied into a staging slot, their checksum computed as they are copied (:mod:`kvstore.store.fused`,
on the compressed bytes, before anything is sent); the slot crosses to the device in one copy;
every frame of the chunk is decoded there in **one batched call** (:class:`DeviceDecoder`), each
decoded size checked against the entry's; only then are the byte planes put back together into
the batch buffer, one strided device copy per plane. A frame that fails to decode, or decodes to
another size, raises CorruptEntryError before any byte reaches the buffer: the chunk is a miss.

Decoders: :class:`NvcompDecoder` (NVIDIA nvCOMP's Python package, the ``gpu`` extra: ``pip
install kvstore[gpu]``; used only on CUDA, and only when ``nvidia.nvcomp`` imports) and
:class:`CpuZstdDecoder`, the stand-in the tests use through ``force_staging`` (CPU zstd over the
"device" twin, ordinary memory). Without a decoder, these chunks decode on the CPU's load threads
as before. Neither the format on disk nor what a CPU reader does changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvstore.errors import CorruptEntryError


class DeviceDecoder(Protocol):
    """Decodes zstd frames lying in device memory, all of one chunk in one call."""

    name: str

    def decode(self, frames: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
        """``frames`` (1-D uint8 tensors on the device, one standard zstd frame each) decoded:
        1-D uint8 tensors on the device of ``sizes[i]`` bytes each, ready on the current stream.
        Raises CorruptEntryError for a frame that does not decode to its size."""
        ...


class CpuZstdDecoder:
    """The stand-in decoder (tests): CPU zstd over ``frames`` in ordinary memory."""

    name = "cpu-zstd"

    def decode(self, frames: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
        from kvstore.store.codecs.records import _decompress, buffer_view

        out = []
        for frame, size in zip(frames, sizes):
            data = _decompress(memoryview(frame.cpu().numpy().tobytes()), size)  # CorruptEntryError
            out.append(buffer_view(bytearray(data)))
        return out


class NvcompDecoder:
    """nvCOMP's batched zstd decoder (``nvidia.nvcomp``, the ``gpu`` extra) on ``device``,
    running on ``stream`` (the staging ring's side stream)."""

    name = "nvcomp"

    def __init__(self, device: torch.device, stream: Any):
        from nvidia import nvcomp  # the gpu extra; decoder_for() only makes this where it imports

        self._nvcomp = nvcomp
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._codec = nvcomp.Codec(
            algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, device_id=index,
            cuda_stream=stream.cuda_stream,
        )  # fmt: skip

    def decode(self, frames: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
        if not frames:
            return []
        try:
            decoded = self._codec.decode([self._nvcomp.as_array(f) for f in frames], data_type="|u1")
        except RuntimeError as exc:  # nvCOMP reports a frame it cannot decode as a runtime error
            raise CorruptEntryError(f"a zstd frame does not decode on the device ({exc})") from None
        out = [torch.from_dlpack(d).view(-1) for d in decoded]
        if any(t.numel() != size for t, size in zip(out, sizes)):
            raise CorruptEntryError("a zstd frame decoded on the device to a different size than declared")
        return out


_DECODERS: dict[tuple[str, int], DeviceDecoder | None] = {}


def nvcomp_importable() -> bool:
    """Whether nVIDIA nvCOMP's Python package (the ``gpu`` extra) is installed (not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia.nvcomp") is not None
    except (ImportError, ValueError):  # no "nvidia" namespace package at all
        return False


def decoder_for(device: torch.device, stream: Any) -> DeviceDecoder | None:
    """The decoder for loads into ``device`` on ``stream`` (made once per stream): nvCOMP on CUDA
    where it imports, else None (the CPU decodes). Tests replace this to run
    :class:`CpuZstdDecoder` through ``force_staging``."""
    if device.type != "cuda" or stream is None:
        return None
    key = (str(device), stream.cuda_stream)
    if key not in _DECODERS:
        try:
            _DECODERS[key] = NvcompDecoder(device, stream)
        except ImportError:  # no gpu extra
            _DECODERS[key] = None
    return _DECODERS[key]


@dataclass(frozen=True)
class Piece:
    """One stored plane of a record: ``width`` bytes of each element from byte ``column`` on,
    stored at ``offset`` of the slot (``stored`` bytes: a zstd frame when ``compressed``, else
    the plane as it is), ``size`` bytes once decoded."""

    width: int
    column: int
    offset: int
    stored: int
    size: int
    compressed: bool


@dataclass(frozen=True)
class Compressed:
    """A chunk crossing compressed: the stored bytes ``[start, start + nbytes)`` (addresses in
    host memory) copied to the slot at ``at``, and per destination the pieces to join into it."""

    start: int
    nbytes: int
    at: int
    places: tuple[tuple[torch.Tensor, tuple[Piece, ...]], ...]

    @property
    def used(self) -> int:
        return self.at + self.nbytes


def plan(pairs: Sequence[tuple[Any, torch.Tensor]]) -> Compressed | None:
    """How ``pairs`` (``(record, dest)``) cross compressed, or None when they cannot (a record of
    another kind, bytes not in host memory, a destination whose rows are not contiguous) or need
    not (no zstd frame among them)."""
    from kvstore.store.fused import _span

    rows: list[tuple[torch.Tensor, list[tuple[int, int, int, int, int, bool]]]] = []  # (w, col, addr, n, size, c)
    for record, dest in pairs:
        parts = _parts(record)
        if parts is None or not _viewable(dest):
            return None
        if dest.numel() == 0:
            continue
        found = []
        for width, column, data, size, compressed in parts:
            span = _span(data, 0, 1 << 62)
            if span is None or (not compressed and span[1] - span[0] != size):
                return None
            found.append((width, column, span[0], span[1] - span[0], size, compressed))
        rows.append((dest, found))
    pieces = [p for _, found in rows for p in found]
    if not any(p[5] for p in pieces) or any(p[3] == 0 for p in pieces):
        return None
    start, end = min(p[2] for p in pieces), max(p[2] + p[3] for p in pieces)
    at = start % 64  # the slot's bytes keep the store's alignment
    return Compressed(start, end - start, at, tuple(
        (dest, tuple(Piece(w, col, at + a - start, n, size, c) for w, col, a, n, size, c in found))
        for dest, found in rows
    ))  # fmt: skip


def _parts(record: Any) -> list[tuple[int, int, Any, int, bool]] | None:
    """``(width, column, stored bytes, decoded size, compressed)`` per plane of ``record``."""
    from kvstore.store.codecs.records import TensorRecord
    from kvstore.store.codecs.split import SplitRecord

    size = record.dtype.itemsize
    if isinstance(record, SplitRecord):
        out, column = [], 0
        for width, data, nbytes, compressed in record.pieces:
            out.append((width, column, data, nbytes, compressed))
            column += width
        return out if column == size else None
    if type(record) is not TensorRecord or record.planes is not None:
        return None
    nbytes = record.numel * size
    if record.frames is not None:
        if len(record.frames) != 1:
            return None
        frame, declared = record.frames[0]
        return [(size, 0, frame, declared, True)] if declared == nbytes else None
    return [(size, 0, record.source, nbytes, False)]


def _viewable(dest: torch.Tensor) -> bool:
    rows = dest.shape[0] if dest.dim() > 1 else 1
    try:
        dest.view(rows, -1)
    except RuntimeError:
        return False
    return True


def decode_into(chunk: Compressed, device_bytes: torch.Tensor, decoder: DeviceDecoder) -> None:
    """Decode ``chunk``'s frames from ``device_bytes`` (the slot's device twin, its bytes arrived)
    in one call, check every size, then put each destination's planes together. Raises
    CorruptEntryError before any destination is written."""
    frames = [(p.offset, p.stored, p.size) for _, ps in chunk.places for p in ps if p.compressed]
    decoded = decoder.decode([device_bytes[o : o + n] for o, n, _ in frames], [s for _, _, s in frames])
    if len(decoded) != len(frames) or any(t.numel() != s for t, (_, _, s) in zip(decoded, frames)):
        raise CorruptEntryError("a zstd frame decoded on the device to a different size than declared")
    planes = iter(decoded)
    for dest, pieces in chunk.places:
        if dest.numel() == 0:
            continue
        size, rows = dest.element_size(), dest.shape[0] if dest.dim() > 1 else 1
        target = dest.view(rows, -1).view(torch.uint8).view(rows, -1, size)
        for p in pieces:
            plane = next(planes) if p.compressed else device_bytes[p.offset : p.offset + p.size]
            target[:, :, p.column : p.column + p.width].copy_(plane.view(rows, -1, p.width))


__all__ = [
    "Compressed",
    "CpuZstdDecoder",
    "DeviceDecoder",
    "NvcompDecoder",
    "Piece",
    "decode_into",
    "decoder_for",
    "nvcomp_importable",
    "plan",
]
