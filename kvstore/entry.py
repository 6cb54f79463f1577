"""The on-disk entry format (version 1): one stored value per context.

::

    magic     8 bytes   b"\\x89KVS\\r\\n\\x1a\\n"
    hlen      u32 LE    length of the header
    header    hlen bytes  canonical JSON (sorted keys): format, key, model, model_name, dtype,
                          n_tokens, n_layers, kv_heads, head_dim, codec params, raw_bytes, created
    payload   codec output: a safetensors file (optionally byte-shuffled, optionally zstd frames)
              holding ``layers.{i}.keys`` / ``layers.{i}.values`` ``[kv_heads, n_tokens, head_dim]``
              and ``token_ids`` ``[n_tokens]`` int64, with the same facts in its ``__metadata__``
    checksum  u64 LE    xxh3-64 of every byte before it

The checksum is verified on every load before anything is decoded; the header alone (no checksum
pass, no decompression) is enough for listings. Anything inconsistent is a CorruptEntryError.
"""
from __future__ import annotations

import json
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from kvstore.codec import Codec, DecodedPayload, decode_payload, get_codec
from kvstore.errors import CorruptEntryError, FormatVersionError

FORMAT_VERSION = 1
MAGIC = b"\x89KVS\r\n\x1a\n"
_PREFIX = len(MAGIC) + 4
_TRAILER = 8
MAX_ENTRY_HEADER = 1 << 20
MAX_COMPRESSION_RATIO = 1000  # a KV cache never compresses this well; a frame that claims to is hostile

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a KV dtype (``float32``...). Raises ValueError for others."""
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return dtype
        raise ValueError(f"unsupported KV dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; use one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class EntryHeader:
    """What an entry says about itself (parsed from its header, no payload decoding)."""

    key: str
    model: str
    model_name: str
    dtype: str
    n_tokens: int
    n_layers: int
    kv_heads: int
    head_dim: int
    codec: Mapping = field(hash=False, compare=False)
    raw_bytes: int
    created: float
    format: int = FORMAT_VERSION

    @property
    def codec_spec(self) -> str:
        c = self.codec
        if c.get("name") == "raw":
            return "raw"
        return f"zstd{'-shuffle' if c.get('shuffle') else ''}:{c.get('level', '?')}"

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values alone, uncompressed."""
        return 2 * self.n_layers * self.kv_heads * self.n_tokens * self.head_dim * DTYPES[self.dtype].itemsize


def tensor_names(n_layers: int) -> list[str]:
    names = []
    for i in range(n_layers):
        names += [f"layers.{i}.keys", f"layers.{i}.values"]
    return names + ["token_ids"]


def encode_entry(
    *,
    key: str,
    model: str,
    model_name: str,
    token_ids: Sequence[int] | torch.Tensor,
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    codec: Codec | str | None = None,
    created: float | None = None,
) -> bytes:
    """Serialize one context's KV cache.

    ``layers``: per layer ``(keys, values)``, each ``[kv_heads, n_tokens, head_dim]`` (a leading
    batch dim of 1 is accepted), all of one float dtype. Returns the bytes to store.
    """
    codec = get_codec(codec)
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
    n_tokens = int(ids.numel())
    tensors: list[tuple[str, torch.Tensor]] = []
    shape0 = None
    for i, (k, v) in enumerate(layers):
        k = k[0] if k.dim() == 4 else k
        v = v[0] if v.dim() == 4 else v
        if shape0 is None:
            shape0, dtype = tuple(k.shape), k.dtype
        for t in (k, v):
            if t.dim() != 3 or tuple(t.shape) != shape0 or t.dtype != dtype or t.shape[1] != n_tokens:
                raise ValueError(
                    f"layer {i}: expected [kv_heads, {n_tokens}, head_dim] {dtype} like layer 0 {shape0}, got {tuple(t.shape)} {t.dtype}"
                )
        tensors += [(f"layers.{i}.keys", k), (f"layers.{i}.values", v)]
    if shape0 is None:
        raise ValueError("an entry needs at least one layer")
    tensors.append(("token_ids", ids))
    dname = dtype_name(dtype)
    created = time.time() if created is None else created
    facts = {
        "format": FORMAT_VERSION,
        "key": key,
        "model": model,
        "model_name": model_name,
        "dtype": dname,
        "n_tokens": n_tokens,
        "n_layers": len(layers),
        "kv_heads": shape0[0],
        "head_dim": shape0[2],
        "created": round(created, 6),
    }
    metadata = {k: str(v) for k, v in facts.items()} | {"codec": codec.spec}
    payload, params, raw_bytes = codec.encode(tensors, metadata)
    header = json.dumps(facts | {"codec": params, "raw_bytes": raw_bytes}, sort_keys=True, separators=(",", ":")).encode()
    body = b"".join([MAGIC, struct.pack("<I", len(header)), header, payload])
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def _int(h: Mapping, name: str, low: int = 0) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise CorruptEntryError(f"entry header field {name!r} is missing or invalid")
    return v


