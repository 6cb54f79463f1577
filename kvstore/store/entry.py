"""The on-disk entry format (version 1): one stored value per context.

::

    magic     8 bytes   b"\\x89KVS\\r\\n\\x1a\\n"
    hlen      u32 LE    length of the header
    header    hlen bytes  canonical JSON (sorted keys): format, key, model, model_name, dtype,
                          n_tokens, n_layers, kv_heads, head_dim, codec params, raw_bytes, created
    payload   codec output (see kvstore.store.codecs): a safetensors file, optionally in zstd frames,
              holding ``layers.{i}.keys`` / ``layers.{i}.values`` ``[kv_heads, n_tokens, head_dim]``
              (or their quantized parts) and ``token_ids`` ``[n_tokens]`` int64, with the same facts
              in its ``__metadata__``
    checksum  u64 LE    xxh3-64 of every byte before it

The checksum is verified on every load before anything is decoded; the header alone (no checksum
pass, no decompression) is enough for listings. Anything inconsistent is a CorruptEntryError.

:class:`Entry` is a context's cache materialized in memory (what gets encoded);
:class:`EntryView` is a verified stored entry seen without copying (what the load path reads).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from kvstore import dtypes
from kvstore.errors import CorruptEntryError, DtypeError, FormatVersionError
from kvstore.store.codecs import Codec, StoredTensor, TensorRecord, codec_from_params, get_codec

FORMAT_VERSION = 1
MAGIC = b"\x89KVS\r\n\x1a\n"
_PREFIX = len(MAGIC) + 4
_TRAILER = 8
MAX_ENTRY_HEADER = 1 << 20
MAX_COMPRESSION_RATIO = 1000  # a KV cache never compresses this well; a frame that claims to is hostile


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
        """The codec as a spec string (``zstd-shuffle:1``, ``raw``...)."""
        try:
            return codec_from_params(self.codec).spec
        except CorruptEntryError:
            return "?"

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values alone, uncompressed."""
        return dtypes.kv_bytes(self.n_layers * self.n_tokens, self.kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True)
class Entry:
    """One context's KV cache, materialized: ``layers[i] = (keys, values)`` each
    ``[kv_heads, n_tokens, head_dim]``; ``token_ids`` ``[n_tokens]`` int64."""

    key: str
    model: str
    model_name: str
    token_ids: torch.Tensor
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    created: float = field(default_factory=time.time)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0][0].dtype

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def to_dynamic_cache(self, device: torch.device | str | None = None, config: Any = None):
        """A ``transformers.DynamicCache`` holding this context (batch of 1), ready for
        ``model.generate(input_ids=context_ids + question_ids, past_key_values=cache)``."""
        from transformers import DynamicCache

        device = torch.device(device) if device is not None else self.layers[0][0].device
        data = [(k.unsqueeze(0).to(device), v.unsqueeze(0).to(device)) for k, v in self.layers]
        return DynamicCache(data, config=config) if config is not None else DynamicCache(data)


@dataclass(frozen=True)
class EntryView:
    """A verified entry seen without copying. ``records`` are every stored tensor (views into the
    stored or decompressed bytes); ``layers[i]`` reads layer ``i``'s keys and values through the
    entry's codec. Valid only while the buffer it was decoded from is (``KVStore.open_entry``)."""

    header: EntryHeader
    records: Mapping[str, TensorRecord]
    layers: tuple[tuple[StoredTensor, StoredTensor], ...]

    def layer(self, i: int) -> tuple[StoredTensor, StoredTensor]:
        return self.layers[i]

    def token_ids(self) -> list[int]:
        return self.records["token_ids"].materialize().tolist()

    def materialize(self) -> Entry:
        h = self.header
        layers = tuple((k.materialize(), v.materialize()) for k, v in self.layers)
        return Entry(h.key, h.model, h.model_name, self.records["token_ids"].materialize(), layers, h.created)


def kv_tensor_name(layer: int, role: str) -> str:
    return f"layers.{layer}.{role}"


