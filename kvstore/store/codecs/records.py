"""The payload container: a safetensors file, and records that say where each tensor's bytes are.

A :class:`TensorRecord` points at one stored tensor inside a decoded payload: its bytes (``source``)
or, for a byte-shuffled tensor, its byte planes (``planes``). Records view the payload's buffers
(the LMDB map, or decompressed frames) and are valid only while those are.

Headers are built and parsed here (never with ``safetensors``' own parser on untrusted bytes: the
parse validates every offset and size against the bytes at hand before anything is allocated).
"""

from __future__ import annotations

import json
import math
import struct
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import CodecError, CorruptEntryError

MAX_HEADER_BYTES = 16 << 20  # a safetensors header larger than this is hostile, not a KV cache


class StoredTensorBase:
    """What a stored tensor tells the staging ring beyond ``copy_into``/``materialize`` (the
    :class:`~kvstore.store.codecs.base.StoredTensor` protocol), with the defaults of one that
    decodes on the host and has no plain bytes: ``device_decode`` (``copy_into`` takes ``stage=``
    and decodes where the destination is) and :meth:`raw_bytes`."""

    device_decode = False

    def raw_bytes(self) -> torch.Tensor | None:
        """The stored bytes (1-D uint8) when they are the tensor's values as they are, else None."""
        return None


@dataclass(frozen=True)
class TensorRecord(StoredTensorBase):
    """Where one stored tensor lives: ``source`` (its bytes, 1-D uint8) or, for a shuffled tensor,
    ``planes`` (one 1-D uint8 buffer per byte of the element); or, decoded lazily, ``frames``
    (compressed zstd frames with their decompressed sizes: the whole tensor, or one per plane),
    decompressed only when the tensor is copied, one frame at a time, so that its bytes are still
    in the CPU's cache when they are copied into place."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: torch.Tensor | None
    planes: tuple[torch.Tensor, ...] | None = None
    frames: tuple[tuple[memoryview, int], ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def raw_bytes(self) -> torch.Tensor | None:
        """``source`` when the values are stored as they are (no planes, no frames), else None."""
        return self.source if self.planes is None and self.frames is None else None

    def copy_into(self, dest: torch.Tensor) -> None:
        """Copy the tensor into ``dest`` (same shape and dtype; any device; may be a strided view,
        such as one row of a padded batch buffer). Raises CorruptEntryError for a lazy frame that
        does not decompress to its size."""
        if tuple(dest.shape) != self.shape or dest.dtype != self.dtype:
            raise ValueError(f"{self.name}: destination {tuple(dest.shape)}/{dest.dtype} != {self.shape}/{self.dtype}")
        if self.frames is not None:
            parts = [buffer_view(_decompress(frame, size)) for frame, size in self.frames]
            if len(parts) == 1:
                _copy_plain(dest, parts[0], self.dtype, self.shape)
            else:
                _copy_planes(dest, parts, self.dtype, self.shape)
        elif self.planes is None:
            assert self.source is not None
            _copy_plain(dest, self.source, self.dtype, self.shape)
        else:
            _copy_planes(dest, self.planes, self.dtype, self.shape)

    def materialize(self) -> torch.Tensor:
        """A fresh, writable CPU tensor holding this record's values."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out


_local = threading.local()


