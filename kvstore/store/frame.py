"""The framing every stored entry shares, whatever its kind: seal a header and a payload into a
frame, read a frame's header back, verify its checksum, check the payload's metadata.

::

    magic     8 bytes     b"\\x89KVS\\r\\n\\x1a\\n"
    hlen      u32 LE      length of the header
    header    hlen bytes  canonical JSON (sorted keys); its ``format`` says which header it is
    payload   a codec's output (kvstore.store.codecs): a safetensors file, optionally in zstd frames
    checksum  u64 LE      xxh3-64 of every byte before it

What a header holds is its kind's (:mod:`kvstore.store.kinds`): a chunk's (formats 1 to 4 and 6,
:mod:`kvstore.store.entry`), or an owned entry's (format 5, :mod:`kvstore.store.derived`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import xxhash

from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store.codecs import codec_from_params

# The newest entry format this kvstore reads: 2 (chains of chunks), 3 and 4 (the same layout, written
# by entries whose codec an older reader does not know: 3 for zstd-split, int4r, int8r; 4 for ecq),
# and 5: an entry a context owns (its scores or a pressed cache, :mod:`kvstore.store.derived`), the
# same framing around another header, read only as such (a chunk reader takes it for corrupt; a
# reader of format 4 or older refuses it as "written by format version 5 ... upgrade kvstore"); 6: a
# chunk entry again (the layout of 2-4), written by int4h, which a reader of format 5 does not know;
# 7: the same, written by kvh (keys and values at widths of their own), which a reader of 6 does not know.
# The store's own layout (meta, e/, r/, a/, x/) is STORE_FORMAT, unchanged since format 2: a store
# without owned entries has no x/ keys, and an older kvstore ignores them.
FORMAT_VERSION = 7
CHUNK_FORMAT = 7  # the newest format of a chunk entry
DERIVED_FORMAT = 5
STORE_FORMAT = 2
MAGIC = b"\x89KVS\r\n\x1a\n"
_PREFIX = len(MAGIC) + 4
TRAILER_BYTES = 8
MAX_ENTRY_HEADER = 1 << 20
PEEK_BYTES = 64 << 10  # first read of an entry's header; a longer header is read again in full


def field_int(h: Mapping, name: str, low: int = 0) -> int:
    """The integer field ``name`` of a parsed header, at least ``low``; CorruptEntryError otherwise."""
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise CorruptEntryError(f"entry header field {name!r} is missing or invalid")
    return v


def seal(header: Mapping[str, Any], payload: bytes) -> bytes:
    """A frame: ``header`` as canonical JSON (sorted keys, no spaces) around ``payload``, checksummed."""
    text = json.dumps(dict(header), sort_keys=True, separators=(",", ":")).encode()
    parts = [MAGIC, struct.pack("<I", len(text)), text, payload]
    digest = xxhash.xxh3_64()  # hashed part by part: the frame is joined once (a chunk is ~64 MiB)
    for part in parts:
        digest.update(part)
    return b"".join([*parts, struct.pack("<Q", digest.intdigest())])


def read_frame(buf: bytes | memoryview) -> tuple[dict, int, int]:
    """A frame's header, read without verifying the checksum: ``(header JSON, its format, payload
    offset)``. Raises CorruptEntryError, or FormatVersionError for a format newer than
    :data:`FORMAT_VERSION`."""
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


def payload_of(buf: bytes | memoryview, offset: int) -> memoryview:
    """The payload of a frame whose header ends at ``offset`` (a view, no copy)."""
    return memoryview(buf)[offset : len(buf) - TRAILER_BYTES]


def open_frame(
    buf: bytes | memoryview, read: Callable[[bytes | memoryview], tuple[Any, int]],
    check_sizes: Callable[[Any, Any, int], None], *, key: str | None, threads: int, lazy: bool, checked: bool,
    what: str = "entry",
) -> tuple[Any, Any, Any]:  # fmt: skip
    """The prologue of every kind's decoding: the checksum (unless ``checked``), the header
    (``read``), its key (``key``, if given, must be its own), its declared sizes
    (``check_sizes(header, codec, payload bytes)``, before anything is allocated), then the payload
    unpacked by the header's codec. Returns ``(header, codec, unpacked payload)``; raises
    CorruptEntryError or FormatVersionError."""
    if not checked:
        verify_checksum(buf)
    header, offset = read(buf)
    if key is not None and header.key != key:
        raise CorruptEntryError(f"{what} stored under {key[:12]} says it is {header.key[:12]}")
    payload = payload_of(buf, offset)
    codec = codec_from_params(header.codec)
    check_sizes(header, codec, len(payload))
    return header, codec, codec.packing.unpack(payload, header.codec, header.raw_bytes, threads, lazy)


def verify_checksum(buf: bytes | memoryview) -> None:
    """Raise CorruptEntryError unless the trailing xxh3-64 matches the bytes before it."""
    if len(buf) < _PREFIX + TRAILER_BYTES:
        raise CorruptEntryError("entry is truncated")
    (want,) = struct.unpack_from("<Q", buf, len(buf) - TRAILER_BYTES)
    if xxhash.xxh3_64_intdigest(memoryview(buf)[: len(buf) - TRAILER_BYTES]) != want:  # no copy of the body
        raise CorruptEntryError("entry checksum mismatch (flipped or truncated bytes)")


def check_metadata(meta: Mapping[str, str], header: Any, names: Iterable[str], what: str = "entry") -> None:
    """Raise CorruptEntryError unless the payload's safetensors metadata repeats each of the
    header's fields ``names`` (as strings)."""
    for name in names:
        if meta.get(name) != str(getattr(header, name)):
            raise CorruptEntryError(f"payload metadata {name!r} disagrees with the {what} header")


def peek_frame(backend: Any, name: bytes, read: Callable[[bytes], tuple[Any, int]]) -> tuple[Any, int, int] | None:
    """``(header, payload offset, stored size)`` of the stored value ``name``, its header parsed by
    ``read`` (its kind's ``read_header``) from its first bytes (``backend.peek``: a remote store
    reads no more); None when it is missing. A header longer than the first read is read again in
    full. Raises what ``read`` raises."""
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


__all__ = [
    "CHUNK_FORMAT",
    "DERIVED_FORMAT",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_ENTRY_HEADER",
    "PEEK_BYTES",
    "STORE_FORMAT",
    "TRAILER_BYTES",
    "check_metadata",
    "field_int",
    "open_frame",
    "payload_of",
    "peek_frame",
    "read_frame",
    "seal",
    "verify_checksum",
]
