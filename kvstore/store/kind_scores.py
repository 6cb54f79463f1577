"""The ``scores`` kind: a query-agnostic press's per-token scores of one context, per layer
``[kv_heads, n_tokens]`` (float32 or float64, stored exactly: never quantized, whatever the codec).
Layer record ``{"kv_heads": H}``; header field ``scores_dtype``; payload ``layers.{i}.scores``.
Written by :func:`encode_scores`; read into a :class:`~kvstore.store.owned.OwnedView`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvstore import dtypes
from kvstore.errors import CorruptEntryError
from kvstore.store.codecs import Codec, TensorRecord, get_codec
from kvstore.store.frame import field_int
from kvstore.store.owned import SCORES, OwnedKindBase, OwnedView, encode_owned, owned_header
from kvstore.store.owned_header import SCORE_DTYPES, OwnedFacts, OwnedHeader, OwnedLayer, scores_name


class ScoresKind(OwnedKindBase[OwnedLayer, OwnedView]):
    name = "scores"
    stands_for_context = False  # scores alone do not serve a context
    keeps_part = False
    lossless_only = True

    def layer(self, record: Mapping[str, Any], n_tokens: int, i: int) -> OwnedLayer:
        heads = field_int(record, "kv_heads", 1)
        if set(record) != {"kv_heads"}:
            raise CorruptEntryError(f"derived entry header layer {i} is malformed")
        return OwnedLayer(heads)

    def check_header(self, h: Mapping[str, Any]) -> Mapping[str, Any]:
        if h.get("scores_dtype", "") not in SCORE_DTYPES:
            raise CorruptEntryError("derived entry header field 'scores_dtype' is missing or invalid")
        return {"scores_dtype": h["scores_dtype"]}

    def value_bytes(self, header: OwnedHeader) -> int:
        item = dtypes.bits(header.scores_dtype or "float32") // 8
        return sum(layer.kv_heads for layer in header.layers) * header.n_tokens * item

    def tensor_names(self, header: OwnedHeader, codec: Codec) -> list[str]:
        return [scores_name(i) for i in range(len(header.layers))]

    def view(self, header: OwnedHeader, records: Mapping[str, TensorRecord], codec: Codec) -> OwnedView:
        for i, layer in enumerate(header.layers):
            rec = records[scores_name(i)]
            if rec.shape != (layer.kv_heads, header.n_tokens) or dtypes.name(rec.dtype) != header.scores_dtype:
                raise CorruptEntryError(f"tensor {rec.name} is {rec.shape} {rec.dtype}, the header says otherwise")
        return OwnedView(header, records, {}, ())

    def export_tensors(self, view: OwnedView) -> dict[str, torch.Tensor]:
        return {scores_name(i): view.scores(i) for i in range(len(view.header.layers))}


KIND = ScoresKind()  # its row in kvstore.store.kinds


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


__all__ = ["ScoresKind", "encode_scores"]
