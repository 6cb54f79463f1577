"""The Adapter: one model and tokenizer, and what kvstore does with them.

``Adapter(model, tokenizer)`` wraps any loaded Hugging Face causal LM; :meth:`Adapter.from_pretrained`
loads one by name. It owns the model's identity (fingerprint, dtype, keys) and tokenization, and
delegates the work: prefill and storing to :mod:`kvstore.model.build`, decoding to
:mod:`kvstore.model.decode`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from kvstore import dtypes
from kvstore.errors import ContextTooLongError
from kvstore.model import build, decode
from kvstore.model.build import BuildReport, LayerKV
from kvstore.model.cache import KVShape
from kvstore.model.decode import SampleResult
from kvstore.model.identity import model_fingerprint
from kvstore.progress import Progress
from kvstore.store.entry import Entry
from kvstore.store.keys import cache_key
from kvstore.store.kvstore import KVStore

TextOrIds = str | Sequence[int]
DEFAULT_RESERVE_TOKENS = 256


class Adapter:
    """Wraps a Hugging Face causal LM and its tokenizer.

    The model is put in eval mode. ``name`` is for display (default: the model's
    ``_name_or_path``); ``weight_files`` (the files the weights came from) let the fingerprint be
    memoized; ``reserve_tokens``: positions kept free for question and answer when limiting contexts.
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
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._weight_files = tuple(weight_files)
        self.reserve_tokens = reserve_tokens
        self._fingerprint = fingerprint
        self._shapes: list[KVShape] | None = None
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
        cls,
        name: str | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        attn_implementation: str = "sdpa",
    ) -> Adapter:
        """Load a model by name: ``None`` (bundled SmolLM2-135M-Instruct), a hub id, a local
        directory or a ``.gguf`` file. Raises ModelNotFoundError / ModelError."""
        from kvstore.model.loading import load_model

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

    def key(self, context_ids: Sequence[int]) -> str:
        """The store key of a tokenized context for this model and dtype."""
        return cache_key(self.fingerprint, self.dtype, context_ids)

    def entry(self, key: str, context_ids: Sequence[int], layers: LayerKV) -> Entry:
        """An :class:`Entry` of this model holding ``layers`` for a tokenized context."""
        return Entry(key, self.fingerprint, self.name, torch.as_tensor(context_ids, dtype=torch.int64), layers)

    def kv_shapes(self) -> list[KVShape]:
        """Per layer (kv_heads, key head_dim, value head_dim), from one tiny forward."""
        if self._shapes is None:
            layers = build.prefill(self, [[self.pad_id]])[0]
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
        per-layer ``(keys, values)`` ``[kv_heads, n_i, head_dim]`` of its own tokens only."""
        return build.prefill(self, batch)

    def generate_kv_cache(
        self,
        contexts: Sequence[TextOrIds],
        store: KVStore,
        *,
        batch_size: int = 8,
        max_batch_tokens: int | None = 16384,
        special_tokens: bool = True,
        truncate: bool = False,
        max_context_tokens: int | None = None,
        skip_errors: bool = False,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        shard: tuple[int, int] | None = None,
    ) -> BuildReport:
        """Prefill every distinct context not yet in ``store`` and store its KV cache.

        Contexts are tokenized with the model's special tokens (``special_tokens=False`` when the
        text already contains them, as a rendered chat template does), deduplicated by key, sorted
        by length and run in batches of up to ``batch_size`` rows and ``max_batch_tokens`` padded
        tokens. Encoding and writing happen on a background thread. Stored entries that fail
        verification are rebuilt. ``labels`` name the rows in error messages (default ``row i``).

        Raises ContextTooLongError (naming the row) for a context longer than
        :meth:`context_limit` unless ``truncate`` is set, which keeps the last tokens, or
        ``skip_errors`` is set, which counts the row in ``report.failed`` (with its message in
        ``report.errors``) and builds the others.

        ``shard=(i, n)`` builds only the distinct contexts whose key, read as a hex number from its
        first 16 digits, is ``i`` modulo ``n`` (``report.distinct`` counts those,
        ``report.other_shards`` the rest): ``n`` jobs with ``i = 0..n-1`` build everything once.
        Raises ValueError unless ``0 <= i < n``.
        """
        return build.build_caches(
            self, contexts, store, batch_size=batch_size, max_batch_tokens=max_batch_tokens,
            special_tokens=special_tokens, truncate=truncate, max_context_tokens=max_context_tokens,
            skip_errors=skip_errors, labels=labels, progress=progress, shard=shard,
        )  # fmt: skip

    def greedy_sample(
        self,
        contexts: Sequence[TextOrIds],
        questions: Sequence[TextOrIds],
        num_new_tokens: int = 20,
        *,
        use_cache: bool = True,
        store: KVStore | None = None,
        batch_size: int = 8,
        stop_at_eos: bool = True,
        special_tokens: bool = True,
        truncate: bool = False,
        max_context_tokens: int | None = None,
        return_details: bool = False,
        return_scores: bool = False,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
    ) -> torch.Tensor | SampleResult:
        """Greedy answers to ``questions[i]`` about ``contexts[i]``.

        Returns ``[n_rows, num_new_tokens]`` int64 token ids (a :class:`SampleResult` with
        ``return_details``). A row that produced EOS keeps it and is filled with the pad id
        (``self.pad_id``) after it when ``stop_at_eos``; decoding stops once every row has.

        ``use_cache=True`` reads each context's KV from ``store`` (computing, storing and using
        from memory the ones that are missing; without a store everything is computed in memory).
        ``use_cache=False`` is the reference: context and question run through the model together.
        Both give the same tokens (exactly in float64; in float32 up to rounding near ties).
        """
        result = decode.greedy_sample(
            self, contexts, questions, num_new_tokens, use_cache=use_cache, store=store, batch_size=batch_size,
            stop_at_eos=stop_at_eos, special_tokens=special_tokens, truncate=truncate,
            max_context_tokens=max_context_tokens, return_scores=return_scores, labels=labels, progress=progress,
        )  # fmt: skip
        return result if return_details else result.tokens

    def decode(self, tokens: torch.Tensor | Sequence[int]) -> str:
        """Text of one row of generated ids, up to (not including) its first EOS."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        for j, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[:j]
                break
        return self.tokenizer.decode(ids, skip_special_tokens=True)


__all__ = ["Adapter", "BuildReport", "SampleResult", "TextOrIds"]
