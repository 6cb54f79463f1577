"""What an :class:`~kvstore.model.adapter.Adapter` shows of the model it wraps: read-only views of
its :class:`~kvstore.model.handle.ModelHandle` (model, tokenizer, identity, layout, tokenization).
The Adapter composes the handle (``adapter.handle``) and adds the work; this base keeps the two
apart."""

from __future__ import annotations

from typing import Any

import torch

from kvstore.model.compute.cache import KVShape
from kvstore.model.family.layout import CacheLayout
from kvstore.model.handle import ModelHandle, TextOrIds
from kvstore.store.codecs.prerope import Rotary


class ModelView:
    """The model an Adapter wraps, as its handle holds it."""

    handle: ModelHandle

    @property
    def model(self) -> Any:
        return self.handle.model

    @property
    def tokenizer(self) -> Any:
        return self.handle.tokenizer

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def device(self) -> torch.device:
        return self.handle.device

    @property
    def dtype(self) -> torch.dtype:
        return self.handle.dtype

    @property
    def dtype_name(self) -> str:
        return self.handle.dtype_name

    @property
    def fingerprint(self) -> str:
        """The model fingerprint (config and weights; computed on first use)."""
        return self.handle.fingerprint

    @property
    def pad_id(self) -> int:
        return self.handle.pad_id

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.handle.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self.handle.eos_ids = frozenset(ids)

    @property
    def max_positions(self) -> int | None:
        return self.handle.max_positions

    @property
    def reserve_tokens(self) -> int:
        return self.handle.reserve_tokens

    @property
    def prefill_chunk_tokens(self) -> int | None:
        return self.handle.prefill_chunk_tokens

    @prefill_chunk_tokens.setter
    def prefill_chunk_tokens(self, tokens: int | None) -> None:
        self.handle.prefill_chunk_tokens = tokens

    @property
    def prefill_piece(self) -> int:
        """Positions per prefill forward (0: the whole context at once)."""
        return self.handle.prefill_piece

    @property
    def attn_implementation(self) -> str:
        """The model's own attention implementation (the one keys name)."""
        return self.handle.attn_implementation

    @property
    def rotary(self) -> Rotary | None:
        """The rotary embedding the pre-rotation codecs undo (None: a model they refuse)."""
        return self.handle.rotary

    @property
    def layout(self) -> CacheLayout:
        """What each layer keeps (:mod:`kvstore.model.family.layout`)."""
        return self.handle.layout

    def kv_shapes(self) -> list[KVShape]:
        """Per layer (kv_heads, key head_dim, value head_dim)."""
        return self.handle.kv_shapes()

    def kv_bytes_per_token(self) -> int:
        """Uncompressed KV bytes one context token takes for this model and dtype."""
        return self.handle.kv_bytes_per_token()

    def encode_context(self, context: TextOrIds, *, special_tokens: bool = True) -> list[int]:
        """Token ids of a context (with the model's special tokens); ids are taken as they are."""
        return self.handle.encode_context(context, special_tokens=special_tokens)

    def encode_question(self, question: TextOrIds) -> list[int]:
        """Token ids of a question (no special tokens); ids are taken as they are."""
        return self.handle.encode_question(question)

    def context_limit(self, max_context_tokens: int | None = None) -> int | None:
        """Most tokens a context may have (``max_context_tokens``, else positions less the reserve)."""
        return self.handle.context_limit(max_context_tokens)


__all__ = ["ModelView"]
