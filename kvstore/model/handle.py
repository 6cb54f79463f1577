"""The model handle: one model and tokenizer, its identity, tokenization and cache layout.

:class:`ModelHandle` is what the model layer's lower code takes (prefill, chains, decoding,
scoring, the writer): the model and tokenizer, the identity that keys are made of (fingerprint,
dtype, device, attention implementation), pad and EOS ids, the cache layout, tokenization with
its context limit, and a context's plan as a chain of chunks. It does no orchestration;
:class:`kvstore.model.adapter.Adapter` (the public front) adds building, sampling, scoring and
sweeps on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from kvstore import dtypes
from kvstore.errors import ContextTooLongError, ModelError
from kvstore.model.compute import forward
from kvstore.model.compute.cache import KVShape, LayerKV
from kvstore.model.family import families
from kvstore.model.family.layout import CacheLayout, cache_layout
from kvstore.model.family.rope import rotary_of, rotary_refusal
from kvstore.model.load.identity import model_fingerprint
from kvstore.model.paths.base import CachePath, path_for
from kvstore.model.plan import chains
from kvstore.model.plan.chains import ContextPlan
from kvstore.model.variants import hooks
from kvstore.store.codecs.prerope import Rotary, needs_rotary
from kvstore.store.entry import Entry
from kvstore.store.keys import DEFAULT_CHUNK_TOKENS, chain_seed
from kvstore.store.kvstore import KVStore

TextOrIds = str | Sequence[int]
H = TypeVar("H", bound="ModelHandle")
DEFAULT_RESERVE_TOKENS = 256
# Chunked prefill, automatic: attention that materializes a score matrix per layer (eager) runs
# in pieces of 512 positions (less memory and, measured on CPU, less time); fused kernels (sdpa,
# flash) in pieces of 8192 (on CPU, 8k tokens in masked pieces took 22-30% longer than one causal
# forward: experiments/results/memory.json).
AUTO_PREFILL_PIECE = {"eager": 512}
AUTO_PREFILL_PIECE_FUSED = 8192
# Tokens at the end of a prompt head that may merge with the context's first word when tokenized together.
HEAD_MERGE_TOKENS = 2


class ModelHandle:
    """A Hugging Face causal LM and its tokenizer, as the model layer sees them.

    The model is put in eval mode. ``name`` is for display (default: the model's
    ``_name_or_path``); ``weight_files`` (the files the weights came from) let the fingerprint be
    memoized; ``reserve_tokens``: positions kept free for question and answer when limiting contexts;
    ``prefill_chunk_tokens``: longer prefills run in pieces of this many positions (chunked
    prefill: activation memory bounded by the piece; 0: one forward; None: automatic, see
    :attr:`prefill_piece`).
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
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._weight_files = tuple(weight_files)
        self.reserve_tokens = reserve_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._fingerprint = fingerprint
        self._shapes: list[KVShape] | None = None
        self._layout: CacheLayout | None = None
        self._rotary: tuple[Rotary | None] | None = None
        self._prefixes: dict[tuple, list[int]] = {}
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {i for i in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])) if i is not None}
        self.eos_ids: frozenset[int] = frozenset(ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id: int = pad if pad is not None else (eos if eos is not None else 0)

    @classmethod
    def from_pretrained(
        cls: type[H],
        name: str | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        attn_implementation: str | None = None,
    ) -> H:
        """Load a model by name: ``None`` (bundled SmolLM2-135M-Instruct), a hub id, a local
        directory or a ``.gguf`` file. ``attn_implementation``: default SDPA where the architecture
        has it. Raises ModelNotFoundError / ModelError."""
        from kvstore.model.load.loading import load_model

        loaded = load_model(name, dtype=dtype, device=device, attn_implementation=attn_implementation)
        return cls(loaded.model, loaded.tokenizer, name=loaded.name, weight_files=loaded.weight_files)

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
        own = hooks.dense_attn_implementation(self.model)
        return str(own or getattr(self.model.config, "_attn_implementation", None) or "eager")

    @property
    def numerics(self) -> dict[str, str]:
        """Where this adapter's numbers come from: device type and attention implementation (both
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

    def plan(
        self, context_ids: Sequence[int], store: KVStore | None = None, *, prefix: TextOrIds | None = None,
        special_tokens: bool = True,
    ) -> ContextPlan:  # fmt: skip
        """A tokenized context as a chain of chunks for ``store`` (its chunk size and lossy codec;
        without a store: 512-token chunks, lossless). ``prefix``: the contexts' shared head (text
        or ids, e.g. a chat template's system turn or a few-shot block); a chunk ends where the
        context's ids stop agreeing with the head's, so the head is stored once for every context.
        (A head ending in a space or newline may merge with the context's first word into one
        token: the boundary then falls just before that token.)"""
        boundaries = []
        if prefix is not None:
            head = self._prefix_ids(prefix, special_tokens)
            agree = 0
            for a, b in zip(head, context_ids):
                if a != b:
                    break
                agree += 1
            if agree >= max(1, len(head) - HEAD_MERGE_TOKENS) and agree < len(context_ids):
                boundaries.append(agree)
        return chains.plan(
            self, context_ids, chunk_tokens=store.chunk_tokens if store is not None else DEFAULT_CHUNK_TOKENS,
            lossy=store.codec.identity if store is not None else "", boundaries=boundaries, store=store,
        )  # fmt: skip

    def _prefix_ids(self, prefix: TextOrIds, special_tokens: bool) -> list[int]:
        key = (prefix if isinstance(prefix, str) else tuple(prefix), special_tokens)
        if key not in self._prefixes:
            self._prefixes[key] = self.encode_context(prefix, special_tokens=special_tokens) if prefix else []
        return self._prefixes[key]

    def key(self, context_ids: Sequence[int], store: KVStore | None = None, **kwargs) -> str:
        """The key of a tokenized context (its chain's last chunk) for this model, in ``store``
        (see :meth:`plan`)."""
        return self.plan(context_ids, store, **kwargs).key

    def entry(self, key: str, token_ids: Sequence[int], layers: LayerKV, *, parent: str = "", start: int = 0) -> Entry:
        """An :class:`Entry` (a chunk at context position ``start``) of this model holding ``layers``."""
        return Entry(
            key, self.fingerprint, self.name, torch.as_tensor(token_ids, dtype=torch.int64), layers, parent=parent,
            start=start, kinds=("attn",) * len(layers), numerics=self.numerics, rotary=self.rotary,
        )  # fmt: skip

    def check_supported(self, store: KVStore | None = None) -> None:
        """Raise ModelError (one line naming the family and why) unless kvstore can store and reuse
        this model's caches exactly (see :mod:`kvstore.model.family.families` and
        :mod:`kvstore.model.family.layout`), and, with ``store``, in that store's codec: lossy codecs
        are measured on models whose every layer is full attention, and refused for the others."""
        reason = families.refusal(self.model.config)
        if reason is not None:
            raise ModelError(reason)
        path = self.path  # a windowed or recurrent model is probed once here (its layout); raises ModelError
        if store is not None and not store.codec.lossless and not path.supports("lossy"):
            raise ModelError(
                f"lossy codec {store.codec.spec} is only for models whose every layer is full attention "
                f"(this {self.model.config.model_type} model has windowed or recurrent layers); use a lossless codec"
            )
        if store is not None and needs_rotary(store.codec) and self.rotary is None:
            raise ModelError(
                f"lossy codec {store.codec.spec} quantizes keys before their rotary embedding, and this model cannot "
                f"have its rotation undone ({rotary_refusal(self.model)}); use int4 or int8"
            )

    @property
    def layout(self) -> CacheLayout:
        """What each layer keeps and how it is handed back (:mod:`kvstore.model.family.layout`);
        computed on first use."""
        if self._layout is None:
            self._layout = cache_layout(self.model, self.pad_id)
        return self._layout

    @property
    def path(self) -> CachePath:
        """How this model's cache is stored and reused (:mod:`kvstore.model.paths.base`): chosen once,
        from :attr:`layout`."""
        return path_for(self.layout.dense)

    def kv_shapes(self) -> list[KVShape]:
        """Per layer (kv_heads, key head_dim, value head_dim), from one tiny forward."""
        if self._shapes is None:
            layers = forward.prefill(self, [[self.pad_id]])[0]
            self._shapes = [(k.shape[0], k.shape[-1], v.shape[-1]) for k, v in layers]
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

    @staticmethod
    def row_label(labels: Sequence[str] | None, i: int) -> str:
        """How errors name row ``i``: the caller's label (e.g. ``file.jsonl:12``) or ``row i``."""
        return labels[i] if labels is not None else f"row {i}"

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

    # -- work -----------------------------------------------------------------------------------
    def prefill(self, batch: Sequence[Sequence[int]]) -> list[LayerKV]:
        """Run the model over a batch of token-id lists (right-padded together); per row, the
        per-layer ``(keys, values)`` ``[kv_heads, n_i, head_dim]`` of its own tokens only.
        Dense (full-attention) models only: raises ModelError for the others."""
        if not self.path.supports("prefill"):
            raise ModelError(f"{self.name}: prefill gives full-attention keys and values; use generate_kv_cache")
        return forward.prefill(self, batch)


__all__ = ["AUTO_PREFILL_PIECE", "DEFAULT_RESERVE_TOKENS", "HEAD_MERGE_TOKENS", "ModelHandle", "TextOrIds"]
