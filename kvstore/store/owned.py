"""Owned entries, the entries a context owns: what is computed from one stored context and stored
beside it (format 5; the whole format: docs/format.md).

An owned entry belongs to one context, named by the context's key (its chain's last chunk key),
and is of one kind in the table of kinds (:mod:`kvstore.store.kinds`). Each kind's module holds
its layer records, its own header fields, its tensors, its view and its encoder (the built-in
ones: :mod:`kvstore.store.kind_scores`, a press's per-token scores; :mod:`kvstore.store.kind_pressed`,
a pressed cache); this module holds what they share: the header every kind writes
(:func:`owned_header`), the encoding (:func:`encode_owned`), the decoding (:func:`decode_owned`:
the kind's view), the built-in kinds' view (:class:`OwnedView`) and the half of a kind every owned
kind shares (:class:`OwnedKindBase`).

**Key.** :func:`owned_key_of`: sha256 of ``b"kvstore-derived\\0" ‖ u32le(1) ‖ context\\0 ‖ kind\\0 ‖
spec\\0 ‖ identity\\0`` (``identity``: the lossy codec's :attr:`~kvstore.store.codecs.Codec.identity`,
``""`` for a lossless codec). The backend keeps it under ``x/<context>/<key>``
(:mod:`kvstore.store.keyspace`); its last use under ``a/<key>``, as for chunks.

**Bytes.** The framing every entry shares (:mod:`kvstore.store.frame`) with ``"format": 5``. Header:
``format``, ``key``, ``context``, ``kind``, ``spec``, ``model`` (fingerprint), ``model_name``,
``dtype`` (the model's), ``numerics``, ``n_tokens`` (the context's), ``layers`` (one record per
layer, the kind's), ``codec``, ``raw_bytes``, ``created``, ``press`` (a JSON object saying what made
it, shown by ``ls``), and the kind's own fields (a scores entry's ``scores_dtype``).

Decoding verifies the checksum first, then checks every declared size against the header before
anything is allocated, the header's key against its own context, kind, spec and codec, and every
tensor against the header (the kind's): anything inconsistent is a CorruptEntryError (a miss,
recomputed by the caller); a newer format is a FormatVersionError.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from kvstore import dtypes
from kvstore.errors import CorruptEntryError
from kvstore.store.codecs import Codec, StoredTensor, TensorRecord, codec_from_params
from kvstore.store.codecs.base import encode_named
from kvstore.store.frame import DERIVED_FORMAT, check_metadata, open_frame, seal
from kvstore.store.header import MAX_POSITION
from kvstore.store.keyspace import is_key, owned_key
from kvstore.store.kinds import kind_of

# the header and key live in owned_header (read by listings without this module's decoding);
# they are importable from here too, with the rest of the API (and their deprecated names)
from kvstore.store.owned_header import (  # noqa: F401
    MAX_SPEC,
    SCORE_DTYPES,
    DerivedFacts,
    DerivedHeader,
    DerivedLayer,
    OwnedFacts,
    OwnedHeader,
    OwnedLayer,
    check_key_and_sizes,
    check_press,
    derived_key_of,
    head_name,
    owned_key_of,
    positions_name,
    read_derived_header,
    read_owned_header,
    scores_name,
)

# the built-in kinds' names (their objects: kvstore.store.kinds)
SCORES, PRESSED = "scores", "pressed"
L = TypeVar("L")  # a kind's layer record
V = TypeVar("V")  # a kind's view of a verified entry
# the header fields the payload's metadata repeats
_METADATA = ("key", "context", "kind", "spec", "model", "dtype", "n_tokens", "n_layers")


# -- encoding ------------------------------------------------------------------------------------------
def owned_header(facts: OwnedFacts, kind: str, spec: str, press: Mapping) -> dict[str, Any]:
    """The header fields every owned entry has (all but its key and layers), checked: raises
    ValueError for a context that is not a key, an empty or overlong ``spec``, a ``press`` that is
    not an object of JSON values, or a context of no tokens."""
    if not is_key(facts.context):
        raise ValueError(f"context {facts.context!r} is not a key (64 lowercase hex digits)")
    if not isinstance(spec, str) or not spec or len(spec) > MAX_SPEC:
        raise ValueError(f"spec must be a non-empty string of at most {MAX_SPEC} characters")
    if not isinstance(press, Mapping) or not check_press(press):
        raise ValueError("press must be an object of JSON scalars, objects and arrays (finite numbers)")
    if facts.n_tokens < 1 or facts.n_tokens > MAX_POSITION:
        raise ValueError(f"a context has 1 to {MAX_POSITION} tokens, not {facts.n_tokens}")
    return {
        "format": DERIVED_FORMAT, "context": facts.context, "kind": kind, "spec": spec, "model": facts.model,
        "model_name": facts.model_name, "dtype": dtypes.parse_kv(facts.dtype), "numerics": dict(facts.numerics),
        "n_tokens": facts.n_tokens, "press": json.loads(json.dumps(dict(press))), "created": round(time.time(), 6),
    }  # fmt: skip


def _seal(header: dict[str, Any], codec: Codec, tensors: list, positions: Mapping[str, torch.Tensor]) -> bytes:
    """The entry's bytes: each KV tensor through the quantizer at its kept positions, the payload
    ordered by element size, largest first (so that a raw payload keeps every tensor aligned
    whatever the counts), through the packing."""
    metadata = {k: str(header[k]) for k in ("format", *_METADATA[:-1])}
    metadata |= {"n_layers": str(len(header["layers"])), "codec": codec.spec}
    stored: list[tuple[str, torch.Tensor]] = []
    for name, tensor, role in tensors:
        if role is None:
            stored.append((name, tensor))
        else:
            stored += [
                (name + s, t) for s, t in encode_named(codec.quantizer, name, role, tensor, positions=positions[name])
            ]
    stored.sort(key=lambda item: -item[1].element_size())
    payload, packing_params, raw_bytes = codec.packing.pack(stored, metadata)
    return seal(header | {"codec": codec.params(packing_params), "raw_bytes": raw_bytes}, payload)


def encode_owned(
    header: dict[str, Any], layers: list[dict[str, Any]], tensors: list, codec: Codec,
    positions: Mapping[str, torch.Tensor] | None = None, fields: Mapping[str, Any] | None = None,
) -> tuple[str, bytes]:  # fmt: skip
    """An owned entry of any kind as ``(key, bytes to store)``: ``header`` from :func:`owned_header`,
    its ``layers`` records (as the kind's ``layer`` reads them back), ``tensors`` ``(name, tensor,
    role)`` (``role`` ``"keys"``/``"values"``: through ``codec``'s quantizer at ``positions[name]``;
    None: stored as they are), the kind's own header ``fields``. The key names the context, kind,
    spec and ``codec``'s identity."""
    key = owned_key_of(header["context"], header["kind"], header["spec"], codec.identity)
    header = header | {"key": key, "layers": layers, **(fields or {})}
    return key, _seal(header, codec, tensors, positions or {})


