"""An entry's header and checksum: the part of the format read without decoding the payload
(listings, scans, ``peek``). The whole format is described in :mod:`kvstore.store.entry`."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvstore import dtypes
from kvstore.errors import CorruptEntryError, DtypeError, FormatVersionError
from kvstore.facts import ATTN, FULL_KV_KINDS, KINDS, KV_KINDS, STATE_KINDS, WINDOWED_KINDS
from kvstore.store.codecs import codec_from_params
from kvstore.store.keyspace import is_key

# The newest entry format this kvstore reads: 2 (chains of chunks), 3 and 4 (the same layout, written
# by entries whose codec an older reader does not know: 3 for zstd-split, int4r, int8r; 4 for ecq),
# and 5: a derived entry (a context's scores or pressed cache, :mod:`kvstore.store.derived`), the same
# framing around another header, read only as such (a chunk reader takes it for corrupt; a reader of
# format 4 or older refuses it as "written by format version 5 ... upgrade kvstore"); 6: a chunk entry
# again (the layout of 2-4), written by int4h, which a reader of format 5 does not know.
# The store's own layout (meta, e/, r/, a/, x/) is STORE_FORMAT, unchanged since format 2: a store
# without derived entries has no x/ keys, and an older kvstore ignores them.
FORMAT_VERSION = 6
CHUNK_FORMAT = 6  # the newest format of a chunk entry
DERIVED_FORMAT = 5
STORE_FORMAT = 2
# A chunk ends by this context position at most (a trillion tokens): the rotation of a pre-RoPE codec
# computes angles from positions, which float64 stops counting exactly past 2**53.
MAX_POSITION = 1 << 40
MAGIC = b"\x89KVS\r\n\x1a\n"
_PREFIX = len(MAGIC) + 4
TRAILER_BYTES = 8
MAX_ENTRY_HEADER = 1 << 20
PEEK_BYTES = 64 << 10  # first read of an entry's header; a longer header is read again in full
MAX_COMPRESSION_RATIO = 1000  # a KV cache never compresses this well; a frame that claims to is hostile
MAX_QUANTIZATION_RATIO = 32  # the fewest bits a lossy codec stores per value (int4 of float64) is 16x fewer
STATE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # a state tensor's name in a layer record


@dataclass(frozen=True)
class LayerSpec:
    """What one layer of an entry keeps (see the module docstring)."""

    kind: str = ATTN
    length: int = 0  # tokens of keys/values kept (the last ``length`` of the chunk)
    kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None
    state: tuple[tuple[str, tuple[int, ...], str], ...] = ()  # (name, shape, dtype) of each state tensor

    @property
    def kv_bytes_per_element(self) -> int:
        return 2 * self.length * self.kv_heads * self.head_dim

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind in KV_KINDS:
            out |= {"length": self.length, "kv_heads": self.kv_heads, "head_dim": self.head_dim}
        if self.window is not None:
            out["window"] = self.window
        if self.state:
            out["state"] = {n: {"shape": list(s), "dtype": d} for n, s, d in self.state}
        return out


class CodecOf:
    """What a header's codec record says (a header's ``codec`` params, read when asked; an
    unreadable record gives ``"?"``, lossless and no identity)."""

    codec: Mapping

    @property
    def codec_spec(self) -> str:
        """The codec as a spec string (``zstd-split:1:16``, ``raw``, ``int8:64+zstd:1``...)."""
        return self._codec_fact("spec", "?")

    @property
    def lossless(self) -> bool:
        return self._codec_fact("lossless", True)

    @property
    def identity(self) -> str:
        """The lossy quantizer's spec (part of a key), or ``""``."""
        return self._codec_fact("identity", "")

    def _codec_fact(self, name: str, otherwise: Any) -> Any:
        try:
            return getattr(codec_from_params(self.codec), name)
        except CorruptEntryError:
            return otherwise


@dataclass(frozen=True)
class EntryHeader(CodecOf):
    """What an entry says about itself (parsed from its header, no payload decoding)."""

    key: str
    model: str
    model_name: str
    dtype: str
    n_tokens: int
    layers: tuple[LayerSpec, ...]
    codec: Mapping = field(hash=False, compare=False)
    raw_bytes: int
    created: float
    format: int = CHUNK_FORMAT
    parent: str = ""
    start: int = 0
    numerics: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def end(self) -> int:
        """Context position just after this chunk's last token."""
        return self.start + self.n_tokens

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_heads(self) -> int:
        """KV heads of the first layer that keeps keys and values (0 when none does)."""
        return next((s.kv_heads for s in self.layers if s.kind in KV_KINDS), 0)

    @property
    def head_dim(self) -> int:
        return next((s.head_dim for s in self.layers if s.kind in KV_KINDS), 0)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the keys and values alone, uncompressed, in the model's dtype."""
        return sum(s.kv_bytes_per_element for s in self.layers) * dtypes.bits(self.dtype) // 8

    @property
    def state_bytes(self) -> int:
        total = 0
        for s in self.layers:
            for _, shape, dtype in s.state:
                n = 1
                for d in shape:
                    n *= d
                total += n * dtypes.bits(dtype) // 8
        return total


