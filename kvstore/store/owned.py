"""Derived entries, the entries a context owns: what is computed from one stored context and
stored beside it (format 5).

A derived entry belongs to one context, named by the context's key (its chain's last chunk key),
and is of one kind in the table of kinds (:mod:`kvstore.store.kinds`); the built-in ones:

* ``scores``: a query-agnostic press's per-token scores, per layer ``[kv_heads, n_tokens]``
  (float32 or float64, stored exactly: never quantized, whatever the codec);
* ``pressed``: a pressed cache: per layer and KV head, the kept tokens' keys and values and their
  context positions (the heads of one layer may keep different counts, even none).

**Key.** :func:`owned_key_of`: sha256 of ``b"kvstore-derived\\0" ‖ u32le(1) ‖ context\\0 ‖ kind\\0 ‖
spec\\0 ‖ identity\\0`` (``spec``: the canonical scorer or press spec, e.g. ``kvzip:chunk=2048`` or
``kvzip:0.75``; ``identity``: the lossy codec's :attr:`~kvstore.store.codecs.Codec.identity`, ``""``
for a lossless codec and always for scores). The backend keeps it under ``x/<context>/<key>``
(:mod:`kvstore.store.keyspace`); its last use under ``a/<key>``, as for chunks.

**Bytes.** The framing every entry shares (:mod:`kvstore.store.frame`: magic, u32 header length,
canonical JSON header, the codec's payload, xxh3-64 of everything before it) with ``"format": 5``.
Header: ``format``, ``key`` (the derived key), ``context``, ``kind``, ``spec``, ``model``
(fingerprint), ``model_name``, ``dtype`` (the model's), ``numerics``, ``n_tokens`` (the context's
tokens ``c``), ``layers`` (one record per layer: ``{"kv_heads": H}`` for scores,
``{"kv_heads": H, "head_dim": d, "counts": [n_0, ..., n_{H-1}]}`` for a pressed cache),
``scores_dtype`` (scores only: ``float32`` or ``float64``), ``codec`` (as chunk entries: a pressed
cache's keys and values go through its quantizer; scores only through its packing), ``raw_bytes``,
``created`` and ``press`` (a JSON object saying what made it, shown by ``ls``).

Payload tensors (each kind's module says its own: :mod:`kvstore.store.kind_scores`,
:mod:`kvstore.store.kind_pressed`):

* ``scores``: ``layers.{i}.scores`` ``[H, c]``;
* ``pressed``: ``layers.{i}.heads.{h}.keys`` / ``.values`` ``[1, n_h, d]`` (or the quantizer's parts
  of them; a head with ``n_h == 0`` stores none), and ``layers.{i}.positions`` int32
  ``[sum_h n_h]``: each head's kept positions, ascending, in ``[0, c)``, heads in order. Lossy
  quantizers see each head's true positions (:meth:`kvstore.store.codecs.Quantizer.encode`): a
  context's first tokens stay unquantized where kept, and the pre-rotation codecs (``int4r``,
  ``int8r``, ``ecq``) un-rotate each key at its own position.

Decoding verifies the checksum first, then checks every declared size against the header before
anything is allocated, the header's key against its own context, kind, spec and codec, and every
tensor against the header: anything inconsistent is a CorruptEntryError (a miss, recomputed by the
caller); a newer format is a FormatVersionError.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import CorruptEntryError
from kvstore.store.codecs import Codec, StoredTensor, TensorRecord, codec_from_params, get_codec
from kvstore.store.codecs.base import encode_named
from kvstore.store.codecs.prerope import Rotary, with_rotary
from kvstore.store.frame import DERIVED_FORMAT, check_metadata, open_frame, seal
from kvstore.store.header import MAX_POSITION
from kvstore.store.keyspace import is_key, owned_key
from kvstore.store.kinds import kind_of

# the header and key live in derived_header (read by listings without this module's decoding);
# they are importable from here too, with the rest of the API
from kvstore.store.owned_header import (  # noqa: F401  # noqa: F401  (deprecated: the names they had)
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


def encode_scores(
    facts: OwnedFacts, spec: str, press: Mapping, scores: Sequence[torch.Tensor], codec: Codec | str | None = None
) -> tuple[str, bytes]:
    """A context's per-token scores as a derived entry: ``(derived key, bytes to store)``.

    ``scores[i]``: layer ``i``'s scores ``[kv_heads, n_tokens]`` (``facts.n_tokens``), float32 or
    float64 (every layer the same), stored exactly: only ``codec``'s packing applies. ``spec``: the
    canonical scorer spec; ``press``: what made them (a JSON object). Raises ValueError for
    scores of the wrong shape or dtype, or a ``press`` that is not such an object."""
    packing = get_codec(codec).packing
    lossless = Codec(get_codec("raw").quantizer, packing)
    header = owned_header(facts, SCORES, spec, press)
    if not scores:
        raise ValueError("scores need at least one layer")
    kind = {t.dtype for t in scores}
    if len(kind) != 1 or dtypes.name(next(iter(kind))) not in SCORE_DTYPES:
        raise ValueError(f"scores must be float32 or float64, every layer the same, not {sorted(map(str, kind))}")
    tensors, layers = [], []
    for i, t in enumerate(scores):
        if t.dim() != 2 or t.shape[0] < 1 or t.shape[1] != facts.n_tokens:
            raise ValueError(f"layer {i}: scores must be [kv_heads, {facts.n_tokens}], not {tuple(t.shape)}")
        tensors.append((scores_name(i), t.detach().to("cpu").contiguous(), None))
        layers.append(OwnedLayer(int(t.shape[0])).record())
    return encode_owned(header, layers, tensors, lossless, fields={"scores_dtype": dtypes.name(scores[0].dtype)})


def encode_pressed(
    facts: OwnedFacts, spec: str, press: Mapping,
    layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], codec: Codec | str | None = None,
    *, rotary: Rotary | None = None,
) -> tuple[str, bytes]:  # fmt: skip
    """A context's pressed cache as a derived entry: ``(derived key, bytes to store)``.

    ``layers[i][h] = (keys [n_h, d], values [n_h, d], positions [n_h])``: head ``h`` of layer ``i``
    keeps ``n_h`` tokens (0 to ``facts.n_tokens``; heads of a layer may keep different counts),
    their keys and values in the model's dtype (``facts.dtype``) and their context positions
    (int64, strictly ascending, in ``[0, n_tokens)``). ``codec``'s quantizer applies to keys and
    values (int8, int4, fp8; the pre-rotation ``int4r``/``int8r``/``ecq`` need the model's
    ``rotary``, or a codec with it bound: :func:`kvstore.store.codecs.prerope.with_rotary`), its
    packing to the whole payload; a lossy quantizer is part of the key. Raises ValueError for
    tensors of the wrong shape, dtype or positions, CodecError for what the codec cannot store."""
    codec = with_rotary(get_codec(codec), rotary)
    header = owned_header(facts, PRESSED, spec, press)
    dtype = dtypes.to_torch(header["dtype"])
    n = facts.n_tokens
    if not layers:
        raise ValueError("a pressed cache needs at least one layer")
    tensors: list[tuple[str, torch.Tensor, str | None]] = []
    positions: dict[str, torch.Tensor] = {}
    records = []
    for i, heads in enumerate(layers):
        if not heads:
            raise ValueError(f"layer {i}: a pressed cache needs at least one KV head")
        dims = {int(k.shape[-1]) for k, _, _ in heads}
        if len(dims) != 1 or min(dims) < 1:
            raise ValueError(f"layer {i}: every head's keys and values need one head_dim, not {sorted(dims)}")
        counts, kept = [], []
        for h, (k, v, pos) in enumerate(heads):
            pos = torch.as_tensor(pos).detach().to("cpu")
            m = int(pos.numel())
            for t in (k, v):
                if t.dim() != 2 or tuple(t.shape) != (m, *dims) or t.dtype != dtype:
                    raise ValueError(
                        f"layer {i} head {h}: keys and values must be [{m}, {min(dims)}] {header['dtype']}, "
                        f"got {tuple(t.shape)} {t.dtype}"
                    )
            if pos.dim() != 1 or pos.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"layer {i} head {h}: positions must be int64 [n_h], got {pos.dtype} {tuple(pos.shape)}"
                )
            if m and (int(pos[0]) < 0 or int(pos[-1]) >= n or bool((pos[1:] <= pos[:-1]).any())):
                raise ValueError(f"layer {i} head {h}: positions must be strictly ascending within [0, {n})")
            counts.append(m)
            kept.append(pos.to(torch.int64))
            if m:
                for role, t in (("keys", k), ("values", v)):
                    name = head_name(i, h, role)
                    tensors.append((name, t.detach().to("cpu").unsqueeze(0).contiguous(), role))
                    positions[name] = kept[-1]
        tensors.append((positions_name(i), torch.cat(kept).to(torch.int32), None))
        records.append(OwnedLayer(len(heads), min(dims), tuple(counts)).record())
    return encode_owned(header, records, tensors, codec, positions)


# -- decoding ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OwnedView:
    """A verified stored derived entry seen without copying: its ``header``, and its tensors
    through :meth:`scores`, :meth:`kv` and :meth:`positions` (those its kind holds). Valid only
    while the buffer it was decoded from is (:meth:`kvstore.store.kvstore.KVStore.open_derived`)."""

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
                   checked: bool = False) -> OwnedView:  # fmt: skip
    """Verify and decode a derived entry of any kind; its records may view ``buf``. ``key``, if
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
    kv, positions = kind.read_tensors(header, records.tensors, codec)
    check_metadata(records.metadata, header, _METADATA, "derived entry")
    return OwnedView(header, records.tensors, kv, positions)


