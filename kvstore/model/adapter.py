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
from kvstore.errors import ContextTooLongError, ModelError
from kvstore.model import build, chains, decode, families, forward, hooks, scoring, sparse
from kvstore.model.build import BuildReport
from kvstore.model.cache import KVShape, LayerKV
from kvstore.model.chains import ContextPlan
from kvstore.model.decode import SampleResult
from kvstore.model.identity import model_fingerprint
from kvstore.model.layout import CacheLayout, cache_layout
from kvstore.model.rope import rotary_of, rotary_refusal
from kvstore.model.scoring import GenerationContext, RollingResult, RollingResults, ScoreResult
from kvstore.progress import Progress
from kvstore.store.codecs.prerope import Rotary, needs_rotary
from kvstore.store.entry import Entry
from kvstore.store.keys import DEFAULT_CHUNK_TOKENS, chain_seed
from kvstore.store.kvstore import KVStore

TextOrIds = str | Sequence[int]
DEFAULT_RESERVE_TOKENS = 256
# Chunked prefill, automatic: attention that materializes a score matrix per layer (eager) runs
# in pieces of 512 positions (less memory and, measured on CPU, less time); fused kernels (sdpa,
# flash) in pieces of 8192 (on CPU, 8k tokens in masked pieces took 22-30% longer than one causal
# forward: experiments/results/memory.json).
AUTO_PREFILL_PIECE = {"eager": 512}
AUTO_PREFILL_PIECE_FUSED = 8192
# Tokens at the end of a prompt head that may merge with the context's first word when tokenized together.
HEAD_MERGE_TOKENS = 2