def encode_entry(entry: Entry, codec: Codec | str | None = None) -> bytes:
    """Serialize ``entry``: per layer ``(keys, values)`` ``[kv_heads, n_tokens, head_dim]`` (a
    leading batch dim of 1 is accepted), all of one float dtype. Returns the bytes to store."""
    codec = get_codec(codec)
    ids = torch.as_tensor(entry.token_ids, dtype=torch.int64).reshape(-1).cpu()
    n_tokens = int(ids.numel())
    tensors: list[tuple[str, torch.Tensor, str | None]] = []
    shape0: tuple[int, ...] | None = None
    dtype = None
    for i, (k, v) in enumerate(entry.layers):
        k = k[0] if k.dim() == 4 else k
        v = v[0] if v.dim() == 4 else v
        if shape0 is None:
            shape0, dtype = tuple(k.shape), k.dtype
        for t in (k, v):
            if t.dim() != 3 or tuple(t.shape) != shape0 or t.dtype != dtype or t.shape[1] != n_tokens:
                raise ValueError(
                    f"layer {i}: expected [kv_heads, {n_tokens}, head_dim] {dtype} like layer 0 {shape0}, got "
                    f"{tuple(t.shape)} {t.dtype}"
                )
        tensors += [(kv_tensor_name(i, "keys"), k, "keys"), (kv_tensor_name(i, "values"), v, "values")]
    if shape0 is None:
        raise ValueError("an entry needs at least one layer")
    tensors.append(("token_ids", ids, None))
    created = time.time() if entry.created is None else entry.created
    facts = {
        "format": FORMAT_VERSION,
        "key": entry.key,
        "model": entry.model,
        "model_name": entry.model_name,
        "dtype": dtypes.parse_kv(dtype),
        "n_tokens": n_tokens,
        "n_layers": len(entry.layers),
        "kv_heads": shape0[0],
        "head_dim": shape0[2],
        "created": round(created, 6),
    }
    metadata = {k: str(v) for k, v in facts.items()} | {"codec": codec.spec}
    payload, params, raw_bytes = codec.encode(tensors, metadata)
    header = json.dumps(
        facts | {"codec": params, "raw_bytes": raw_bytes}, sort_keys=True, separators=(",", ":")
    ).encode()
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
    try:
        dtypes.parse_kv(h["dtype"])
    except DtypeError:
        raise CorruptEntryError("entry header has an unknown dtype") from None
    if not isinstance(h.get("codec"), dict):
        raise CorruptEntryError("entry header has no codec")
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


def decode_entry(buf: bytes | memoryview, *, key: str | None = None, threads: int = 1) -> EntryView:
    """Verify and decode an entry. The returned view's records may view ``buf``.

    Checks, in order: checksum, header, declared sizes (before allocating anything), the payload's
    tensors against the header (names, shapes, dtypes), and the safetensors metadata against the
    header. ``key``, if given, must match the entry's own key.
    """
    verify_checksum(buf)
    header, offset = read_header(buf)
    if key is not None and header.key != key:
        raise CorruptEntryError(f"entry stored under {key[:12]} says it is {header.key[:12]}")
    payload = memoryview(buf)[offset : len(buf) - _TRAILER]
    codec = codec_from_params(header.codec)
    dtype = dtypes.to_torch(header.dtype)
    if codec.lossless:
        data_bytes = header.kv_bytes + 8 * header.n_tokens
        if not data_bytes <= header.raw_bytes <= data_bytes + (16 << 20):
            raise CorruptEntryError("entry declares a size that does not match its shape")
    elif header.raw_bytes > header.kv_bytes + 8 * header.n_tokens + (16 << 20):
        raise CorruptEntryError("entry declares a size that does not match its shape")
    if header.raw_bytes > MAX_COMPRESSION_RATIO * len(payload) + (1 << 20):
        raise CorruptEntryError("entry declares an implausible compression ratio")
    decoded = codec.packing.unpack(payload, header.codec, header.raw_bytes, threads)
    records = decoded.tensors
    want = ["token_ids"]
    for i in range(header.n_layers):
        for role in ("keys", "values"):
            want += codec.quantizer.stored_names(kv_tensor_name(i, role))
    if sorted(records) != sorted(want):
        raise CorruptEntryError("entry holds other tensors than its header describes")
    kv_shape = (header.kv_heads, header.n_tokens, header.head_dim)
    layers = tuple(
        tuple(
            codec.quantizer.reader(role, kv_tensor_name(i, role), records, kv_shape, dtype)
            for role in ("keys", "values")
        )
        for i in range(header.n_layers)
    )
    ids = records["token_ids"]
    if ids.shape != (header.n_tokens,) or ids.dtype != torch.int64:
        raise CorruptEntryError("token_ids do not match the header")
    meta = decoded.metadata
    for name in ("key", "model", "dtype", "n_tokens", "n_layers"):
        if meta.get(name) != str(getattr(header, name)):
            raise CorruptEntryError(f"payload metadata {name!r} disagrees with the entry header")
    return EntryView(header, records, layers)  # type: ignore[arg-type]


__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Entry",
    "EntryHeader",
    "EntryView",
    "decode_entry",
    "encode_entry",
    "read_header",
    "verify_checksum",
]