def _same_facts(h: OwnedHeader) -> tuple:
    return (h.context, h.kind, h.spec, h.model, h.dtype, h.n_tokens, h.layers, h.identity, h.scores_dtype)


class OwnedKindBase:
    """What every kind of owned entry shares (the :class:`~kvstore.store.kinds.EntryKind` half of
    an :class:`~kvstore.store.kinds.OwnedKind`): the format-5 header, its sizes, decoding, and
    which copies hold the same thing (all but ``created``, ``press`` and a lossless codec)."""

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
               checked: bool = False) -> OwnedView:  # fmt: skip
        return decode_owned(buf, key=key, threads=threads, lazy=lazy, checked=checked)

    def same_facts(self, old: OwnedView, blob: bytes) -> bool:
        return _same_facts(old.header) == _same_facts(read_owned_header(blob)[0])

    def __repr__(self) -> str:
        return f"<entry kind {self.name}>"


# decodes an owned entry of any kind (its header says which) where the kind is not known beforehand
ANY_OWNED = OwnedKindBase()
DerivedView = OwnedView  # deprecated: the names they had
decode_derived = decode_owned

__all__ = [
    "ANY_OWNED",
    "PRESSED",
    "SCORES",
    "OwnedView",
    "OwnedKindBase",
    "decode_owned",
    "encode_pressed",
    "encode_scores",
]
