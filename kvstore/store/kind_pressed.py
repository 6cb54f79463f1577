"""The ``pressed`` kind: a pressed cache of one context: per layer and KV head, the kept tokens'
keys and values and their context positions (the heads of one layer may keep different counts,
even none). Layer record ``{"kv_heads": H, "head_dim": d, "counts": [n_0, ..., n_{H-1}]}``;
payload ``layers.{i}.heads.{h}.keys`` / ``.values`` ``[1, n_h, d]`` (or the quantizer's parts of
them; a head with ``n_h == 0`` stores none) and ``layers.{i}.positions`` int32 ``[sum_h n_h]``.
A pressed cache serves its context by itself: a store may hold a context as pressed caches alone.
Written by :func:`kvstore.store.owned.encode_pressed`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs import Codec, StoredTensor, TensorRecord
from kvstore.store.frame import field_int
from kvstore.store.owned import OwnedKindBase
from kvstore.store.owned_header import OwnedHeader, OwnedLayer, head_name, positions_name

ROLES = ("keys", "values")


class _NoTokens:
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


class PressedKind(OwnedKindBase):
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

    def check_header(self, h: Mapping[str, Any]) -> str:
        if "scores_dtype" in h:
            raise CorruptEntryError("derived entry header field 'scores_dtype' is missing or invalid")
        return ""

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

    def read_tensors(self, header: OwnedHeader, records: Mapping[str, TensorRecord], codec: Codec) -> tuple:
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
        return kv, tuple(positions)

    def export_tensors(self, view: Any) -> dict[str, torch.Tensor]:
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

__all__ = ["PressedKind"]
