"""The header of an entry a context owns (a derived entry): the part of format 5 read without
decoding the payload (listings, scans), and its key. The whole format is described in
:mod:`kvstore.store.owned`; what differs between kinds (their layer records, sizes and tensors)
is each kind's (:mod:`kvstore.store.kinds`)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import CorruptEntryError
from kvstore.store.codecs import Codec
from kvstore.store.frame import DERIVED_FORMAT, field_int, read_frame
from kvstore.store.header import MAX_COMPRESSION_RATIO, MAX_POSITION, MAX_QUANTIZATION_RATIO, HeaderFacts, check_facts
from kvstore.store.keyspace import is_key
from kvstore.store.kinds import kind_of

KEY_VERSION = 1  # of owned_key_of's hashed layout
SCORE_DTYPES = ("float32", "float64")
MAX_SPEC = 1024  # characters of a scorer or press spec
MAX_PRESS_DEPTH = 8  # nesting of the press record's objects


def owned_key_of(context: str, kind: str, spec: str, identity: str) -> str:
    """The key (sha256 hex) of the derived entry of kind ``kind`` (``scores`` or ``pressed``) made
    by ``spec`` from the context ``context``, under the lossy codec ``identity`` (``""``: lossless;
    always ``""`` for scores)."""
    h = hashlib.sha256()
    h.update(b"kvstore-derived\x00")
    h.update(KEY_VERSION.to_bytes(4, "little"))
    for part in (context, kind, spec, identity):
        h.update(part.encode() + b"\x00")
    return h.hexdigest()


@dataclass(frozen=True)
class OwnedFacts:
    """What ties a derived entry to its model and context: the context's key (its chain's last
    chunk key), the model's fingerprint and name, the model's KV dtype (``float32``...), the
    context's tokens and the numerics the context was computed with (device, attention...)."""

    context: str
    model: str
    model_name: str
    dtype: str
    n_tokens: int
    numerics: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class OwnedLayer:
    """One layer of a built-in kind's entry (scores, a pressed cache): its KV heads, head size (0
    for scores) and, for a pressed cache, each head's count of kept tokens. Another kind reads
    its layer records into a type of its own (its ``layer``)."""

    kv_heads: int
    head_dim: int = 0
    counts: tuple[int, ...] | None = None

    @property
    def kept(self) -> int:
        return sum(self.counts or ())

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kv_heads": self.kv_heads}
        if self.counts is not None:
            out |= {"head_dim": self.head_dim, "counts": list(self.counts)}
        return out


