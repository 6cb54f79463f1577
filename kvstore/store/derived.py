"""Derived entries: what is computed from one stored context and stored beside it (format 5).

A derived entry belongs to one context, named by the context's key (its chain's last chunk key),
and is one of two kinds:

* ``scores``: a query-agnostic press's per-token scores, per layer ``[kv_heads, n_tokens]``
  (float32 or float64, stored exactly: never quantized, whatever the codec);
* ``pressed``: a pressed cache: per layer and KV head, the kept tokens' keys and values and their
  context positions (the heads of one layer may keep different counts, even none).

**Key.** :func:`derived_key_of`: sha256 of ``b"kvstore-derived\\0" ‖ u32le(1) ‖ context\\0 ‖ kind\\0 ‖
spec\\0 ‖ identity\\0`` (``spec``: the canonical scorer or press spec, e.g. ``kvzip:chunk=2048`` or
``kvzip:0.75``; ``identity``: the lossy codec's :attr:`~kvstore.store.codecs.Codec.identity`, ``""``
for a lossless codec and always for scores). The backend keeps it under ``x/<context>/<key>``
(:mod:`kvstore.store.keyspace`); its last use under ``a/<key>``, as for chunks.

**Bytes.** The chunk entries' framing (:mod:`kvstore.store.entry`: magic, u32 header length,
canonical JSON header, the codec's payload, xxh3-64 of everything before it) with ``"format": 5``.
Header: ``format``, ``key`` (the derived key), ``context``, ``kind``, ``spec``, ``model``
(fingerprint), ``model_name``, ``dtype`` (the model's), ``numerics``, ``n_tokens`` (the context's
tokens ``c``), ``layers`` (one record per layer: ``{"kv_heads": H}`` for scores,
``{"kv_heads": H, "head_dim": d, "counts": [n_0, ..., n_{H-1}]}`` for a pressed cache),
``scores_dtype`` (scores only: ``float32`` or ``float64``), ``codec`` (as chunk entries: a pressed
cache's keys and values go through its quantizer; scores only through its packing), ``raw_bytes``,
``created`` and ``press`` (a JSON object saying what made it, shown by ``ls``).

Payload tensors:

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
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from kvstore import dtypes
from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs import Codec, StoredTensor, TensorRecord, codec_from_params, get_codec
from kvstore.store.codecs.prerope import Rotary, with_rotary

# the header and key live in derived_header (read by listings without this module's decoding);
# they are importable from here too, with the rest of the API
from kvstore.store.derived_header import (  # noqa: F401
    DERIVED_KINDS,
    MAX_SPEC,
    PRESSED,
    SCORE_DTYPES,
    SCORES,
    DerivedFacts,
    DerivedHeader,
    DerivedLayer,
    check_derived_sizes,
    check_key_and_sizes,
    check_press,
    derived_key_of,
    read_derived_header,
)
from kvstore.store.header import DERIVED_FORMAT, MAGIC, MAX_POSITION, TRAILER_BYTES, verify_checksum
from kvstore.store.keyspace import is_key


# -- encoding ------------------------------------------------------------------------------------------
def _names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.scores", f"layers.{layer}.positions"


def _head_name(layer: int, head: int, role: str) -> str:
    return f"layers.{layer}.heads.{head}.{role}"


def _facts(facts: DerivedFacts, kind: str, spec: str, press: Mapping) -> dict[str, Any]:
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
    metadata = {k: str(header[k]) for k in ("format", "key", "context", "kind", "spec", "model", "dtype", "n_tokens")}
    metadata |= {"n_layers": str(len(header["layers"])), "codec": codec.spec}
    stored: list[tuple[str, torch.Tensor]] = []
    for name, tensor, role in tensors:
        if role is None:
            stored.append((name, tensor))
        else:
            stored += [(name + s, t) for s, t in codec.quantizer.encode(role, tensor, positions=positions[name])]
    stored.sort(key=lambda item: -item[1].element_size())
    payload, packing_params, raw_bytes = codec.packing.pack(stored, metadata)
    params = codec.params(packing_params)
    text = json.dumps(header | {"codec": params, "raw_bytes": raw_bytes}, sort_keys=True, separators=(",", ":"))
    body = b"".join([MAGIC, struct.pack("<I", len(text)), text.encode(), payload])
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def encode_scores(
    facts: DerivedFacts, spec: str, press: Mapping, scores: Sequence[torch.Tensor], codec: Codec | str | None = None
) -> tuple[str, bytes]:
    """A context's per-token scores as a derived entry: ``(derived key, bytes to store)``.

    ``scores[i]``: layer ``i``'s scores ``[kv_heads, n_tokens]`` (``facts.n_tokens``), float32 or
    float64 (every layer the same), stored exactly: only ``codec``'s packing applies. ``spec``: the
    canonical scorer spec; ``press``: what made them (a JSON object). Raises ValueError for
    scores of the wrong shape or dtype, or a ``press`` that is not such an object."""
    packing = get_codec(codec).packing
    lossless = Codec(get_codec("raw").quantizer, packing)
    header = _facts(facts, SCORES, spec, press)
    if not scores:
        raise ValueError("scores need at least one layer")
    kind = {t.dtype for t in scores}
    if len(kind) != 1 or dtypes.name(next(iter(kind))) not in SCORE_DTYPES:
        raise ValueError(f"scores must be float32 or float64, every layer the same, not {sorted(map(str, kind))}")
    tensors, layers = [], []
    for i, t in enumerate(scores):
        if t.dim() != 2 or t.shape[0] < 1 or t.shape[1] != facts.n_tokens:
            raise ValueError(f"layer {i}: scores must be [kv_heads, {facts.n_tokens}], not {tuple(t.shape)}")
        tensors.append((_names(i)[0], t.detach().to("cpu").contiguous(), None))
        layers.append(DerivedLayer(int(t.shape[0])).record())
    key = derived_key_of(facts.context, SCORES, spec, "")
    header |= {"key": key, "layers": layers, "scores_dtype": dtypes.name(scores[0].dtype)}
    return key, _seal(header, lossless, tensors, {})


def encode_pressed(
    facts: DerivedFacts, spec: str, press: Mapping,
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
    header = _facts(facts, PRESSED, spec, press)
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
                    name = _head_name(i, h, role)
                    tensors.append((name, t.detach().to("cpu").unsqueeze(0).contiguous(), role))
                    positions[name] = kept[-1]
        tensors.append((_names(i)[1], torch.cat(kept).to(torch.int32), None))
        records.append(DerivedLayer(len(heads), min(dims), tuple(counts)).record())
    key = derived_key_of(facts.context, PRESSED, spec, codec.identity)
    header |= {"key": key, "layers": records}
    return key, _seal(header, codec, tensors, positions)


# -- decoding ------------------------------------------------------------------------------------------
class _NoTokens:
    """A head that keeps no token: a ``[1, 0, head_dim]`` stored tensor with nothing to copy."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.shape, self.dtype = (1, 0, head_dim), dtype

    def copy_into(self, dest: torch.Tensor) -> None:
        if tuple(dest.shape) != self.shape or dest.dtype != self.dtype:
            raise ValueError(f"destination {tuple(dest.shape)}/{dest.dtype} != {self.shape}/{self.dtype}")

    def materialize(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)


