"""zstd packings: a safetensors file cut into zstd frames aligned with its tensors.

Frame 0 holds the safetensors header; then each tensor in file order takes one frame
(``zstd[:LEVEL]``) or, byte-shuffled, one frame per byte plane (``zstd-shuffle[:LEVEL]``: byte 0
of every element, then byte 1, ...). Sign and exponent bytes of neighbouring floats repeat and
compress well; mantissa bytes look random and pass through at memory speed. Concatenated zstd
frames decompress to the concatenation of their contents, so ``zstd -d`` of a payload gives the
(plane-split) safetensors file back; the alignment lets each frame decompress on its own (in
parallel threads) and be copied once into its destination.

Header params: ``{"name": "zstd", "level": L, "shuffle": bool, "frames": [[compressed, raw], ...]}``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import register_packing
from kvstore.store.codecs.records import (
    DecodedPayload,
    TensorRecord,
    buffer_view,
    build_header,
    check_frame_claim,
    parse_header,
    table_views,
    tensor_bytes,
)


def _planes(t: torch.Tensor) -> torch.Tensor:
    """Byte planes of ``t`` as a ``[itemsize, numel]`` uint8 tensor (row j = byte j of each element)."""
    return t.reshape(-1).view(torch.uint8).view(-1, t.element_size()).t().contiguous()


class ZstdPacking:
    name = "zstd"

    def __init__(self, level: int, shuffle: bool):
        self.level, self.shuffle = level, shuffle

    @property
    def spec(self) -> str:
        return f"zstd{'-shuffle' if self.shuffle else ''}:{self.level}"

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> tuple[bytes, dict, int]:
        import zstandard

        parts: list[bytes | memoryview] = [build_header(tensors, metadata)]
        for _, t in tensors:
            t = t.detach().to("cpu").contiguous()
            if self.shuffle and t.element_size() > 1:
                parts += [plane.numpy().data for plane in _planes(t)]
            else:
                parts.append(tensor_bytes(t))
        cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        frames = [cctx.compress(p) for p in parts]
        params = {
            "name": "zstd",
            "level": self.level,
            "shuffle": self.shuffle,
            "frames": [[len(f), len(p)] for f, p in zip(frames, parts)],
        }
        return b"".join(frames), params, sum(len(p) for p in parts)

    def unpack(
        self, payload: memoryview | bytes, params: Mapping, raw_bytes: int, threads: int, lazy: bool = False
    ) -> DecodedPayload:
        import zstandard

        views, sizes = _frames(payload, params, raw_bytes)
        dctx = zstandard.ZstdDecompressor()
        chunks: list[Any]
        try:
            if lazy:  # only the safetensors header now; each tensor's frames when it is copied
                chunks = [dctx.decompress(views[0], max_output_size=sizes[0][1])]
                chunks += [None] * (len(views) - 1)
            elif threads > 1 and len(views) > 2:
                coll = dctx.multi_decompress_to_buffer(
                    views, decompressed_sizes=struct.pack(f"={len(sizes)}Q", *(d for _, d in sizes)), threads=threads
                )
                chunks = [coll[i] for i in range(len(coll))]
            else:
                chunks = [dctx.decompress(v, max_output_size=d) if d else b"" for v, (_, d) in zip(views, sizes)]
        except zstandard.ZstdError as exc:
            raise CorruptEntryError(f"zstd frame does not decompress ({exc})") from None
        if any(ch is not None and len(ch) != d for ch, (_, d) in zip(chunks, sizes)):
            raise CorruptEntryError("a zstd frame decompressed to a different size than declared")
        head = bytes(chunks[0])
        (n,) = struct.unpack_from("<Q", head, 0) if len(head) >= 8 else (None,)
        if n is None or len(head) != 8 + n:
            raise CorruptEntryError("first zstd frame is not exactly the safetensors header")
        records, metadata = parse_header(head, raw_bytes - len(head))
        shuffle = params.get("shuffle") is True
        if 1 + sum(r[1].itemsize if shuffle and r[1].itemsize > 1 else 1 for r in records) != len(chunks):
            raise CorruptEntryError("zstd frames are not aligned with the tensors")
        out = {}
        expected, i = 0, 1
        for name, dtype, shape, begin, end in records:
            if begin != expected:
                raise CorruptEntryError("zstd frames are not aligned with the tensors")
            expected = end
            n = dtype.itemsize if shuffle and dtype.itemsize > 1 else 1
            if any(d * n != end - begin for _, d in sizes[i : i + n]):
                raise CorruptEntryError("zstd frames are not aligned with the tensors")
            if lazy:
                frames = tuple((views[j], sizes[j][1]) for j in range(i, i + n))
                out[name] = TensorRecord(name, dtype, shape, None, frames=frames)
            elif n > 1:
                out[name] = TensorRecord(name, dtype, shape, None, tuple(buffer_view(p) for p in chunks[i : i + n]))
            else:
                out[name] = TensorRecord(name, dtype, shape, buffer_view(chunks[i]))
            i += n
        return DecodedPayload(out, metadata)


def _frames(payload: memoryview | bytes, params: Mapping, raw_bytes: int) -> tuple[list[Any], list[tuple[int, int]]]:
    """Each zstd frame of ``payload`` (a view) and its ``(compressed, decompressed)`` sizes, checked
    against the entry's frame table, the header's raw size and each frame's own content-size claim;
    CorruptEntryError otherwise."""
    views, sizes = table_views(payload, params.get("frames"), raw_bytes, what="zstd", part="frame", min_stored=1)
    for v, (_, d) in zip(views, sizes):
        check_frame_claim(v, d, "zstd")
    return views, sizes


def _factory(shuffle: bool, default_level: int):
    def make(args: str) -> ZstdPacking:
        try:
            level = int(args) if args else default_level
        except ValueError:
            level = -1
        if not 1 <= level <= 22:
            raise CodecError("zstd level must be an integer from 1 to 22")
        return ZstdPacking(level, shuffle)

    return make


def _from_params(params: Mapping) -> ZstdPacking:
    level = params.get("level")
    return ZstdPacking(
        level if isinstance(level, int) and not isinstance(level, bool) else 0, params.get("shuffle") is True
    )


register_packing("zstd", _factory(False, 3), from_params=_from_params)
register_packing("zstd-shuffle", _factory(True, 1))
