"""The model handle: one model and tokenizer, its identity, tokenization and cache layout.

:class:`ModelHandle` is what the model layer's lower code takes (planning, the stages, the cache
paths, scoring, the writer): the model and tokenizer, the identity that keys are made of
(fingerprint, dtype, device, attention implementation), pad and EOS ids, the cache layout and the
key/value shapes, and tokenization with its context limit. It sits at the bottom of the model layer
(it imports nothing that takes a handle) and does no work; :class:`kvstore.model.adapter.Adapter`,
the public front, composes one and adds building, sampling, scoring and sweeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvstore import dtypes
from kvstore.errors import ContextTooLongError
from kvstore.facts import ATTN
from kvstore.model.compute import attention
from kvstore.model.family.layout import CacheLayout, KVShape, LayerKV, cache_layout
from kvstore.model.family.rope import rotary_of
from kvstore.model.load.identity import model_fingerprint
from kvstore.process import forced_staging
from kvstore.store.codecs.prerope import Rotary
from kvstore.store.entry import Entry
from kvstore.store.keys import chain_seed

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.io.ring import Ring

TextOrIds = str | Sequence[int]
DEFAULT_RESERVE_TOKENS = 256
# Chunked prefill, automatic: attention that materializes a score matrix per layer (eager) runs
# in pieces of 512 positions (less memory and, measured on CPU, less time); fused kernels (sdpa,
# flash) in pieces of 8192 (on CPU, 8k tokens in masked pieces took 22-30% longer than one causal
# forward: experiments/results/memory.json).
AUTO_PREFILL_PIECE = {"eager": 512}
AUTO_PREFILL_PIECE_FUSED = 8192
# on the model while a kvstore attention implementation is switched on: the model's own one
DENSE_ATTN_ATTR = "_kvstore_dense_attn"


def dense_attn_implementation(model: torch.nn.Module) -> str | None:
    """The model's own attention implementation while kvstore has switched another one on (a
    decode-attention variant, a press's query capture); None otherwise."""
    return getattr(model, DENSE_ATTN_ATTR, None)


def row_label(labels: Sequence[str] | None, i: int) -> str:
    """How errors name row ``i``: the caller's label (e.g. ``file.jsonl:12``) or ``row i``."""
    return labels[i] if labels is not None else f"row {i}"


