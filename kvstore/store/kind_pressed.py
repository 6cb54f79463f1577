"""The ``pressed`` kind: a pressed cache of one context: per layer and KV head, the kept tokens'
keys and values and their context positions (the heads of one layer may keep different counts,
even none). Layer record ``{"kv_heads": H, "head_dim": d, "counts": [n_0, ..., n_{H-1}]}``;
payload ``layers.{i}.heads.{h}.keys`` / ``.values`` ``[1, n_h, d]`` (or the quantizer's parts of
them; a head with ``n_h == 0`` stores none) and ``layers.{i}.positions`` int32 ``[sum_h n_h]``.
A pressed cache serves its context by itself: a store may hold a context as pressed caches alone.
Written by :func:`encode_pressed`; read into a :class:`~kvstore.store.owned.OwnedView`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs import Codec, StoredTensor, StoredTensorBase, TensorRecord, get_codec
from kvstore.store.codecs.prerope import Rotary, with_rotary
from kvstore.store.frame import field_int
from kvstore.store.owned import PRESSED, OwnedKindBase, OwnedView, encode_owned, owned_header
from kvstore.store.owned_header import OwnedFacts, OwnedHeader, OwnedLayer, head_name, positions_name

ROLES = ("keys", "values")


class _NoTokens(StoredTensorBase):
    """A head that keeps no token: a ``[1, 0, head_dim]`` stored tensor with nothing to copy."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.shape, self.dtype = (1, 0, head_dim), dtype

    def copy_into(self, dest: torch.Tensor) -> None:
        if tuple(dest.shape) != self.shape or dest.dtype != self.dtype:
            raise ValueError(f"destination {tuple(dest.shape)}/{dest.dtype} != {self.shape}/{self.dtype}")

    def materialize(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)


def _layer_positions(rec: TensorRecord, layer: OwnedLayer, n_tokens: int, i: int) -> torch.Tensor:
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


class PressedKind(OwnedKindBase[OwnedLayer, OwnedView]):
    name = "pressed"
    stands_for_context = True
    keeps_part = True
    lossless_only = False

    def layer(self, record: Mapping[str, Any], n_tokens: int, i: int) -> OwnedLayer:
        heads = field_int(record, "kv_heads", 1)
        counts = record.get("counts")
        if (
            set(record) != {"kv_heads", "head_dim", "counts"}
            or not isinstance(counts, list)
            or len(counts) != heads
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= n_tokens for n in counts)
        ):
            raise CorruptEntryError(f"derived entry header layer {i}: its counts do not fit {heads} heads")
        return OwnedLayer(heads, field_int(record, "head_dim", 1), tuple(counts))

    def check_header(self, h: Mapping[str, Any]) -> Mapping[str, Any]:
        if "scores_dtype" in h:
            raise CorruptEntryError("derived entry header field 'scores_dtype' is missing or invalid")
        return {}

    def kept_pairs(self, header: OwnedHeader) -> int:
        return sum(layer.kept for layer in header.layers)

    def kept_fraction(self, header: OwnedHeader) -> float:
        total = sum(layer.kv_heads for layer in header.layers) * header.n_tokens
        return self.kept_pairs(header) / total if total else 0.0

    def data_bytes(self, header: OwnedHeader) -> int:
        return self.value_bytes(header) + 4 * self.kept_pairs(header)  # the positions, int32

    def value_bytes(self, header: OwnedHeader) -> int:
        item = dtypes.bits(header.dtype) // 8
        return sum(2 * layer.kept * layer.head_dim for layer in header.layers) * item

    def tensor_names(self, header: OwnedHeader, codec: Codec) -> list[str]:
        want = []
        for i, layer in enumerate(header.layers):
            want.append(positions_name(i))
            for h, m in enumerate(layer.counts or ()):
                if m:
                    for role in ROLES:
                        want += codec.quantizer.stored_names(head_name(i, h, role))
        return want

    def view(self, header: OwnedHeader, records: Mapping[str, TensorRecord], codec: Codec) -> OwnedView:
        dtype = dtypes.to_torch(header.dtype)
        kv: dict[tuple[int, int], tuple[StoredTensor, StoredTensor]] = {}
        positions: list[torch.Tensor] = []
        for i, layer in enumerate(header.layers):
            pos = _layer_positions(records[positions_name(i)], layer, header.n_tokens, i)
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
                        codec.quantizer.reader(role, head_name(i, h, role), records, shape, dtype, positions=where)
                        for role in ROLES
                    )
                except CodecError as exc:
                    raise CorruptEntryError(str(exc)) from None
                start += m
        return OwnedView(header, records, kv, tuple(positions))

    def export_tensors(self, view: OwnedView) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(view.header.layers):
            for j, pos in enumerate(view.positions(i).split(list(layer.counts or ()))):
                if pos.numel():
                    keys, values = view.kv(i, j)
                    tensors[head_name(i, j, "keys")] = keys.materialize()[0]
                    tensors[head_name(i, j, "values")] = values.materialize()[0]
                    tensors[f"layers.{i}.heads.{j}.positions"] = pos
        return tensors


KIND = PressedKind()  # its row in kvstore.store.kinds


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


__all__ = ["PressedKind", "encode_pressed"]
