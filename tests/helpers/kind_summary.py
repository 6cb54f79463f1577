"""A kind of owned entry defined outside the library, in one module (issue 48, item 4): its layer
record type, a header field of its own, its view and its encoder are all here, and nothing in it
subclasses a built-in kind or record (``OwnedKindBase`` is the half every owned kind shares).

A ``summary`` entry holds, per layer, one float32 number per KV head (``layers.{i}.summary``,
``[kv_heads]``); its layer record is ``{"kv_heads": H, "statistic": NAME}`` (a
:class:`SummaryLayer`), and its header keeps ``summary_of`` (which tensor was summarized:
``"keys"`` or ``"values"``), read back into ``header.fields``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import CorruptEntryError
from kvstore.store.codecs import Codec, TensorRecord, get_codec
from kvstore.store.frame import field_int
from kvstore.store.owned import OwnedKindBase, encode_owned, owned_header
from kvstore.store.owned_header import OwnedFacts, OwnedHeader

NAME = "summary"
SUMMARY_OF = ("keys", "values")


@dataclass(frozen=True)
class SummaryLayer:
    """One layer's record: its KV heads and the statistic taken over each head's tokens."""

    kv_heads: int
    statistic: str

    def record(self) -> dict[str, Any]:
        return {"kv_heads": self.kv_heads, "statistic": self.statistic}


@dataclass(frozen=True)
class SummaryView:
    """A verified summary entry: its header and each layer's numbers."""

    header: OwnedHeader
    records: Mapping[str, TensorRecord]

    def summary(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s per-head numbers, float32 ``[kv_heads]``."""
        return self.records[tensor_name(layer)].materialize()


def tensor_name(layer: int) -> str:
    return f"layers.{layer}.summary"


class SummaryKind(OwnedKindBase[SummaryLayer, SummaryView]):
    name = NAME
    stands_for_context = False
    keeps_part = False
    lossless_only = True

    def layer(self, record: Mapping[str, Any], n_tokens: int, i: int) -> SummaryLayer:
        statistic = record.get("statistic")
        if set(record) != {"kv_heads", "statistic"} or not isinstance(statistic, str) or not statistic:
            raise CorruptEntryError(f"summary layer {i} is malformed")
        return SummaryLayer(field_int(record, "kv_heads", 1), statistic)

    def check_header(self, h: Mapping[str, Any]) -> Mapping[str, Any]:
        if h.get("summary_of") not in SUMMARY_OF:
            raise CorruptEntryError("summary header field 'summary_of' is missing or invalid")
        return {"summary_of": h["summary_of"]}

    def value_bytes(self, header: OwnedHeader) -> int:
        return 4 * sum(layer.kv_heads for layer in header.layers)

    def tensor_names(self, header: OwnedHeader, codec: Codec) -> list[str]:
        return [tensor_name(i) for i in range(len(header.layers))]

    def view(self, header: OwnedHeader, records: Mapping[str, TensorRecord], codec: Codec) -> SummaryView:
        for i, layer in enumerate(header.layers):
            rec = records[tensor_name(i)]
            if rec.shape != (layer.kv_heads,) or rec.dtype != torch.float32:
                raise CorruptEntryError(f"tensor {rec.name} does not match the header")
        return SummaryView(header, records)

    def export_tensors(self, view: SummaryView) -> dict[str, torch.Tensor]:
        return {tensor_name(i): view.summary(i) for i in range(len(view.header.layers))}


def encode_summary(
    facts: OwnedFacts, summaries: Sequence[torch.Tensor], *, statistic: str = "mean-norm", summary_of: str = "keys"
) -> tuple[str, bytes]:
    """A context's per-layer summaries (``summaries[i]``: float32 ``[kv_heads]``) as an owned entry:
    ``(key, bytes to store)``."""
    if summary_of not in SUMMARY_OF:
        raise ValueError(f"summary_of is one of {SUMMARY_OF}, not {summary_of!r}")
    header = owned_header(facts, NAME, statistic, {"method": statistic})
    tensors = [
        (tensor_name(i), t.detach().to("cpu", torch.float32).contiguous(), None) for i, t in enumerate(summaries)
    ]
    layers = [SummaryLayer(int(t.shape[0]), statistic).record() for t in summaries]
    return encode_owned(header, layers, tensors, get_codec("raw"), fields={"summary_of": summary_of})