@dataclass(frozen=True)
class DerivedView:
    """A verified stored derived entry seen without copying: its ``header``, and its tensors
    through :meth:`scores`, :meth:`kv` and :meth:`positions`. Valid only while the buffer it was
    decoded from is (:meth:`kvstore.store.kvstore.KVStore.open_derived`)."""

    header: DerivedHeader
    records: Mapping[str, TensorRecord]
    _kv: Mapping[tuple[int, int], tuple[StoredTensor, StoredTensor]] = field(repr=False)
    _positions: tuple[torch.Tensor, ...] = field(repr=False)

    def scores(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s scores ``[kv_heads, n_tokens]`` (float32 or float64), a fresh tensor.
        Raises KeyError for a pressed cache."""
        if self.header.kind != SCORES:
            raise KeyError(f"a {self.header.kind} entry holds no scores")
        return self.records[_names(layer)[0]].materialize()

    def kv(self, layer: int, head: int) -> tuple[StoredTensor, StoredTensor]:
        """Head ``head`` of layer ``layer``: its kept keys and values, each a stored tensor
        ``[1, n_h, head_dim]`` in the model's dtype (``copy_into(dest)`` decodes into a strided view,
        ``materialize()`` into a fresh tensor; a lossy codec dequantizes there). Raises KeyError for
        scores, IndexError for a layer or head out of range."""
        if self.header.kind != PRESSED:
            raise KeyError("a scores entry holds no keys and values")
        if not 0 <= layer < len(self.header.layers) or not 0 <= head < self.header.layers[layer].kv_heads:
            raise IndexError(f"no head {head} in layer {layer}")
        return self._kv[layer, head]

    def positions(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s kept positions, int64 ``[sum_h n_h]``: each head's ascending, heads in
        order (``header.layers[layer].counts`` splits them). Raises KeyError for scores."""
        if self.header.kind != PRESSED:
            raise KeyError("a scores entry holds no positions")
        return self._positions[layer].clone()