# -- decoding ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OwnedView:
    """A verified stored derived entry seen without copying: its ``header``, and its tensors
    through :meth:`scores`, :meth:`kv` and :meth:`positions` (those its kind holds). Valid only
    while the buffer it was decoded from is (:meth:`kvstore.store.kvstore.KVStore.open`)."""

    header: OwnedHeader
    records: Mapping[str, TensorRecord]
    _kv: Mapping[tuple[int, int], tuple[StoredTensor, StoredTensor]] = field(repr=False)
    _positions: tuple[torch.Tensor, ...] = field(repr=False)

    def scores(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s scores ``[kv_heads, n_tokens]`` (float32 or float64), a fresh tensor.
        Raises KeyError for a kind that holds none (a pressed cache)."""
        if scores_name(layer) not in self.records:
            raise KeyError(f"a {self.header.kind} entry holds no scores")
        return self.records[scores_name(layer)].materialize()

    def kv(self, layer: int, head: int) -> tuple[StoredTensor, StoredTensor]:
        """Head ``head`` of layer ``layer``: its kept keys and values, each a stored tensor
        ``[1, n_h, head_dim]`` in the model's dtype (``copy_into(dest)`` decodes into a strided view,
        ``materialize()`` into a fresh tensor; a lossy codec dequantizes there). Raises KeyError for
        a kind that holds none (scores), IndexError for a layer or head out of range."""
        if not self._kv:
            raise KeyError(f"a {self.header.kind} entry holds no keys and values")
        if not 0 <= layer < len(self.header.layers) or not 0 <= head < self.header.layers[layer].kv_heads:
            raise IndexError(f"no head {head} in layer {layer}")
        return self._kv[layer, head]

    def positions(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s kept positions, int64 ``[sum_h n_h]``: each head's ascending, heads in
        order (``header.layers[layer].counts`` splits them). Raises KeyError for a kind that holds
        none (scores)."""
        if not self._positions:
            raise KeyError(f"a {self.header.kind} entry holds no positions")
        return self._positions[layer].clone()


