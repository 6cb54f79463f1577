"""The ``scores`` kind: a query-agnostic press's per-token scores of one context, per layer
``[kv_heads, n_tokens]`` (float32 or float64, stored exactly: never quantized, whatever the codec).
Layer record ``{"kv_heads": H}``; header field ``scores_dtype``; payload ``layers.{i}.scores``.
Written by :func:`kvstore.store.owned.encode_scores`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import CorruptEntryError
from kvstore.store.codecs import Codec, TensorRecord
from kvstore.store.frame import field_int
from kvstore.store.owned import OwnedKindBase
from kvstore.store.owned_header import SCORE_DTYPES, OwnedHeader, OwnedLayer, scores_name


class ScoresKind(OwnedKindBase):
    name = "scores"
    stands_for_context = False  # scores alone do not serve a context
    keeps_part = False
    lossless_only = True

    def layer(self, record: Mapping[str, Any], n_tokens: int, i: int) -> OwnedLayer:
        heads = field_int(record, "kv_heads", 1)
        if set(record) != {"kv_heads"}:
            raise CorruptEntryError(f"derived entry header layer {i} is malformed")
        return OwnedLayer(heads)

    def check_header(self, h: Mapping[str, Any]) -> str:
        if h.get("scores_dtype", "") not in SCORE_DTYPES:
            raise CorruptEntryError("derived entry header field 'scores_dtype' is missing or invalid")
        return h["scores_dtype"]

    def value_bytes(self, header: OwnedHeader) -> int:
        item = dtypes.bits(header.scores_dtype or "float32") // 8
        return sum(layer.kv_heads for layer in header.layers) * header.n_tokens * item

    def tensor_names(self, header: OwnedHeader, codec: Codec) -> list[str]:
        return [scores_name(i) for i in range(len(header.layers))]

    def read_tensors(self, header: OwnedHeader, records: Mapping[str, TensorRecord], codec: Codec) -> tuple:
        for i, layer in enumerate(header.layers):
            rec = records[scores_name(i)]
            if rec.shape != (layer.kv_heads, header.n_tokens) or dtypes.name(rec.dtype) != header.scores_dtype:
                raise CorruptEntryError(f"tensor {rec.name} is {rec.shape} {rec.dtype}, the header says otherwise")
        return {}, ()

    def export_tensors(self, view: Any) -> dict[str, torch.Tensor]:
        return {scores_name(i): view.scores(i) for i in range(len(view.header.layers))}


KIND = ScoresKind()  # its row in kvstore.store.kinds

__all__ = ["ScoresKind"]
