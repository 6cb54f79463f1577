"""Codecs: named tensors <-> payload bytes.

A payload is a safetensors file, optionally compressed with zstandard, optionally with each
tensor's bytes split into byte planes first ("shuffle": byte 0 of every element, then byte 1,
...). Sign and exponent bytes of neighbouring floats repeat; mantissa bytes look random. Apart,
zstd compresses the first well and passes the second through at memory speed.

Compressed payloads are a sequence of zstd frames aligned with the safetensors layout: frame 0
holds the safetensors header, then each tensor in file order takes one frame, or, shuffled, one
frame per byte plane. Concatenated zstd frames decompress to the concatenation of their contents,
so ``zstd -d`` of a payload gives the (plane-split) safetensors file back; the alignment lets each
frame decompress on its own (in parallel threads) and be copied once into its destination.

The codec never sees keys or stores, and the store never sees tensors.
"""
from __future__ import annotations

import json
import math
import os
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import CodecError, CorruptEntryError

# safetensors dtype names <-> torch dtypes (the subset a KV cache or token ids can use)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
}
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}

MAX_HEADER_BYTES = 16 << 20  # a safetensors header larger than this is hostile, not a KV cache
DEFAULT_CODEC = "zstd-shuffle:1"


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives inside a decoded payload: ``source`` (its bytes, 1-D uint8) or,
    for a shuffled tensor, ``planes`` (one 1-D uint8 buffer per byte of the element)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: torch.Tensor | None
    planes: tuple[torch.Tensor, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def copy_into(self, dest: torch.Tensor) -> None:
        """Copy the tensor into ``dest`` (same shape and dtype; any device; may be a strided view,
        such as one row of a padded batch buffer)."""
        if tuple(dest.shape) != self.shape or dest.dtype != self.dtype:
            raise ValueError(f"{self.name}: destination {tuple(dest.shape)}/{dest.dtype} != {self.shape}/{self.dtype}")
        if self.planes is None:
            dest.copy_(self.source.view(self.dtype).view(self.shape))
            return
        size, rows = self.dtype.itemsize, (self.shape[0] if len(self.shape) > 1 else 1)
        target = None
        if dest.device.type == "cpu" and self.numel:
            try:  # rows of contiguous elements, e.g. [kv_heads, n, head_dim] inside a batch buffer
                target = dest.view(rows, -1).view(torch.uint8).view(rows, -1, size)
            except RuntimeError:
                target = None
        if target is not None:
            # Unshuffle straight into the destination: one strided copy per byte plane.
            for j, plane in enumerate(self.planes):
                target[:, :, j].copy_(plane.view(rows, -1))
            return
        tmp = torch.empty((self.numel, size), dtype=torch.uint8)
        for j, plane in enumerate(self.planes):
            tmp[:, j].copy_(plane)
        dest.copy_(tmp.view(self.dtype).view(self.shape))

    def materialize(self) -> torch.Tensor:
        """A fresh, writable CPU tensor holding this record's values."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out


@dataclass(frozen=True)
class DecodedPayload:
    """The tensors and safetensors metadata of one payload. Views into the payload's buffers:
    valid only while those buffers are (for LMDB, while the read transaction is open)."""

    tensors: Mapping[str, TensorRecord]
    metadata: Mapping[str, str]


def _buffer_view(buf) -> torch.Tensor:
    """A 1-D uint8 tensor over ``buf`` without copying (read-only buffers included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we never write to it
        return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)


def _st_header(tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> bytes:
    head: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors:
        if t.dtype not in _ST_NAMES:
            raise CodecError(f"tensor {name!r} has dtype {t.dtype}, which kvstore does not store")
        nbytes = t.numel() * t.element_size()
        head[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(text)) + text


def _parse_st_header(head: memoryview | bytes, data_len: int) -> tuple[list[tuple[str, torch.dtype, tuple, int, int]], dict]:
    """Validate a safetensors header (8-byte length + JSON) against ``data_len`` bytes of data."""
    if len(head) < 8:
        raise CorruptEntryError("payload too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", head, 0)
    if n > MAX_HEADER_BYTES or 8 + n > len(head):
        raise CorruptEntryError(f"safetensors header declares {n} bytes, more than the payload holds")
    try:
        parsed = json.loads(bytes(head[8 : 8 + n]))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise CorruptEntryError(f"safetensors header is not valid JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise CorruptEntryError("safetensors header is not a JSON object")
    metadata = parsed.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptEntryError("safetensors metadata must map strings to strings")
    records = []
    for name, spec in parsed.items():
        try:
            dtype = ST_DTYPES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(1e999)
            raise CorruptEntryError(f"safetensors entry {name!r} is malformed or has an unsupported dtype") from None
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_len:
            raise CorruptEntryError(f"tensor {name!r}: offsets {begin}..{end} fall outside {data_len} data bytes")
        if math.prod(shape) * dtype.itemsize != end - begin:
            raise CorruptEntryError(f"tensor {name!r}: shape {shape} does not match its {end - begin} bytes")
        records.append((name, dtype, shape, begin, end))
    records.sort(key=lambda r: r[3])
    for (a, _, _, _, a_end), (b, _, _, b_begin, _) in zip(records, records[1:]):
        if b_begin < a_end:
            raise CorruptEntryError(f"tensors {a!r} and {b!r} overlap")
    return records, metadata


def _planes(t: torch.Tensor) -> torch.Tensor:
    """Byte planes of ``t`` as a ``[itemsize, numel]`` uint8 tensor (row j = byte j of each element)."""
    return t.reshape(-1).view(torch.uint8).view(-1, t.element_size()).t().contiguous()


@dataclass(frozen=True)
class Codec:
    """A payload codec. ``name`` is ``raw`` or ``zstd``; ``shuffle`` splits bytes into planes.

    Spec strings: ``raw``, ``zstd[:LEVEL]``, ``zstd-shuffle[:LEVEL]`` (see :func:`get_codec`).
    """

    name: str = "zstd"
    level: int = 1
    shuffle: bool = True
    threads: int = 0  # decode threads; 0 = one per CPU core (not part of the format)

    @property
    def spec(self) -> str:
        if self.name == "raw":
            return "raw"
        return f"zstd{'-shuffle' if self.shuffle else ''}:{self.level}"

    def _threads(self) -> int:
        return self.threads if self.threads > 0 else max(1, min(8, os.cpu_count() or 1))

    # -- encode -------------------------------------------------------------------------------
    def encode(self, tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> tuple[bytes, dict, int]:
        """Serialize named tensors (CPU, contiguous) to a payload.

        Returns ``(payload, params, raw_bytes)``: ``params`` go into the entry header and are
        needed to decode; ``raw_bytes`` is the size of the safetensors file before compression.
        """
        header = _st_header(tensors, metadata)
        parts: list[bytes | memoryview] = [header]
        for _, t in tensors:
            t = t.detach().to("cpu").contiguous()
            if self.shuffle and self.name == "zstd" and t.element_size() > 1:
                parts += [memoryview(plane.numpy()) for plane in _planes(t)]
            else:
                parts.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        raw_bytes = sum(len(p) for p in parts)
        if self.name == "raw":
            return b"".join(parts), {"name": "raw"}, raw_bytes
        import zstandard

        cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        frames = [cctx.compress(p) for p in parts]
        params = {
            "name": "zstd",
            "level": self.level,
            "shuffle": self.shuffle,
            "frames": [[len(f), len(p)] for f, p in zip(frames, parts)],
        }
        return b"".join(frames), params, raw_bytes

    # -- decode -------------------------------------------------------------------------------
    def decode(self, payload: memoryview | bytes, params: Mapping, raw_bytes: int) -> DecodedPayload:
        """Decode a payload. Memory allocated is bounded by ``raw_bytes`` (declared in the entry
        header and checked against every frame); anything inconsistent raises CorruptEntryError."""
        return decode_payload(payload, params, raw_bytes, threads=self._threads())


def decode_payload(payload: memoryview | bytes, params: Mapping, raw_bytes: int, threads: int = 1) -> DecodedPayload:
    """Decode a payload described by the header's codec ``params`` (see :meth:`Codec.encode`)."""
    name = params.get("name") if isinstance(params, Mapping) else None
    if name == "raw":
        if len(payload) != raw_bytes:
            raise CorruptEntryError(f"raw payload is {len(payload)} bytes, header says {raw_bytes}")
        whole = _buffer_view(payload)
        (n,) = struct.unpack_from("<Q", payload, 0) if len(payload) >= 8 else (None,)
        if n is None or 8 + n > len(payload):
            raise CorruptEntryError("payload too short for its safetensors header")
        records, metadata = _parse_st_header(payload, len(payload) - 8 - n)
        base = 8 + n
        out = {
            r[0]: TensorRecord(r[0], r[1], r[2], whole[base + r[3] : base + r[4]])
            for r in records
        }
        return DecodedPayload(out, metadata)
    if name != "zstd":
        raise CorruptEntryError(f"unknown codec {name!r} in entry header")
    frames = params.get("frames")
    if not isinstance(frames, list) or not frames:
        raise CorruptEntryError("zstd entry lists no frames")
    try:
        sizes = [(int(c), int(d)) for c, d in frames]
    except (TypeError, ValueError, OverflowError):
        raise CorruptEntryError("zstd frame table is malformed") from None
    if any(c <= 0 or d < 0 for c, d in sizes) or sum(c for c, _ in sizes) != len(payload):
        raise CorruptEntryError("zstd frame sizes do not add up to the payload")
    if sum(d for _, d in sizes) != raw_bytes:
        raise CorruptEntryError("zstd frames declare a different size than the entry header")
    import zstandard

    views, pos = [], 0
    for c, _ in sizes:
        views.append(payload[pos : pos + c])
        pos += c
    # ZstdDecompressor.decompress sizes its output from the frame's own content-size field and
    # ignores max_output_size when that field is present: a small frame claiming (and holding)
    # gigabytes of zeros would be allocated in full. Check every frame's claim against the table.
    for v, (_, d) in zip(views, sizes):
        try:
            claimed = zstandard.frame_content_size(v)
        except zstandard.ZstdError:
            raise CorruptEntryError("zstd frame has an unreadable header") from None
        if claimed != d:
            raise CorruptEntryError(f"a zstd frame declares {claimed} bytes, the entry header {d}")
    dctx = zstandard.ZstdDecompressor()
    try:
        if threads > 1 and len(views) > 2:
            coll = dctx.multi_decompress_to_buffer(
                views,
                decompressed_sizes=struct.pack(f"={len(sizes)}Q", *(d for _, d in sizes)),
                threads=threads,
            )
            chunks = [coll[i] for i in range(len(coll))]
        else:
            chunks = [dctx.decompress(v, max_output_size=d) if d else b"" for v, (_, d) in zip(views, sizes)]
    except zstandard.ZstdError as exc:
        raise CorruptEntryError(f"zstd frame does not decompress ({exc})") from None
    if any(len(ch) != d for ch, (_, d) in zip(chunks, sizes)):
        raise CorruptEntryError("a zstd frame decompressed to a different size than declared")
    head = bytes(chunks[0])
    (n,) = struct.unpack_from("<Q", head, 0) if len(head) >= 8 else (None,)
    if n is None or len(head) != 8 + n:
        raise CorruptEntryError("first zstd frame is not exactly the safetensors header")
    records, metadata = _parse_st_header(head, raw_bytes - len(head))
    shuffle = params.get("shuffle") is True
    wanted = 1 + sum(r[1].itemsize if shuffle and r[1].itemsize > 1 else 1 for r in records)
    if wanted != len(chunks):
        raise CorruptEntryError("zstd frames are not aligned with the tensors")
    out = {}
    expected, i = 0, 1
    for tname, dtype, shape, begin, end in records:
        if begin != expected:
            raise CorruptEntryError("zstd frames are not aligned with the tensors")
        expected = end
        if shuffle and dtype.itemsize > 1:
            planes = chunks[i : i + dtype.itemsize]
            i += dtype.itemsize
            if any(len(p) * dtype.itemsize != end - begin for p in planes):
                raise CorruptEntryError("zstd frames are not aligned with the tensors")
            out[tname] = TensorRecord(tname, dtype, shape, None, tuple(_buffer_view(p) for p in planes))
        else:
            chunk = chunks[i]
            i += 1
            if len(chunk) != end - begin:
                raise CorruptEntryError("zstd frames are not aligned with the tensors")
            out[tname] = TensorRecord(tname, dtype, shape, _buffer_view(chunk))
    return DecodedPayload(out, metadata)


_ALIASES = {"default": DEFAULT_CODEC, "none": "raw"}


def get_codec(spec: str | Codec | None = None, *, threads: int = 0) -> Codec:
    """Parse a codec spec: ``raw``, ``zstd[:LEVEL]``, ``zstd-shuffle[:LEVEL]`` or ``default``.

    Raises CodecError for anything else (levels 1..22)."""
    if isinstance(spec, Codec):
        return spec
    text = (spec or "default").strip().lower()
    text = _ALIASES.get(text, text)
    base, _, level_text = text.partition(":")
    if base == "raw" and not level_text:
        return Codec("raw", 0, False, threads)
    if base in ("zstd", "zstd-shuffle"):
        try:
            level = int(level_text) if level_text else (1 if base == "zstd-shuffle" else 3)
        except ValueError:
            level = -1
        if not 1 <= level <= 22:
            raise CodecError(f"codec {spec!r}: zstd level must be an integer from 1 to 22")
        return Codec("zstd", level, base == "zstd-shuffle", threads)
    raise CodecError(f"unknown codec {spec!r}; use raw, zstd[:LEVEL] or zstd-shuffle[:LEVEL]")