def decode_owned(buf: bytes | memoryview, *, key: str | None = None, threads: int = 1, lazy: bool = False,
                   checked: bool = False) -> Any:  # fmt: skip
    """Verify and decode an owned entry of any kind: its kind's view (the built-in kinds':
    :class:`OwnedView`), whose records may view ``buf``. ``key``, if
    given, must be the entry's own key; ``lazy``: compressed tensors are decompressed when copied
    (and raise CorruptEntryError then); ``checked``: the caller verified the checksum already.

    Checks, in order: checksum, header, the key against the header's facts and the declared sizes
    (before anything is allocated), the payload's tensors against the header (names, shapes,
    dtypes, positions: the kind's), the safetensors metadata. Raises CorruptEntryError or
    FormatVersionError."""
    header, codec, records = open_frame(
        buf, read_owned_header, check_key_and_sizes, key=key, threads=threads, lazy=lazy, checked=checked,
        what="derived entry",
    )  # fmt: skip
    kind = kind_of(header.kind)
    if sorted(records.tensors) != sorted(kind.tensor_names(header, codec)):
        raise CorruptEntryError("derived entry holds other tensors than its header describes")
    view = kind.view(header, records.tensors, codec)
    check_metadata(records.metadata, header, _METADATA, "derived entry")
    return view


def _same_facts(h: OwnedHeader) -> tuple:
    return (h.context, h.kind, h.spec, h.model, h.dtype, h.n_tokens, h.layers, h.identity, dict(h.fields))


class OwnedKindBase(Generic[L, V]):
    """What every kind of owned entry shares (the :class:`~kvstore.store.kinds.EntryKind` half of
    an :class:`~kvstore.store.kinds.OwnedKind`, generic in its layer record ``L`` and view ``V``):
    the format-5 header, its sizes, decoding, which copies hold the same thing (all but
    ``created``, ``press`` and a lossless codec), and the defaults of a kind that keeps no header
    field of its own and no part of its context. A kind adds its layer records, value bytes,
    tensor names, view and export (:class:`~kvstore.store.kinds.OwnedKind`)."""

    name = ""
    owned = True
    stands_for_context = False
    keeps_part = False
    lossless_only = False
    noun = "derived entry"

    def address(self, key: str, owner: str = "") -> bytes:
        return owned_key(owner, key)

    def read_header(self, buf: bytes | memoryview) -> tuple[OwnedHeader, int]:
        return read_owned_header(buf)

    def check_sizes(self, header: OwnedHeader, payload_bytes: int) -> None:
        check_key_and_sizes(header, codec_from_params(header.codec), payload_bytes)

    def decode(self, buf: bytes | memoryview, *, key: str | None = None, threads: int = 1, lazy: bool = False,
               checked: bool = False) -> V:  # fmt: skip
        return decode_owned(buf, key=key, threads=threads, lazy=lazy, checked=checked)

    def same_facts(self, old: Any, blob: bytes) -> bool:
        return _same_facts(old.header) == _same_facts(read_owned_header(blob)[0])

    def check_header(self, h: Mapping[str, Any]) -> Mapping[str, Any]:
        return {}

    def data_bytes(self, header: OwnedHeader) -> int:
        return kind_of(header.kind).value_bytes(header)

    def kept_pairs(self, header: OwnedHeader) -> int:
        return 0

    def kept_fraction(self, header: OwnedHeader) -> float:
        return 1.0

    def __repr__(self) -> str:
        return f"<entry kind {self.name}>"


# decodes an owned entry of any kind (its header says which) where the kind is not known beforehand
ANY_OWNED: OwnedKindBase[Any, Any] = OwnedKindBase()
DerivedView = OwnedView  # deprecated: the names they had
decode_derived = decode_owned

__all__ = [
    "ANY_OWNED",
    "PRESSED",
    "SCORES",
    "OwnedView",
    "OwnedKindBase",
    "decode_owned",
    "encode_owned",
    "owned_header",
]