def read_header(buf: bytes | memoryview) -> tuple[EntryHeader, int]:
    """Parse an entry's header without verifying the checksum.

    Returns ``(header, payload_offset)``. Raises CorruptEntryError or FormatVersionError."""
    if len(buf) < _PREFIX + _TRAILER or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise CorruptEntryError("not a kvstore entry (bad magic or too short)")
    (hlen,) = struct.unpack_from("<I", buf, len(MAGIC))
    if hlen > MAX_ENTRY_HEADER or _PREFIX + hlen + _TRAILER > len(buf):
        raise CorruptEntryError("entry header length is out of range")
    try:
        h = json.loads(bytes(buf[_PREFIX : _PREFIX + hlen]))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: hostile "[[[[..."
        raise CorruptEntryError("entry header is not valid JSON") from None
    if not isinstance(h, dict):
        raise CorruptEntryError("entry header is not a JSON object")
    fmt = _int(h, "format", 1)
    if fmt > FORMAT_VERSION:
        raise FormatVersionError(
            f"entry was written by format version {fmt}; this kvstore reads up to {FORMAT_VERSION} - upgrade kvstore"
        )
    for name in ("key", "model", "model_name", "dtype"):
        if not isinstance(h.get(name), str):
            raise CorruptEntryError(f"entry header field {name!r} is missing or invalid")
    if h["dtype"] not in DTYPES or not isinstance(h.get("codec"), dict):
        raise CorruptEntryError("entry header has an unknown dtype or no codec")
    created = h.get("created")
    # a printable date (json.loads also accepts NaN, Infinity and 10**400; datetime stops at 9999)
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not 0 <= created < 2.5e11:
        raise CorruptEntryError("entry header field 'created' is missing or invalid")
    header = EntryHeader(
        key=h["key"],
        model=h["model"],
        model_name=h["model_name"],
        dtype=h["dtype"],
        n_tokens=_int(h, "n_tokens", 1),
        n_layers=_int(h, "n_layers", 1),
        kv_heads=_int(h, "kv_heads", 1),
        head_dim=_int(h, "head_dim", 1),
        codec=h["codec"],
        raw_bytes=_int(h, "raw_bytes"),
        created=float(created),
        format=fmt,
    )
    return header, _PREFIX + hlen


def verify_checksum(buf: bytes | memoryview) -> None:
    """Raise CorruptEntryError unless the trailing xxh3-64 matches the bytes before it."""
    if len(buf) < _PREFIX + _TRAILER:
        raise CorruptEntryError("entry is truncated")
    (want,) = struct.unpack_from("<Q", buf, len(buf) - _TRAILER)
    if xxhash.xxh3_64_intdigest(buf[: len(buf) - _TRAILER]) != want:
        raise CorruptEntryError("entry checksum mismatch (flipped or truncated bytes)")


def decode_entry(
    buf: bytes | memoryview, *, key: str | None = None, threads: int = 1
) -> tuple[EntryHeader, DecodedPayload]:
    """Verify and decode an entry. The returned tensor records may view ``buf``.

    Checks, in order: checksum, header, declared sizes (before allocating anything), the payload's
    tensors against the header (names, shapes, dtypes), and the safetensors metadata against the
    header. ``key``, if given, must match the entry's own key.
    """
    verify_checksum(buf)
    header, offset = read_header(buf)
    if key is not None and header.key != key:
        raise CorruptEntryError(f"entry stored under {key[:12]} says it is {header.key[:12]}")
    payload = memoryview(buf)[offset : len(buf) - _TRAILER]
    data_bytes = header.kv_bytes + 8 * header.n_tokens
    if not data_bytes <= header.raw_bytes <= data_bytes + (16 << 20):
        raise CorruptEntryError("entry declares a size that does not match its shape")
    if header.raw_bytes > MAX_COMPRESSION_RATIO * len(payload) + (1 << 20):
        raise CorruptEntryError("entry declares an implausible compression ratio")
    decoded = decode_payload(payload, header.codec, header.raw_bytes, threads=threads)
    want_names = tensor_names(header.n_layers)
    if sorted(decoded.tensors) != sorted(want_names):
        raise CorruptEntryError("entry holds other tensors than its header describes")
    kv_shape = (header.kv_heads, header.n_tokens, header.head_dim)
    dtype = DTYPES[header.dtype]
    for name in want_names[:-1]:
        rec = decoded.tensors[name]
        if rec.shape != kv_shape or rec.dtype != dtype:
            raise CorruptEntryError(f"tensor {name} is {rec.shape} {rec.dtype}, header says {kv_shape} {dtype}")
    ids = decoded.tensors["token_ids"]
    if ids.shape != (header.n_tokens,) or ids.dtype != torch.int64:
        raise CorruptEntryError("token_ids do not match the header")
    meta = decoded.metadata
    for name in ("key", "model", "dtype", "n_tokens", "n_layers"):
        if meta.get(name) != str(getattr(header, name)):
            raise CorruptEntryError(f"payload metadata {name!r} disagrees with the entry header")
    return header, decoded


def expected_kv_bytes(n_layers: int, kv_heads: int, head_dim: int, n_tokens: int, dtype: str) -> int:
    """Uncompressed bytes of keys and values for one context."""
    return 2 * n_layers * kv_heads * head_dim * n_tokens * DTYPES[dtype].itemsize


__all__ = [
    "FORMAT_VERSION",
    "EntryHeader",
    "decode_entry",
    "dtype_name",
    "encode_entry",
    "expected_kv_bytes",
    "read_header",
    "verify_checksum",
]