def _want_names(header: DerivedHeader, codec: Codec) -> list[str]:
    want = []
    for i, layer in enumerate(header.layers):
        if header.kind == SCORES:
            want.append(_names(i)[0])
            continue
        want.append(_names(i)[1])
        for h, m in enumerate(layer.counts or ()):
            if m:
                for role in ("keys", "values"):
                    want += codec.quantizer.stored_names(_head_name(i, h, role))
    return want


def _layer_positions(rec: TensorRecord, layer: DerivedLayer, n_tokens: int, i: int) -> torch.Tensor:
    if rec.shape != (layer.kept,) or rec.dtype != torch.int32:
        raise CorruptEntryError(f"tensor {rec.name} is {rec.shape} {rec.dtype}, expected ({layer.kept},) int32")
    pos = rec.materialize().to(torch.int64)
    start = 0
    for h, m in enumerate(layer.counts or ()):
        part = pos[start : start + m]
        if m and (int(part[0]) < 0 or int(part[-1]) >= n_tokens or bool((part[1:] <= part[:-1]).any())):
            raise CorruptEntryError(f"layer {i} head {h}: positions are not ascending within [0, {n_tokens})")
        start += m
    return pos


def decode_derived(buf: bytes | memoryview, *, key: str | None = None, threads: int = 1, lazy: bool = False,
                   checked: bool = False) -> DerivedView:  # fmt: skip
    """Verify and decode a derived entry; its records may view ``buf``. ``key``, if given, must be
    the entry's own key; ``lazy``: compressed tensors are decompressed when copied (and raise
    CorruptEntryError then); ``checked``: the caller verified the checksum already.

    Checks, in order: checksum, header, the key against the header's facts and the declared sizes
    (before anything is allocated), the payload's tensors against the header (names, shapes,
    dtypes, positions), the safetensors metadata. Raises CorruptEntryError or FormatVersionError."""
    if not checked:
        verify_checksum(buf)
    header, offset = read_derived_header(buf)
    if key is not None and header.key != key:
        raise CorruptEntryError(f"derived entry stored under {key[:12]} says it is {header.key[:12]}")
    payload = memoryview(buf)[offset : len(buf) - TRAILER_BYTES]
    codec = codec_from_params(header.codec)
    check_key_and_sizes(header, codec, len(payload))
    records = codec.packing.unpack(payload, header.codec, header.raw_bytes, threads, lazy)
    if sorted(records.tensors) != sorted(_want_names(header, codec)):
        raise CorruptEntryError("derived entry holds other tensors than its header describes")
    dtype = dtypes.to_torch(header.dtype)
    kv: dict[tuple[int, int], tuple[StoredTensor, StoredTensor]] = {}
    positions: list[torch.Tensor] = []
    for i, layer in enumerate(header.layers):
        if header.kind == SCORES:
            rec = records.tensors[_names(i)[0]]
            if rec.shape != (layer.kv_heads, header.n_tokens) or dtypes.name(rec.dtype) != header.scores_dtype:
                raise CorruptEntryError(f"tensor {rec.name} is {rec.shape} {rec.dtype}, the header says otherwise")
            continue
        pos = _layer_positions(records.tensors[_names(i)[1]], layer, header.n_tokens, i)
        positions.append(pos)
        start = 0
        for h, m in enumerate(layer.counts or ()):
            if not m:
                empty = _NoTokens(layer.head_dim, dtype)
                kv[i, h] = (empty, empty)
                continue
            shape, where = (1, m, layer.head_dim), pos[start : start + m]
            try:
                kv[i, h] = tuple(  # type: ignore[assignment]
                    codec.quantizer.reader(role, _head_name(i, h, role), records.tensors, shape, dtype, positions=where)
                    for role in ("keys", "values")
                )
            except CodecError as exc:
                raise CorruptEntryError(str(exc)) from None
            start += m
    meta = records.metadata
    for name in ("key", "context", "kind", "spec", "model", "dtype", "n_tokens", "n_layers"):
        if meta.get(name) != str(getattr(header, name)):
            raise CorruptEntryError(f"payload metadata {name!r} disagrees with the derived entry header")
    return DerivedView(header, records.tensors, kv, tuple(positions))


__all__ = ["DerivedView", "decode_derived", "encode_pressed", "encode_scores"]