class ModelHandle:
    """A Hugging Face causal LM and its tokenizer, as the model layer sees them.

    The model is put in eval mode. ``name`` is for display (default: the model's
    ``_name_or_path``); ``weight_files`` (the files the weights came from) let the fingerprint be
    memoized; ``reserve_tokens``: positions kept free for question and answer when limiting contexts;
    ``prefill_chunk_tokens``: longer prefills run in pieces of this many positions (chunked
    prefill: activation memory bounded by the piece; 0: one forward; None: automatic, see
    :attr:`prefill_piece`); ``force_staging``: loads go through the accelerator staging
    (:class:`kvstore.model.io.staging.Staging`) on CPU too (tests; None: whether
    ``KVSTORE_FORCE_STAGING`` is set, :func:`kvstore.process.forced_staging`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        *,
        name: str | None = None,
        weight_files: Sequence = (),
        fingerprint: str | None = None,
        reserve_tokens: int = DEFAULT_RESERVE_TOKENS,
        prefill_chunk_tokens: int | None = None,
        force_staging: bool | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._weight_files = tuple(weight_files)
        self.reserve_tokens = reserve_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.force_staging = forced_staging() if force_staging is None else force_staging
        self._fingerprint = fingerprint
        self._shapes: list[KVShape] | None = None
        self._layout: CacheLayout | None = None
        self._rotary: tuple[Rotary | None] | None = None
        self._prefixes: dict[tuple, list[int]] = {}
        self.staging_ring: Ring | None = None  # pinned staging slots of loads into the accelerator (Ring.of)
        attention.install()  # kvstore's masked forwards attend to grouped KV heads in place (see there)
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {i for i in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])) if i is not None}
        self.eos_ids: frozenset[int] = frozenset(ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id: int = pad if pad is not None else (eos if eos is not None else 0)

    # -- identity -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def dtype_name(self) -> str:
        return dtypes.name(self.dtype)

    @property
    def fingerprint(self) -> str:
        """The model fingerprint (computed on first use, memoized by weight-file identity)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model, weight_files=self._weight_files)
        return self._fingerprint

    @property
    def rotary(self) -> Rotary | None:
        """The rotary embedding the model applies to its keys (:mod:`kvstore.model.family.rope`), or None
        for a model whose rotary layout kvstore does not undo."""
        if self._rotary is None:
            self._rotary = (rotary_of(self.model),)
        return self._rotary[0]

    @property
    def prefill_piece(self) -> int:
        """Positions per prefill forward (0: the whole context at once): ``prefill_chunk_tokens``,
        or when None 512 for eager attention and 8192 for fused kernels."""
        if self.prefill_chunk_tokens is not None:
            return self.prefill_chunk_tokens
        return AUTO_PREFILL_PIECE.get(self.attn_implementation, AUTO_PREFILL_PIECE_FUSED)

    @property
    def attn_implementation(self) -> str:
        """The model's own attention implementation (also while a decode-attention variant is
        switched on: keys and entries always name the one that computed the stored tensors)."""
        own = dense_attn_implementation(self.model)
        return str(own or getattr(self.model.config, "_attn_implementation", None) or "eager")

    @property
    def numerics(self) -> dict[str, str]:
        """Where this handle's numbers come from: device type and attention implementation (both
        part of every key: other kernels give other low-order bits), torch and transformers
        versions (recorded in every entry, not keyed)."""
        import transformers

        return {
            "device": self.device.type,
            "attn": self.attn_implementation,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }

    def chain_seed(self, lossy: str = "") -> str:
        """The seed of this model's chains: fingerprint, dtype, device type, attention
        implementation and a lossy codec's spec (see :mod:`kvstore.store.keys`)."""
        return chain_seed(
            self.fingerprint, self.dtype, device=self.device.type, attn=self.attn_implementation, lossy=lossy
        )

    def prefix_ids(self, prefix: TextOrIds, special_tokens: bool) -> list[int]:
        """A shared head's ids (memoized): text tokenized as a context, ids as given."""
        key = (prefix if isinstance(prefix, str) else tuple(prefix), special_tokens)
        if key not in self._prefixes:
            self._prefixes[key] = self.encode_context(prefix, special_tokens=special_tokens) if prefix else []
        return self._prefixes[key]

    def entry(self, key: str, token_ids: Sequence[int], layers: LayerKV, *, parent: str = "", start: int = 0) -> Entry:
        """An :class:`Entry` (a chunk at context position ``start``) of this model holding ``layers``."""
        return Entry(
            key, self.fingerprint, self.name, torch.as_tensor(token_ids, dtype=torch.int64), layers, parent=parent,
            start=start, kinds=(ATTN,) * len(layers), numerics=self.numerics, rotary=self.rotary,
        )  # fmt: skip

    @property
    def layout(self) -> CacheLayout:
        """What each layer keeps and how it is handed back (:mod:`kvstore.model.family.layout`);
        computed on first use."""
        if self._layout is None:
            self._layout = cache_layout(self.model, self.pad_id)
        return self._layout

    def kv_shapes(self) -> list[KVShape]:
        """Per layer (kv_heads, key head_dim, value head_dim), from one tiny forward."""
        if self._shapes is None:
            cache = DynamicCache()
            with torch.inference_mode():
                self.model(
                    input_ids=torch.tensor([[self.pad_id]], device=self.device),
                    **{self.layout.cache_arg: cache},
                    use_cache=True,
                    logits_to_keep=1,
                )
            layers: list[Any] = list(cache.layers)
            self._shapes = [(k.keys.shape[1], k.keys.shape[-1], k.values.shape[-1]) for k in layers]
        return self._shapes

    def kv_bytes_per_token(self) -> int:
        """Uncompressed KV bytes one context token takes for this model and dtype."""
        return sum(h * (dk + dv) for h, dk, dv in self.kv_shapes()) * self.dtype.itemsize

    # -- tokenization ---------------------------------------------------------------------------
    def encode_context(self, context: TextOrIds, *, special_tokens: bool = True) -> list[int]:
        """Token ids of a context: with the model's own special tokens (BOS where it uses one).
        A list of ints is taken as ids already."""
        if not isinstance(context, str):
            return [int(t) for t in context]
        return list(self.tokenizer(context, add_special_tokens=special_tokens)["input_ids"])

    def encode_question(self, question: TextOrIds) -> list[int]:
        """Token ids of a question: no special tokens (no second BOS mid-sequence)."""
        if not isinstance(question, str):
            return [int(t) for t in question]
        return list(self.tokenizer(question, add_special_tokens=False)["input_ids"])

    def context_limit(self, max_context_tokens: int | None = None) -> int | None:
        """Most tokens a context may have: ``max_context_tokens`` if given, else the model's
        positions minus :attr:`reserve_tokens` (room for a question and its answer). It depends
        on the context alone, so build and sample truncate (and key) a context the same way."""
        if max_context_tokens is not None:
            return max_context_tokens
        if self.max_positions:
            return max(1, self.max_positions - self.reserve_tokens)
        return None

    def context_ids(
        self,
        context: TextOrIds,
        *,
        special_tokens: bool = True,
        truncate: bool = False,
        max_context_tokens: int | None = None,
        label: str = "context",
    ) -> list[int]:
        """A context's token ids within :meth:`context_limit`: longer ones are left-truncated with
        ``truncate``, else ContextTooLongError names ``label``; an empty one is an error too."""
        ids = self.encode_context(context, special_tokens=special_tokens)
        limit = self.context_limit(max_context_tokens)
        if limit is not None and len(ids) > limit:
            if not truncate:
                raise ContextTooLongError(
                    f"{label}: context has {len(ids)} tokens but at most {limit} fit "
                    f"(model positions {self.max_positions}, {self.reserve_tokens} kept for question and answer); "
                    "shorten it or ask for left-truncation (truncate=True / --truncate)"
                )
            ids = ids[len(ids) - limit :]
        if not ids:
            raise ContextTooLongError(f"{label}: context is empty after tokenization")
        return ids


__all__ = [
    "AUTO_PREFILL_PIECE",
    "DEFAULT_RESERVE_TOKENS",
    "DENSE_ATTN_ATTR",
    "ModelHandle",
    "TextOrIds",
    "dense_attn_implementation",
    "row_label",
]
