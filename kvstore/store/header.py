"""A chunk entry's header: the part of the format read without decoding the payload (listings,
scans, ``peek``). The whole format is described in :mod:`kvstore.store.entry`; the framing every
kind of entry shares (magic, header length, checksum) in :mod:`kvstore.store.frame`."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore import dtypes
from kvstore.errors import CorruptEntryError, DtypeError
from kvstore.facts import ATTN, FULL_KV_KINDS, KINDS, KV_KINDS, STATE_KINDS, WINDOWED_KINDS
from kvstore.store.codecs import codec_from_params
from kvstore.store.frame import CHUNK_FORMAT, DERIVED_FORMAT, field_int, read_frame

# the framing's names, importable from here as before (their home is kvstore.store.frame)
from kvstore.store.frame import FORMAT_VERSION as FORMAT_VERSION
from kvstore.store.frame import MAGIC as MAGIC
from kvstore.store.frame import MAX_ENTRY_HEADER as MAX_ENTRY_HEADER
from kvstore.store.frame import STORE_FORMAT as STORE_FORMAT
from kvstore.store.frame import TRAILER_BYTES as TRAILER_BYTES
from kvstore.store.frame import peek_frame as peek_frame
from kvstore.store.frame import verify_checksum as verify_checksum
from kvstore.store.keyspace import is_key

# A chunk ends by this context position at most (a trillion tokens): the rotation of a pre-RoPE codec
# computes angles from positions, which float64 stops counting exactly past 2**53.
MAX_POSITION = 1 << 40
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


@dataclass(frozen=True, kw_only=True)
class HeaderFacts(CodecOf):
    """What the header of every kind of entry says (built by keyword): its own key, the model's
    fingerprint, name and KV dtype, its tokens, its codec record and the numerics it was computed
    with."""

    key: str
    model: str
    model_name: str
    dtype: str
    n_tokens: int
    codec: Mapping = field(hash=False, compare=False)
    numerics: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class EntryHeader(HeaderFacts):
    """What a chunk entry says about itself (parsed from its header, no payload decoding)."""

    layers: tuple[LayerSpec, ...]
    raw_bytes: int
    created: float
    format: int = CHUNK_FORMAT
    parent: str = ""
    start: int = 0

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


_local = threading.local()


def _layers_v2(h: Mapping, n_tokens: int) -> tuple[LayerSpec, ...]:
    """The header's layer records, validated. The chunks of a chain list the same layers: the last
    records validated on this thread are kept with the ``repr`` of the JSON they came from (which
    tells ``1`` from ``true`` and ``1.0``), and the same text for the same ``n_tokens`` reuses
    them instead of validating again."""
    raw = h.get("layers")
    if not isinstance(raw, list) or not raw:
        raise CorruptEntryError("entry header lists no layers")
    try:
        text = repr(raw)
    except RecursionError:  # hostile nesting json.loads let through: validated (and refused) below
        return _validate_layers(raw, n_tokens)
    last = getattr(_local, "layers", None)
    if last is not None and last[0] == n_tokens and last[1] == text:
        return last[2]
    specs = _validate_layers(raw, n_tokens)
    _local.layers = (n_tokens, text, specs)
    return specs


def _validate_layers(raw: list, n_tokens: int) -> tuple[LayerSpec, ...]:
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


__all__ = [
    "MAX_COMPRESSION_RATIO",
    "MAX_POSITION",
    "MAX_QUANTIZATION_RATIO",
    "STATE_NAME",
    "EntryHeader",
    "HeaderFacts",
    "LayerSpec",
    "check_layer",
    "CodecOf",
    "check_facts",
    "check_sizes",
    "read_header",
]