@dataclass(frozen=True, kw_only=True)
class OwnedHeader(HeaderFacts):
    """What an owned entry says about itself (parsed from its header; see the module docstring):
    the fields every kind shares, ``layers`` (its kind's layer records, as the kind's ``layer``
    reads them) and ``fields`` (the kind's own header fields, as its ``check_header`` reads them
    back: a scores entry's ``scores_dtype``)."""

    context: str
    kind: str
    spec: str
    layers: tuple[Any, ...]
    raw_bytes: int = 0
    created: float = 0.0
    format: int = DERIVED_FORMAT
    press: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def scores_dtype(self) -> str:
        """A scores entry's ``fields["scores_dtype"]`` (``""`` for other kinds)."""
        return self.fields.get("scores_dtype", "")

    @property
    def kept_pairs(self) -> int:
        """(token, head) pairs kept over every layer (a kind's that keeps a part; else 0)."""
        return kind_of(self.kind).kept_pairs(self)

    @property
    def kept_fraction(self) -> float:
        """``kept_pairs`` over layers x heads x tokens (1.0 for a kind that keeps its whole context,
        as scores do)."""
        return kind_of(self.kind).kept_fraction(self)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the stored values alone, uncompressed (the kind's: a pressed cache's kept keys
        and values in the model's dtype, or the scores in theirs)."""
        return kind_of(self.kind).value_bytes(self)

    @property
    def data_bytes(self) -> int:
        """Bytes of every stored tensor, uncompressed: :attr:`kv_bytes` and what else the kind
        stores (a pressed cache's positions, int32 each)."""
        return kind_of(self.kind).data_bytes(self)


# -- the header ----------------------------------------------------------------------------------------
def check_press(value: Any, depth: int = 0) -> bool:
    """Whether a press record ``value`` is JSON made of scalars (finite numbers), objects and arrays."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if depth >= MAX_PRESS_DEPTH:
        return False
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and check_press(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(check_press(v, depth + 1) for v in value)
    return False


def _layers(raw: Any, kind: Any, n_tokens: int) -> tuple[Any, ...]:
    if not isinstance(raw, list) or not raw:
        raise CorruptEntryError("derived entry header lists no layers")
    out = []
    for i, r in enumerate(raw):
        if not isinstance(r, dict):
            raise CorruptEntryError(f"derived entry header layer {i} is malformed")
        out.append(kind.layer(r, n_tokens, i))
    return tuple(out)


def read_owned_header(buf: bytes | memoryview) -> tuple[OwnedHeader, int]:
    """Parse a derived entry's header without verifying the checksum: ``(header, payload
    offset)``. Raises CorruptEntryError (a chunk entry is not a derived one) or FormatVersionError."""
    h, fmt, offset = read_frame(buf)
    if fmt != DERIVED_FORMAT:
        raise CorruptEntryError(f"a chunk entry (format {fmt}) is stored where a derived entry belongs")
    created = check_facts(h, ("key", "context", "kind", "spec", "model", "model_name", "dtype"))
    spec, kind = h["spec"], kind_of(h["kind"])
    if not is_key(h["key"]) or not is_key(h["context"]):
        raise CorruptEntryError("derived entry header field 'key' or 'context' is not a key")
    if not spec or len(spec) > MAX_SPEC:
        raise CorruptEntryError("derived entry header field 'spec' is missing or invalid")
    n_tokens = field_int(h, "n_tokens", 1)
    if n_tokens > MAX_POSITION:
        raise CorruptEntryError("derived entry header field 'n_tokens' is out of range")
    numerics, press = h.get("numerics"), h.get("press")
    if not isinstance(numerics, dict) or not all(isinstance(v, str) for v in numerics.values()):
        raise CorruptEntryError("derived entry header field 'numerics' is missing or invalid")
    if not isinstance(press, dict) or not check_press(press):
        raise CorruptEntryError("derived entry header field 'press' is not an object of JSON values")
    fields = kind.check_header(h)
    header = OwnedHeader(
        key=h["key"], context=h["context"], kind=kind.name, spec=spec, model=h["model"], model_name=h["model_name"],
        dtype=h["dtype"], n_tokens=n_tokens, layers=_layers(h.get("layers"), kind, n_tokens), codec=h["codec"],
        raw_bytes=field_int(h, "raw_bytes"), created=created, format=fmt, numerics=numerics, press=press,
        fields=fields,
    )  # fmt: skip
    return header, offset


def check_key_and_sizes(header: OwnedHeader, codec: Codec, payload_bytes: int) -> None:
    """The sizes a header declares agree with each other and with the stored bytes (before
    anything is allocated), and its key is its own: see the module docstring."""
    want = owned_key_of(header.context, header.kind, header.spec, codec.identity)
    if header.key != want or (kind_of(header.kind).lossless_only and not codec.lossless):
        raise CorruptEntryError("derived entry's key does not match its context, kind, spec and codec")
    data = header.data_bytes
    if header.raw_bytes > data + (16 << 20) or (codec.lossless and header.raw_bytes < data):
        raise CorruptEntryError("derived entry declares a size that does not match its shape")
    if data > MAX_QUANTIZATION_RATIO * header.raw_bytes + (16 << 20):
        raise CorruptEntryError("derived entry declares a size that does not match its shape")
    if header.raw_bytes > MAX_COMPRESSION_RATIO * payload_bytes + (1 << 20):
        raise CorruptEntryError("derived entry declares an implausible compression ratio")


def scores_name(layer: int) -> str:
    """The payload name of layer ``layer``'s scores (a scores entry)."""
    return f"layers.{layer}.scores"


def positions_name(layer: int) -> str:
    """The payload name of layer ``layer``'s kept positions (a pressed cache)."""
    return f"layers.{layer}.positions"


def head_name(layer: int, head: int, role: str) -> str:
    """The payload name of a pressed cache's kept ``keys`` or ``values`` of one head."""
    return f"layers.{layer}.heads.{head}.{role}"


# deprecated: the names they had
DerivedFacts = OwnedFacts
DerivedHeader = OwnedHeader
DerivedLayer = OwnedLayer
derived_key_of, read_derived_header = owned_key_of, read_owned_header

__all__ = [
    "MAX_SPEC",
    "SCORE_DTYPES",
    "OwnedFacts",
    "OwnedHeader",
    "OwnedLayer",
    "check_key_and_sizes",
    "check_press",
    "owned_key_of",
    "head_name",
    "positions_name",
    "read_owned_header",
    "scores_name",
]