def check_layer(spec: LayerSpec, n_tokens: int, i: int, error: type[Exception]) -> None:
    """Raise ``error`` unless layer ``i``'s record is consistent for a chunk of ``n_tokens``."""
    if spec.kind not in KINDS:
        raise error(f"layer {i}: unknown kind {spec.kind!r}")
    if spec.kind in KV_KINDS:
        if spec.kv_heads < 1 or spec.head_dim < 1:
            raise error(f"layer {i}: keys and values need kv_heads and head_dim")
        full = spec.kind in FULL_KV_KINDS
        if not 0 <= spec.length <= n_tokens or (full and spec.length != n_tokens):
            raise error(f"layer {i}: {spec.kind} layer keeps {spec.length} of the chunk's {n_tokens} tokens")
    elif spec.length or spec.kv_heads or spec.head_dim:
        raise error(f"layer {i}: a state layer keeps no keys and values")
    if (spec.kind in STATE_KINDS) != bool(spec.state):
        raise error(f"layer {i}: {spec.kind} layer {'needs' if spec.kind in STATE_KINDS else 'has no'} state tensors")
    if (spec.kind in WINDOWED_KINDS) != (spec.window is not None) or (spec.window is not None and spec.window < 1):
        raise error(f"layer {i}: only sliding and chunked layers have a window")


def field_int(h: Mapping, name: str, low: int = 0) -> int:
    """The integer field ``name`` of a parsed header, at least ``low``; CorruptEntryError otherwise."""
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise CorruptEntryError(f"entry header field {name!r} is missing or invalid")
    return v


def _layers_v2(h: Mapping, n_tokens: int) -> tuple[LayerSpec, ...]:
    raw = h.get("layers")
    if not isinstance(raw, list) or not raw:
        raise CorruptEntryError("entry header lists no layers")
    specs = []
    for i, r in enumerate(raw):
        if not isinstance(r, dict) or not isinstance(r.get("kind"), str):
            raise CorruptEntryError(f"entry header layer {i} is malformed")
        kind = r["kind"]
        has_kv = kind in KV_KINDS
        state: list[tuple[str, tuple[int, ...], str]] = []
        raw_state = r.get("state", {})
        if not isinstance(raw_state, dict):
            raise CorruptEntryError(f"entry header layer {i} has a malformed state")
        for name, t in sorted(raw_state.items()):
            try:
                shape = tuple(int(d) for d in t["shape"])
                if not STATE_NAME.match(name) or any(d < 0 for d in shape) or len(shape) > 8:
                    raise ValueError
                state.append((name, shape, dtypes.name(t["dtype"])))
            except (KeyError, TypeError, ValueError, OverflowError, DtypeError):
                raise CorruptEntryError(f"entry header layer {i} has a malformed state tensor {name!r}") from None
        window = r.get("window")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
            raise CorruptEntryError(f"entry header layer {i} has a malformed window")
        spec = LayerSpec(
            kind, field_int(r, "length") if has_kv else 0, field_int(r, "kv_heads", 1) if has_kv else 0,
            field_int(r, "head_dim", 1) if has_kv else 0, window, tuple(state),
        )  # fmt: skip
        check_layer(spec, n_tokens, i, CorruptEntryError)
        specs.append(spec)
    return tuple(specs)


def read_frame(buf: bytes | memoryview) -> tuple[dict, int, int]:
    """The framing every stored entry shares (magic, header length, canonical JSON header), read
    without verifying the checksum: ``(header JSON, its format, payload offset)``. Raises
    CorruptEntryError, or FormatVersionError for a format newer than :data:`FORMAT_VERSION`."""
    if len(buf) < _PREFIX + TRAILER_BYTES or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise CorruptEntryError("not a kvstore entry (bad magic or too short)")
    (hlen,) = struct.unpack_from("<I", buf, len(MAGIC))
    if hlen > MAX_ENTRY_HEADER or _PREFIX + hlen + TRAILER_BYTES > len(buf):
        raise CorruptEntryError("entry header length is out of range")
    try:
        h = json.loads(bytes(buf[_PREFIX : _PREFIX + hlen]))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: hostile "[[[[..."
        raise CorruptEntryError("entry header is not valid JSON") from None
    if not isinstance(h, dict):
        raise CorruptEntryError("entry header is not a JSON object")
    fmt = field_int(h, "format", 1)
    if fmt > FORMAT_VERSION:
        raise FormatVersionError(
            f"entry was written by format version {fmt}; this kvstore reads up to {FORMAT_VERSION} - upgrade kvstore"
        )
    return h, fmt, _PREFIX + hlen


def check_facts(h: Mapping, names: tuple[str, ...] = ("key", "model", "model_name", "dtype")) -> float:
    """Check the fields every entry header has (the string ``names``, a known KV ``dtype``, a
    ``codec`` record, a printable ``created``); returns ``created``. Raises CorruptEntryError."""
    for name in names:
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
    return float(created)


