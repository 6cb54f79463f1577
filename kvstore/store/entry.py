"""The on-disk entry format: one stored value per chunk of a context (format 2), or per whole
context (format 1, still read).

::

    magic     8 bytes     b"\\x89KVS\\r\\n\\x1a\\n"
    hlen      u32 LE      length of the header
    header    hlen bytes  canonical JSON (sorted keys), see below
    payload   codec output (kvstore.store.codecs): a safetensors file, optionally in zstd frames
    checksum  u64 LE      xxh3-64 of every byte before it

**Format 2 header**: ``format`` (2), ``key`` (this chunk's key), ``parent`` (the previous chunk's
key, ``""`` for the first), ``model`` (fingerprint), ``model_name``, ``dtype`` (the model's),
``start`` and ``n_tokens`` (this chunk covers context positions ``[start, start + n_tokens)``),
``layers`` (one record per model layer, below), ``numerics`` (device type, attention
implementation, torch and transformers versions: where the numbers came from), ``codec``,
``raw_bytes`` and ``created``.

A layer record says what the layer keeps for later tokens:

* ``{"kind": "attn", "length": n, "kv_heads": h, "head_dim": d}``: keys and values of every
  token of the chunk (``length == n_tokens``);
* ``"sliding"`` / ``"chunked"`` (with ``"window"``): the same, for the last ``length`` tokens only
  (what a later token can still attend to);
* ``{"kind": "state", "state": {name: {"shape": [...], "dtype": ...}}}``: a recurrent state at the
  chunk's end (convolution and SSM states), in its own dtype (float32 in a bf16 model, say);
* ``"hybrid"``: both.

A layer's stored keys and values cover context positions ``[start + n_tokens - length, start +
n_tokens)``. Payload tensors: ``layers.{i}.keys`` / ``layers.{i}.values`` ``[kv_heads, length,
head_dim]`` (or a lossy codec's parts of them), ``layers.{i}.state.{name}``, and ``token_ids``
``[n_tokens]`` int64; the safetensors ``__metadata__`` repeats key, model, dtype, tokens and layers.

**Format 1** (phase 1): one entry per whole context, every layer ``attn`` with the same shape; the
header had ``n_layers``, ``kv_heads`` and ``head_dim`` instead of ``layers`` and no ``parent``,
``start`` or ``numerics``. It is read as a one-chunk chain.

The checksum is verified on every load before anything is decoded; the header alone (no checksum
pass, no decompression) is enough for listings (:mod:`kvstore.store.header` reads both). Anything
inconsistent is a CorruptEntryError.

:class:`Entry` is a chunk materialized in memory (what gets encoded); :class:`EntryView` is a
verified stored entry seen without copying (what the load path reads).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import CorruptEntryError
from kvstore.facts import ATTN, KV_KINDS, STATE
from kvstore.store.codecs import Codec, StoredTensor, TensorRecord, get_codec, identity_of
from kvstore.store.codecs.prerope import Rotary, with_rotary
from kvstore.store.frame import check_metadata, open_frame, seal
from kvstore.store.header import STATE_NAME, EntryHeader, LayerSpec, check_layer, check_sizes, read_header
from kvstore.store.keyspace import entry_key


@dataclass(frozen=True)
class Entry:
    """One chunk of a context's cache (or a whole context), materialized.

    ``layers[i]``: layer ``i``'s ``(keys, values)``, each ``[kv_heads, length_i, head_dim]`` for the
    last ``length_i`` tokens of the chunk (all of them for full attention), or ``None`` for a
    layer without keys and values; ``states[i]``: its recurrent state tensors at the chunk's end,
    by name, or ``None``; ``kinds[i]``: the layer's kind (default ``attn`` or ``state``);
    ``windows[i]``: its window for ``sliding``/``chunked`` layers. ``token_ids`` ``[n_tokens]``
    int64 are the chunk's own tokens, at context positions ``start`` onwards; ``parent`` is the
    previous chunk's key (``""`` for the first). ``kv_dtype``: the model's dtype, needed only when
    no layer keeps keys and values (a state-space model; states keep their own dtypes).
    ``rotary``: the model's rotary embedding, for codecs that quantize keys before it
    (:mod:`kvstore.store.codecs.prerope`); not stored unless such a codec encodes the entry."""

    key: str
    model: str
    model_name: str
    token_ids: torch.Tensor
    layers: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    created: float = field(default_factory=time.time)
    parent: str = ""
    start: int = 0
    states: tuple[Mapping[str, torch.Tensor] | None, ...] | None = None
    kinds: tuple[str, ...] | None = None
    windows: tuple[int | None, ...] | None = None
    numerics: Mapping[str, str] = field(default_factory=dict)
    kv_dtype: torch.dtype | None = None
    rotary: Rotary | None = None

    @property
    def dtype(self) -> torch.dtype:
        kv = next((x for x in self.layers if x is not None), None)
        if kv is not None:
            return kv[0].dtype
        if self.kv_dtype is not None:
            return self.kv_dtype
        raise ValueError("entry has no keys/values to take a dtype from")

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in filter(None, self.layers))

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in filter(None, self.states or ()) for t in s.values())

    def to_dynamic_cache(self, device: torch.device | str | None = None, config: Any = None):
        """A ``transformers.DynamicCache`` holding this entry's keys and values (batch of 1), ready
        for ``model.generate(input_ids=context_ids + question_ids, past_key_values=cache)``; only
        for a whole context (``start == 0``) of full-attention layers."""
        from transformers import DynamicCache

        if self.start != 0 or any(x is None for x in self.layers) or (self.kinds and set(self.kinds) != {ATTN}):
            raise ValueError("to_dynamic_cache needs a whole context of full-attention layers")
        first = self.layers[0]
        assert first is not None
        device = torch.device(device) if device is not None else first[0].device
        data = [(k.unsqueeze(0).to(device), v.unsqueeze(0).to(device)) for k, v in filter(None, self.layers)]
        return DynamicCache(data, config=config) if config is not None else DynamicCache(data)


@dataclass(frozen=True)
class EntryView:
    """A verified entry seen without copying. ``records``: every stored tensor (views into the
    stored or decompressed bytes); ``layers[i]``: layer ``i``'s keys and values read through the
    entry's codec, or None; ``states[i]``: its state tensors by name, or None. Valid only while the
    buffer it was decoded from is (``KVStore.open_entry``). ``unverified``: None, or (a view opened
    with its checksum left to the reader: ``KVStore.open_chain(defer=True)``) the frame whose
    checksum must match before any value read from it is used (:mod:`kvstore.store.fused`)."""

    header: EntryHeader
    records: Mapping[str, TensorRecord]
    layers: tuple[tuple[StoredTensor, StoredTensor] | None, ...]
    states: tuple[Mapping[str, TensorRecord] | None, ...]
    unverified: Any = None

    def layer(self, i: int) -> tuple[StoredTensor, StoredTensor]:
        kv = self.layers[i]
        if kv is None:
            raise KeyError(f"layer {i} keeps no keys and values")
        return kv

    def token_ids(self) -> list[int]:
        return self.records["token_ids"].materialize().tolist()

    def materialize(self) -> Entry:
        h = self.header
        layers = tuple(None if kv is None else (kv[0].materialize(), kv[1].materialize()) for kv in self.layers)
        states = tuple(None if s is None else {n: r.materialize() for n, r in s.items()} for s in self.states)
        return Entry(
            key=h.key, model=h.model, model_name=h.model_name, token_ids=self.records["token_ids"].materialize(),
            layers=layers, created=h.created, parent=h.parent, start=h.start,
            states=states if any(s is not None for s in states) else None, kinds=tuple(s.kind for s in h.layers),
            windows=tuple(s.window for s in h.layers), numerics=dict(h.numerics), kv_dtype=dtypes.to_torch(h.dtype),
        )  # fmt: skip


def kv_tensor_name(layer: int, role: str) -> str:
    return f"layers.{layer}.{role}"


def state_tensor_name(layer: int, name: str) -> str:
    return f"layers.{layer}.state.{name}"


def _layer_specs(
    entry: Entry, n_tokens: int
) -> tuple[list[LayerSpec], list[tuple[str, torch.Tensor, str | None]], str]:
    tensors: list[tuple[str, torch.Tensor, str | None]] = []
    specs: list[LayerSpec] = []
    dtype: torch.dtype | None = entry.kv_dtype
    states = entry.states or (None,) * len(entry.layers)
    if len(states) != len(entry.layers):
        raise ValueError(f"{len(entry.layers)} layers but {len(states)} layer states")
    for i, (kv, state) in enumerate(zip(entry.layers, states)):
        kind = entry.kinds[i] if entry.kinds else (ATTN if kv is not None else STATE)
        window = entry.windows[i] if entry.windows else None
        length = kv_heads = head_dim = 0
        if kv is not None:
            k, v = (t[0] if t.dim() == 4 else t for t in kv)
            dtype = dtype or k.dtype
            for t in (k, v):
                if t.dim() != 3 or t.dtype != dtype or tuple(t.shape) != tuple(k.shape) or t.shape[1] > n_tokens:
                    raise ValueError(
                        f"layer {i}: expected keys and values [kv_heads, <= {n_tokens}, head_dim] {dtype}, "
                        f"got {tuple(t.shape)} {t.dtype}"
                    )
            kv_heads, length, head_dim = k.shape
            tensors += [(kv_tensor_name(i, "keys"), k, "keys"), (kv_tensor_name(i, "values"), v, "values")]
        state_specs = []
        for name in sorted(state or {}):
            t = state[name]  # type: ignore[index]
            if not STATE_NAME.match(name):
                raise ValueError(f"layer {i}: state tensor name {name!r} is not a lowercase identifier")
            state_specs.append((name, tuple(t.shape), dtypes.name(t.dtype)))
            tensors.append((state_tensor_name(i, name), t, None))
        spec = LayerSpec(kind, length, kv_heads, head_dim, window, tuple(state_specs))
        check_layer(spec, n_tokens, i, ValueError)
        specs.append(spec)
    if dtype is None:
        raise ValueError("an entry needs at least one layer with keys and values, or its kv_dtype")
    return specs, tensors, dtypes.parse_kv(dtype)


def encode_entry(entry: Entry, codec: Codec | str | None = None) -> bytes:
    """Serialize ``entry`` in the format its codec needs (:attr:`Codec.entry_format`: 2, or 3 for
    the ``zstd-split`` packing and the ``int4r``/``int8r`` quantizers). Returns the bytes to store.
    Raises ValueError for layers of inconsistent shapes or dtypes."""
    codec = with_rotary(get_codec(codec), entry.rotary)
    ids = torch.as_tensor(entry.token_ids, dtype=torch.int64).reshape(-1).cpu()
    n_tokens = int(ids.numel())
    if n_tokens < 1:
        raise ValueError("an entry needs at least one token")
    specs, tensors, dtype = _layer_specs(entry, n_tokens)
    tensors.append(("token_ids", ids, None))
    created = time.time() if entry.created is None else entry.created
    facts: dict[str, Any] = {
        "format": codec.entry_format,
        "key": entry.key,
        "parent": entry.parent,
        "model": entry.model,
        "model_name": entry.model_name,
        "dtype": dtype,
        "start": entry.start,
        "n_tokens": n_tokens,
        "layers": [s.record() for s in specs],
        "numerics": dict(entry.numerics),
        "created": round(created, 6),
    }
    metadata = {k: str(facts[k]) for k in ("format", "key", "parent", "model", "dtype", "start", "n_tokens")}
    metadata |= {"n_layers": str(len(specs)), "codec": codec.spec}
    payload, params, raw_bytes = codec.encode(tensors, metadata, start=entry.start)
    return seal(facts | {"codec": params, "raw_bytes": raw_bytes}, payload)


def decode_entry(
    buf: bytes | memoryview, *, key: str | None = None, threads: int = 1, lazy: bool = False, checked: bool = False
) -> EntryView:
    """Verify and decode an entry (format 1 or 2). The returned view's records may view ``buf``.
    ``lazy``: compressed tensors are decompressed when copied (a frame that does not decompress
    then raises CorruptEntryError from the copy), not here. ``checked``: the caller has just
    verified ``buf``'s checksum (:func:`verify_checksum`, e.g. of a chain's chunks in parallel).

    Checks, in order: checksum, header, declared sizes (before allocating anything), the payload's
    tensors against the header (names, shapes, dtypes), and the safetensors metadata against the
    header. ``key``, if given, must match the entry's own key.
    """
    header, codec, decoded = open_frame(
        buf, read_header, lambda h, _, n: check_sizes(h, n), key=key, threads=threads, lazy=lazy, checked=checked
    )
    records, quantizer = decoded.tensors, codec.quantizer
    kv_names = [
        (kv_tensor_name(i, "keys"), kv_tensor_name(i, "values")) if spec.kind in KV_KINDS else None
        for i, spec in enumerate(header.layers)
    ]
    want = ["token_ids"]
    for i, (spec, kv) in enumerate(zip(header.layers, kv_names)):
        if kv is not None:
            want += quantizer.stored_names(kv[0])
            want += quantizer.stored_names(kv[1])
        want += [state_tensor_name(i, name) for name, _, _ in spec.state]
    if sorted(records) != sorted(want):
        raise CorruptEntryError("entry holds other tensors than its header describes")
    dtype = dtypes.to_torch(header.dtype)
    layers: list[tuple[StoredTensor, StoredTensor] | None] = []
    states: list[dict[str, TensorRecord] | None] = []
    for i, (spec, kv) in enumerate(zip(header.layers, kv_names)):
        if kv is not None:
            kv_shape = (spec.kv_heads, spec.length, spec.head_dim)
            k = quantizer.reader("keys", kv[0], records, kv_shape, dtype, start=header.start)
            v = quantizer.reader("values", kv[1], records, kv_shape, dtype, start=header.start)
            layers.append((k, v))
        else:
            layers.append(None)
        found = {}
        for name, shape, dname in spec.state:
            rec = records[state_tensor_name(i, name)]
            if rec.shape != shape or rec.dtype != dtypes.to_torch(dname):
                raise CorruptEntryError(
                    f"state tensor {rec.name} is {rec.shape} {rec.dtype}, header says {shape} {dname}"
                )
            found[name] = rec
        states.append(found or None)
    ids = records["token_ids"]
    if ids.shape != (header.n_tokens,) or ids.dtype != torch.int64:
        raise CorruptEntryError("token_ids do not match the header")
    names = ("key", "model", "dtype", "n_tokens", "n_layers") + (("parent", "start") if header.format >= 2 else ())
    check_metadata(decoded.metadata, header, names)
    return EntryView(header, records, tuple(layers), tuple(states))


class ChunkKind:
    """Chunk entries as an :class:`~kvstore.store.kinds.EntryKind`: stored by their own key
    (``e/<key>``); a chain of them is a context."""

    name = "chunk"
    owned = False
    stands_for_context = True
    noun = "entry"

    def address(self, key: str, owner: str = "") -> bytes:
        return entry_key(key)

    def read_header(self, buf: bytes | memoryview) -> tuple[EntryHeader, int]:
        return read_header(buf)

    def check_sizes(self, header: EntryHeader, payload_bytes: int) -> None:
        check_sizes(header, payload_bytes)

    def decode(self, buf: bytes | memoryview, *, key: str | None = None, threads: int = 1, lazy: bool = False,
               checked: bool = False) -> EntryView:  # fmt: skip
        return decode_entry(buf, key=key, threads=threads, lazy=lazy, checked=checked)

    def same_facts(self, old: EntryView, blob: bytes) -> bool:
        """Whether the stored ``old`` holds what ``blob`` does: the same model, dtype, span, parent,
        layer records, token ids and lossy codec if any (only ``created`` and a lossless codec may
        differ)."""
        new = decode_entry(blob, key=old.header.key)

        def facts(h: EntryHeader) -> tuple:
            return (h.model, h.dtype, h.parent, h.start, h.n_tokens, h.layers, identity_of(h.codec))

        return facts(old.header) == facts(new.header) and old.token_ids() == new.token_ids()

    def __repr__(self) -> str:
        return "<entry kind chunk>"


CHUNK = ChunkKind()

__all__ = ["CHUNK", "ChunkKind", "Entry", "EntryView", "decode_entry", "encode_entry"]