class Adapter:
    """Wraps a Hugging Face causal LM and its tokenizer.

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
        cls,
        name: str | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        attn_implementation: str | None = None,
    ) -> Adapter:
        """Load a model by name: ``None`` (bundled SmolLM2-135M-Instruct), a hub id, a local
        directory or a ``.gguf`` file. ``attn_implementation``: default SDPA where the architecture
        has it. Raises ModelNotFoundError / ModelError."""
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

    @property
    def rotary(self) -> Rotary | None:
        """The rotary embedding the model applies to its keys (:mod:`kvstore.model.rope`), or None
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
        this model's caches exactly (see :mod:`kvstore.model.families` and
        :mod:`kvstore.model.layout`), and, with ``store``, in that store's codec: lossy codecs
        are measured on models whose every layer is full attention, and refused for the others."""
        reason = families.refusal(self.model.config)
        if reason is not None:
            raise ModelError(reason)
        layout = self.layout  # a windowed or recurrent model is probed once here; raises ModelError
        if store is not None and not store.codec.lossless and not layout.dense:
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
        """What each layer keeps and how it is handed back (:mod:`kvstore.model.layout`);
        computed on first use."""
        if self._layout is None:
            self._layout = cache_layout(self.model, self.pad_id)
        return self._layout

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
        if not self.layout.dense:
            raise ModelError(f"{self.name}: prefill gives full-attention keys and values; use generate_kv_cache")
        return forward.prefill(self, batch)

    def generate_kv_cache(
        self,
        contexts: Sequence[TextOrIds],
        store: KVStore,
        *,
        batch_size: int | None = None,
        max_batch_tokens: int | None = 16384,
        special_tokens: bool = True,
        truncate: bool = False,
        max_context_tokens: int | None = None,
        skip_errors: bool = False,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        prefix: TextOrIds | None = None,
        shard: tuple[int, int] | None = None,
    ) -> BuildReport:
        """Store the cache of every distinct context not stored whole and intact in ``store``.

        Contexts are tokenized with the model's special tokens (``special_tokens=False`` when the
        text already contains them, as a rendered chat template does) and stored as chains of
        chunks (see :meth:`plan`; ``prefix`` names the contexts' shared head). A context whose
        chain is stored whole and intact is skipped; the others are computed from their longest
        stored prefix on, in batches of up to ``batch_size`` rows (default: 1 on CPU, where it was
        measured faster than padded batches, 8 on accelerators) and ``max_batch_tokens`` padded
        tokens; chunks several of them share are computed once. Corrupt chunks are rebuilt.
        Encoding and writing happen on a background thread. ``labels`` name the rows in error
        messages (default ``row i``).

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
            skip_errors=skip_errors, labels=labels, progress=progress, prefix=prefix, shard=shard,
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
        prefix: TextOrIds | None = None,
        stop_strings: Sequence[str] = (),
        max_batch_tokens: int | None = None,
        compile: bool = False,
        generation_context: hooks.GenerationContext | None = None,
        decode_attention: str | sparse.AttentionFunction | None = None,
    ) -> torch.Tensor | SampleResult:
        """Greedy answers to ``questions[i]`` about ``contexts[i]``.

        Returns ``[n_rows, num_new_tokens]`` int64 token ids (a :class:`SampleResult` with
        ``return_details``). A row that produced EOS keeps it and is filled with the pad id
        (``self.pad_id``) after it when ``stop_at_eos``; so is a row whose text contains one of
        ``stop_strings`` (e.g. ``"\n"``: the token completing it is kept). Decoding stops once
        every row has stopped.

        Rows run in batches of up to ``batch_size`` rows and ``max_batch_tokens`` padded tokens
        (context + question + new tokens, times rows: a memory budget). A batch that runs out of
        memory is run again as two halves (answers do not depend on the batch).

        ``use_cache=True`` loads the longest stored prefix of each context's chain from ``store``
        and computes only the rest (storing what it computed unless the store is read-only;
        without a store everything is computed in memory). ``use_cache=False`` is the reference:
        context and question run through the model together. Both give the same tokens (exactly
        in float64; in float32 up to rounding near ties). ``prefix``: as for
        :meth:`generate_kv_cache` (use the same value for both, or keys will not match).

        ``compile``: decode steps run with fixed shapes (KV slots in buckets of 256, a 4-D mask over
        all of them) under ``torch.compile``, compiled once per batch size and slot bucket
        (:mod:`kvstore.model.static`); models whose layers are all full attention only.

        ``generation_context``: a callable taking the model and returning a context manager,
        entered around each batch's question forward and decode steps only (never around a
        prefill: contexts are loaded, or computed and stored, before it is entered; see
        :mod:`kvstore.model.hooks`). ``decode_attention``: an attention function used for those
        steps (``topk:K``, ``sparq:R:K``, ``dense``, a ``module:function`` path or a function
        with transformers' attention interface; see :mod:`kvstore.model.sparse`). An exception
        raised under either becomes a one-line HookError naming it. Both need a model whose
        every layer is full attention and eager steps (not ``compile``).
        """
        result = decode.greedy_sample(
            self, contexts, questions, num_new_tokens, use_cache=use_cache, store=store, batch_size=batch_size,
            stop_at_eos=stop_at_eos, special_tokens=special_tokens, truncate=truncate,
            max_context_tokens=max_context_tokens, return_scores=return_scores, labels=labels, progress=progress,
            prefix=prefix, stop_strings=stop_strings, max_batch_tokens=max_batch_tokens, compile=compile,
            generation_context=generation_context, decode_attention=decode_attention,
        )  # fmt: skip
        return result if return_details else result.tokens

    def score(
        self,
        contexts: Sequence[TextOrIds],
        continuations: Sequence[TextOrIds],
        *,
        store: KVStore | None = None,
        use_cache: bool = True,
        batch_size: int = 8,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        token_logprobs: bool = False,
        max_batch_tokens: int | None = None,
        progress: Progress | None = None,
        labels: Sequence[str] | None = None,
        generation_context: GenerationContext | None = None,
        truncate: bool = False,
    ) -> ScoreResult:
        """Log-likelihood of ``continuations[i]`` given ``contexts[i]``: per row the sum of the
        continuation tokens' log-probabilities, whether greedy decoding would have produced it,
        and (``token_logprobs``) each token's log-probability (:class:`ScoreResult`).

        Contexts and continuations are text or token ids, split as lm-eval's ``hf`` model splits
        them (:func:`kvstore.model.scoring.encode_pair`: ids as given; for text, whitespace ending
        the context moves to the continuation, whose ids are those of context + continuation past
        the context's; an empty context is scored from the BOS, or EOS, token).

        ``use_cache=True`` loads each distinct context's longest stored prefix from ``store`` once
        per batch for every continuation of it, computes and stores the rest (``prefix``,
        ``special_tokens``: as for :meth:`generate_kv_cache`, so the keys match); ``use_cache=False``
        is the reference: context + continuation through the model in one forward. Both agree to
        rounding (float64 1e-10, float32 1e-4 in the tests). Rows run in batches of up to
        ``batch_size`` rows and ``max_batch_tokens`` padded tokens, the continuations of one
        context together; a batch that runs out of memory runs again as two halves.
        ``generation_context(model)``, if given, is entered around the
        continuation forwards only (with the cache; the reference has one forward for both).

        Raises DatasetError (naming the row with ``labels``) for an empty continuation,
        ContextTooLongError when context + continuation exceed the model's positions (unless
        ``truncate``, which drops the context's first tokens as lm-eval does), ModelError for a
        model whose cache kvstore cannot reuse exactly (windowed and state models: with
        ``use_cache=False`` only).
        """
        return scoring.score(
            self, contexts, continuations, store=store, use_cache=use_cache, batch_size=batch_size,
            special_tokens=special_tokens, prefix=prefix, token_logprobs=token_logprobs,
            max_batch_tokens=max_batch_tokens, progress=progress, labels=labels,
            generation_context=generation_context, truncate=truncate,
        )  # fmt: skip

    def score_rolling(
        self,
        texts: Sequence[TextOrIds],
        *,
        store: KVStore | None = None,
        use_cache: bool = True,
        max_length: int | None = None,
        token_logprobs: bool = False,
        batch_size: int = 8,
        max_batch_tokens: int | None = None,
        progress: Progress | None = None,
        generation_context: GenerationContext | None = None,
        store_documents: bool = True,
    ) -> RollingResults:
        """Log-likelihood of whole documents, as lm-eval's ``loglikelihood_rolling`` computes it:
        text encoded without special tokens, the first token scored from the BOS (or EOS) token,
        documents longer than ``max_length`` (default: the model's positions) in lm-eval's windows
        (:func:`kvstore.model.scoring.rolling_windows`). A list of one :class:`RollingResult` per
        document (perplexity, bits per token and, for text, bits per character) that also carries
        the run's ``prefill_tokens_computed`` and ``prefill_tokens_saved``.

        With the cache, each window's context (the prefix token; a last short window's overlap) is
        loaded from or stored in ``store``, so a second run computes no context token; every scored
        token is computed on every run (its log-probability needs the hidden state at its
        position, which stored keys and values do not give). With ``store_documents`` the keys and
        values that forward computed for a document's first window (``[BOS or EOS] + document``)
        are stored as a chain too, at no extra compute, for later requests whose context starts
        with it."""
        return scoring.score_rolling(
            self, texts, store=store, use_cache=use_cache, max_length=max_length, token_logprobs=token_logprobs,
            batch_size=batch_size, max_batch_tokens=max_batch_tokens, progress=progress,
            generation_context=generation_context, store_documents=store_documents,
        )  # fmt: skip

    def sweep(
        self,
        contexts: Sequence[TextOrIds],
        questions: Sequence[TextOrIds],
        num_new_tokens: int = 20,
        *,
        variants: Sequence[str | hooks.Variant | sparse.AttentionFunction | None],
        **kwargs,
    ) -> dict[str, SampleResult]:
        """:meth:`greedy_sample` (with ``return_details``) under each of ``variants`` from one load:
        each batch's contexts are loaded (or computed and stored) once and every variant answers
        from the same buffers, without another load or prefill. A variant is a decode-attention
        spec (``dense``, ``topk:K``, ``sparq:R:K``, ``module:function``), an attention function,
        or a :class:`kvstore.model.hooks.Variant` (a named generation context). Returns the
        results by variant name, in the order given. ``kwargs``: as for :meth:`greedy_sample`
        (``return_details``, ``generation_context`` and ``decode_attention`` excepted)."""
        for name in ("return_details", "generation_context", "decode_attention"):
            if name in kwargs:
                raise TypeError(f"sweep() takes variants, not {name}")
        chosen = hooks.variants(variants)
        results = decode.sample_variants(self, contexts, questions, num_new_tokens, variants=chosen, **kwargs)
        return {r.variant: r for r in results}

    def decode(self, tokens: torch.Tensor | Sequence[int]) -> str:
        """Text of one row of generated ids, up to (not including) its first EOS."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        for j, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[:j]
                break
        return self.tokenizer.decode(ids, skip_special_tokens=True)


__all__ = ["Adapter", "BuildReport", "RollingResult", "SampleResult", "ScoreResult", "TextOrIds"]