def read_header(buf: bytes | memoryview) -> tuple[EntryHeader, int]:
    """Parse a chunk entry's header (formats 1 to 4 and 6) without verifying the checksum.

    Returns ``(header, payload_offset)``. Raises CorruptEntryError (a derived entry, format 5, is
    not a chunk) or FormatVersionError."""
    h, fmt, offset = read_frame(buf)
    if fmt == DERIVED_FORMAT:
        raise CorruptEntryError("a derived entry (format 5) is stored where a chunk belongs")
    created = check_facts(h)
    n_tokens = field_int(h, "n_tokens", 1)
    if fmt == 1:
        spec = LayerSpec(ATTN, n_tokens, field_int(h, "kv_heads", 1), field_int(h, "head_dim", 1))
        layers = (spec,) * field_int(h, "n_layers", 1)
        parent, start, numerics = "", 0, {}  # type: ignore[var-annotated]
    else:
        layers = _layers_v2(h, n_tokens)
        parent, start, numerics = h.get("parent"), field_int(h, "start"), h.get("numerics")  # type: ignore[assignment]
        if start + n_tokens > MAX_POSITION:
            raise CorruptEntryError("entry header field 'start' is out of range")
        if not isinstance(parent, str) or (parent and not is_key(parent)):
            raise CorruptEntryError("entry header field 'parent' is missing or invalid")
        if not isinstance(numerics, dict) or not all(isinstance(v, str) for v in numerics.values()):
            raise CorruptEntryError("entry header field 'numerics' is missing or invalid")
    header = EntryHeader(
        key=h["key"],
        model=h["model"],
        model_name=h["model_name"],
        dtype=h["dtype"],
        n_tokens=n_tokens,
        layers=layers,
        codec=h["codec"],
        raw_bytes=field_int(h, "raw_bytes"),
        created=created,
        format=fmt,
        parent=parent,
        start=start,
        numerics=numerics,
    )
    return header, offset


def check_sizes(header: EntryHeader, payload_bytes: int, lossless: bool | None = None) -> None:
    """Raise CorruptEntryError unless the sizes a header declares agree with each other: its
    uncompressed size with the shapes it lists, and both with the ``payload_bytes`` actually
    stored. Decoding checks this before allocating anything, and listings before they show a
    size, so that a forged header cannot claim petabytes. ``lossless``: the header's codec's, when
    the caller knows it (a scan parses each codec once)."""
    data_bytes = header.kv_bytes + header.state_bytes + 8 * header.n_tokens
    lossless = header.lossless if lossless is None else lossless
    if header.raw_bytes > data_bytes + (16 << 20) or (lossless and header.raw_bytes < data_bytes):
        raise CorruptEntryError("entry declares a size that does not match its shape")
    if data_bytes > MAX_QUANTIZATION_RATIO * header.raw_bytes + (16 << 20):
        raise CorruptEntryError("entry declares a size that does not match its shape")
    if header.raw_bytes > MAX_COMPRESSION_RATIO * payload_bytes + (1 << 20):
        raise CorruptEntryError("entry declares an implausible compression ratio")


def peek_frame(backend: Any, name: bytes, read: Callable[[bytes], tuple[Any, int]]) -> tuple[Any, int, int] | None:
    """``(header, payload offset, stored size)`` of the stored value ``name``, its header parsed by
    ``read`` (:func:`read_header`, or a derived entry's) from its first bytes (``backend.peek``: a
    remote store reads no more); None when it is missing. A header longer than the first read is
    read again in full. Raises what ``read`` raises."""
    got = backend.peek(name, PEEK_BYTES)
    if got is None:
        return None
    head, size = got
    try:
        header, offset = read(head)
    except CorruptEntryError:
        if size <= len(head):
            raise
        # a header longer than the first read (or a truncated entry): read as much as one can hold
        got = backend.peek(name, MAX_ENTRY_HEADER + 64)
        if got is None:
            return None
        (header, offset), size = read(got[0]), got[1]
    return header, offset, size


def verify_checksum(buf: bytes | memoryview) -> None:
    """Raise CorruptEntryError unless the trailing xxh3-64 matches the bytes before it."""
    if len(buf) < _PREFIX + TRAILER_BYTES:
        raise CorruptEntryError("entry is truncated")
    (want,) = struct.unpack_from("<Q", buf, len(buf) - TRAILER_BYTES)
    if xxhash.xxh3_64_intdigest(memoryview(buf)[: len(buf) - TRAILER_BYTES]) != want:  # no copy of the body
        raise CorruptEntryError("entry checksum mismatch (flipped or truncated bytes)")


__all__ = [
    "CHUNK_FORMAT",
    "DERIVED_FORMAT",
    "FORMAT_VERSION",
    "MAX_COMPRESSION_RATIO",
    "MAX_QUANTIZATION_RATIO",
    "STORE_FORMAT",
    "MAGIC",
    "MAX_ENTRY_HEADER",
    "TRAILER_BYTES",
    "STATE_NAME",
    "EntryHeader",
    "LayerSpec",
    "check_layer",
    "CodecOf",
    "check_facts",
    "check_sizes",
    "field_int",
    "peek_frame",
    "read_frame",
    "read_header",
    "verify_checksum",
]