def _decompressor():
    """This thread's zstd decompression context (one per thread: a context is not thread-safe,
    and creating one per frame cost ~30% of a small chunk's load)."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        import zstandard

        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def _decompress(frame: memoryview, size: int) -> bytes:
    import zstandard

    try:
        out = _decompressor().decompress(frame, max_output_size=size) if size else b""
    except zstandard.ZstdError as exc:
        raise CorruptEntryError(f"zstd frame does not decompress ({exc})") from None
    if len(out) != size:
        raise CorruptEntryError("a zstd frame decompressed to a different size than declared")
    return out


def _copy_plain(dest: torch.Tensor, source: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    dest.copy_(source.view(dtype).view(shape))


def _copy_planes(dest: torch.Tensor, planes, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    size, rows, numel = dtype.itemsize, (shape[0] if len(shape) > 1 else 1), math.prod(shape)
    target = None
    if dest.device.type == "cpu" and numel:
        try:  # rows of contiguous elements, e.g. [kv_heads, n, head_dim] inside a batch buffer
            target = dest.view(rows, -1).view(torch.uint8).view(rows, -1, size)
        except RuntimeError:
            target = None
    if target is not None:
        # Unshuffle straight into the destination: one strided copy per byte plane.
        for j, plane in enumerate(planes):
            target[:, :, j].copy_(plane.view(rows, -1))
        return
    tmp = torch.empty((numel, size), dtype=torch.uint8)
    for j, plane in enumerate(planes):
        tmp[:, j].copy_(plane)
    dest.copy_(tmp.view(dtype).view(shape))


@dataclass(frozen=True)
class DecodedPayload:
    """The records and safetensors metadata of one payload (views: see the module docstring)."""

    tensors: Mapping[str, TensorRecord]
    metadata: Mapping[str, str]


def buffer_view(buf) -> torch.Tensor:
    """A 1-D uint8 tensor over ``buf`` without copying (read-only buffers included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we never write to it
        return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without copying when it is contiguous."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data


def build_header(tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> bytes:
    """The safetensors header (8-byte length + JSON, padded to 8 bytes) for ``tensors`` in order."""
    head: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors:
        try:
            code = dtypes.SAFETENSORS[dtypes.name(t.dtype)]
        except (KeyError, ValueError):
            raise CodecError(f"tensor {name!r} has dtype {t.dtype}, which kvstore does not store") from None
        nbytes = t.numel() * t.element_size()
        head[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(text)) + text


HeaderRecord = tuple[str, torch.dtype, tuple[int, ...], int, int]  # name, dtype, shape, begin, end
_TORCH_DTYPES: dict[str, torch.dtype] = {}


def _torch_dtypes() -> dict[str, torch.dtype]:
    """Each safetensors dtype code kvstore stores, as its torch dtype (made once)."""
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({code: dtypes.to_torch(name) for code, name in dtypes.FROM_SAFETENSORS.items()})
    return _TORCH_DTYPES


def parse_header(head: memoryview | bytes, data_len: int) -> tuple[list[HeaderRecord], dict]:
    """Validate a safetensors header (8-byte length + JSON) against ``data_len`` bytes of data.
    Returns the records sorted by offset and the metadata. Raises CorruptEntryError."""
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
    return _tensor_table(parsed, data_len), metadata


def _tensor_table(parsed: dict, data_len: int) -> list[HeaderRecord]:
    """The records of a parsed safetensors header (its metadata popped), validated against
    ``data_len`` bytes of data and sorted by offset. The chunks of a chain list the same tensors at
    the same offsets: the last table validated on this thread is kept with the header it came from,
    and a header equal to it (``==`` on the parsed JSON: every value that differs, or that
    validation would read differently, compares unequal; the names in the same order) reuses it
    instead of validating again."""
    last = getattr(_local, "table", None)
    if last is not None and last[0] == data_len and last[1] == parsed and last[2] == tuple(parsed):
        return list(last[3])
    records: list[HeaderRecord] = []
    codes, prod = _torch_dtypes(), math.prod  # one chunk's header lists ~65 tensors: a tight loop
    for name, spec in parsed.items():
        try:
            dtype = codes[spec["dtype"]]
            shape = tuple(map(int, spec["shape"]))
            begin, end = map(int, spec["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError):  # OverflowError: int(1e999)
            raise CorruptEntryError(f"safetensors entry {name!r} is malformed or has an unsupported dtype") from None
        if (shape and min(shape) < 0) or not 0 <= begin <= end <= data_len:
            raise CorruptEntryError(f"tensor {name!r}: offsets {begin}..{end} fall outside {data_len} data bytes")
        if prod(shape) * dtype.itemsize != end - begin:
            raise CorruptEntryError(f"tensor {name!r}: shape {shape} does not match its {end - begin} bytes")
        records.append((name, dtype, shape, begin, end))
    records.sort(key=lambda r: r[3])
    for (a, _, _, _, a_end), (b, _, _, b_begin, _) in zip(records, records[1:]):
        if b_begin < a_end:
            raise CorruptEntryError(f"tensors {a!r} and {b!r} overlap")
    _local.table = (data_len, parsed, tuple(parsed), tuple(records))
    return records


def check_frame_claim(view: Any, decoded: int, what: str) -> None:
    """A zstd frame's own content-size claim must equal ``decoded``, the table's size for it:
    ZstdDecompressor.decompress sizes its output from the frame's claim and ignores
    max_output_size when the claim is present, so a small frame claiming (and holding) gigabytes of
    zeros would otherwise be allocated in full. CorruptEntryError naming ``what`` otherwise."""
    import zstandard

    try:
        claimed = zstandard.frame_content_size(view)
    except zstandard.ZstdError:
        raise CorruptEntryError(f"{what} frame has an unreadable header") from None
    if claimed != decoded:
        raise CorruptEntryError(f"a zstd frame declares {claimed} bytes, the entry header {decoded}")


def table_views(
    payload: memoryview | bytes, table: object, raw_bytes: int, *, what: str, part: str, min_stored: int = 0
) -> tuple[list[Any], list[tuple[int, int]]]:
    """Each part of ``payload`` (a view) and its ``(stored, decoded)`` sizes from an entry's part
    table (``table``: ``[[stored, decoded], ...]``), checked: the table well formed, every stored
    size at least ``min_stored``, the stored sizes adding up to the payload and the decoded ones to
    the header's ``raw_bytes``. CorruptEntryError naming the codec (``what``) and its parts
    (``part``: ``frame``, ``part``) otherwise."""
    if not isinstance(table, list) or not table:
        raise CorruptEntryError(f"{what} entry lists no {part}s")
    try:
        sizes = [(int(c), int(d)) for c, d in table]
    except (TypeError, ValueError, OverflowError):
        raise CorruptEntryError(f"{what} {part} table is malformed") from None
    if any(c < min_stored or d < 0 for c, d in sizes) or sum(c for c, _ in sizes) != len(payload):
        raise CorruptEntryError(f"{what} {part} sizes do not add up to the payload")
    if sum(d for _, d in sizes) != raw_bytes:
        raise CorruptEntryError(f"{what} {part}s declare a different size than the entry header")
    views: list[Any] = []
    pos = 0
    for c, _ in sizes:
        views.append(payload[pos : pos + c])
        pos += c
    return views, sizes


__all__ = [
    "DecodedPayload",
    "StoredTensorBase",
    "TensorRecord",
    "buffer_view",
    "build_header",
    "check_frame_claim",
    "parse_header",
    "table_views",
    "tensor_bytes",
]
