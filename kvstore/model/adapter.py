"""The Adapter: the public front of kvstore's model layer.

``Adapter(model, tokenizer)`` wraps any loaded Hugging Face causal LM; :meth:`Adapter.from_pretrained`
loads one by name. It composes a :class:`~kvstore.model.handle.ModelHandle` (model, tokenizer,
identity, layout, tokenization: what the layer below takes, as :attr:`Adapter.handle`) and turns
its arguments into the typed values the pipelines take: options objects
(:mod:`kvstore.model.options`), the prompt format, variants parsed once
(:mod:`kvstore.model.variants.variant`). Building is :mod:`kvstore.model.pipelines.build`, sampling
and sweeps :mod:`kvstore.model.pipelines.sample`, scoring :mod:`kvstore.model.pipelines.score`.

``build``/``sample``/``sweep``/``greedy_sample``/``score``... take one options object; every field of
it is also a keyword of the method (:func:`kvstore.model.keywords.takes_options` builds their
signatures and docs from the options classes), which overrides that field (left out: the options'
value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.errors import ModelError
from kvstore.model.compose.rows import Composed, compose_inputs
from kvstore.model.compose.run import sample_composed
from kvstore.model.compose.store import build_of, build_passages, plan_passages
from kvstore.model.compute.cache import LayerKV
from kvstore.model.compute.forward import prefill
from kvstore.model.handle import DEFAULT_RESERVE_TOKENS, ModelHandle, TextOrIds
from kvstore.model.io import chains
from kvstore.model.io.chains import Chain, Keying
from kvstore.model.keywords import takes_options
from kvstore.model.options import (
    BuildKeywords,
    BuildOptions,
    GreedyKeywords,
    SampleKeywords,
    SampleOptions,
    ScoreKeywords,
    ScoreOptions,
    apply_prompt,
)
from kvstore.model.paths.choice import check_supported, path_of
from kvstore.model.pipelines import build, sample, score
from kvstore.model.pipelines.build import BuildReport
from kvstore.model.pipelines.sample import SampleResult
from kvstore.model.plan.build import BuildPlan, plan_build
from kvstore.model.press.spec import Press
from kvstore.model.scoring.scores import RollingResults, ScoreResult
from kvstore.model.variants import sparse
from kvstore.model.variants.variant import GenerationContext, Variant
from kvstore.model.variants.variant import variants as parse_variants
from kvstore.model.view import ModelView
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Unpack

    from kvstore.data.prompts import PromptFormat


VariantLike = str | Variant | Press | sparse.AttentionFunction | None


class Adapter(ModelView):
    """Wraps a Hugging Face causal LM and its tokenizer: builds, samples, scores and sweeps over
    stored contexts. The constructor's arguments are :class:`ModelHandle`'s: ``name`` (display),
    ``weight_files`` (memoize the fingerprint), ``fingerprint``, ``reserve_tokens`` (positions kept
    for question and answer), ``prefill_chunk_tokens`` (prefill piece; None: automatic),
    ``force_staging`` (tests: stage loads on CPU as on an accelerator; None: ``KVSTORE_FORCE_STAGING``)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str | None = None,
        weight_files: Sequence = (),
        fingerprint: str | None = None,
        reserve_tokens: int = DEFAULT_RESERVE_TOKENS,
        prefill_chunk_tokens: int | None = None,
        force_staging: bool | None = None,
    ):
        self.handle = ModelHandle(
            model, tokenizer, name=name, weight_files=weight_files, fingerprint=fingerprint,
            reserve_tokens=reserve_tokens, prefill_chunk_tokens=prefill_chunk_tokens, force_staging=force_staging,
        )  # fmt: skip

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
        from kvstore.model.load.loading import load_model

        loaded = load_model(name, dtype=dtype, device=device, attn_implementation=attn_implementation)
        return cls(loaded.model, loaded.tokenizer, name=loaded.name, weight_files=loaded.weight_files)

    def chain(
        self, context_ids: Sequence[int], store: KVStore | None = None, *, prefix: TextOrIds | None = None,
        special_tokens: bool = True,
    ) -> Chain:  # fmt: skip
        """A tokenized context as a chain of chunks for ``store``: its keys, and ``chain.key`` the
        context's (:func:`kvstore.model.io.chains.chain_of`)."""
        return chains.chain_of(self.handle, context_ids, store, prefix=prefix, special_tokens=special_tokens)

    def key(
        self, context_ids: Sequence[int], store: KVStore | None = None, *, prefix: TextOrIds | None = None,
        special_tokens: bool = True,
    ) -> str:  # fmt: skip
        """The key of a tokenized context (its chain's last chunk) in ``store`` (see :meth:`chain`)."""
        return self.chain(context_ids, store, prefix=prefix, special_tokens=special_tokens).key

    def check_supported(self, store: KVStore | None = None) -> None:
        """ModelError (one line) unless kvstore can store and reuse this model's caches exactly, in
        ``store``'s codec when given (:func:`kvstore.model.paths.choice.check_supported`)."""
        check_supported(self.handle, store)

    def prefill(self, batch: Sequence[Sequence[int]]) -> list[LayerKV]:
        """Run the model over a batch of token-id lists (right-padded together); per row, the
        per-layer ``(keys, values)`` ``[kv_heads, n_i, head_dim]`` of its own tokens only.
        Dense (full-attention) models only: raises ModelError for the others."""
        if not path_of(self.handle).supports("prefill"):
            raise ModelError(f"{self.name}: prefill gives full-attention keys and values; use generate_kv_cache")
        return prefill(self.handle, batch)

    def decode(self, tokens: torch.Tensor | Sequence[int]) -> str:
        """Text of one row of generated ids, up to (not including) its first EOS."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        for j, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[:j]
                break
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- building ------------------------------------------------------------------------------
    @takes_options(BuildOptions)
    def build(
        self,
        contexts: Sequence[TextOrIds],
        store: KVStore,
        options: BuildOptions | None = None,
        *,
        prompt: PromptFormat | None = None,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        **fields: Unpack[BuildKeywords],
    ) -> BuildReport:
        """Store the cache of every distinct context not stored whole and intact in ``store``.

        ``options`` (:class:`BuildOptions`; its fields may also be given as keywords) say how. The
        prompt format ``prompt`` (give :meth:`sample` the same one) turns each context text into
        its context part and sets how it is tokenized and its shared head; without one, contexts
        are tokenized with the model's special tokens (``special_tokens=False`` when the text
        already holds them, as a rendered chat template does) and ``prefix`` names their shared
        head, stored once (see :meth:`chain`). A context stored whole and intact is skipped; the
        others are computed from their longest stored prefix on, chunks several of them share
        once; corrupt chunks are rebuilt; encoding and writing run on a background thread.
        ``labels`` name rows in errors (default ``row i``).

        Raises ContextTooLongError (naming the row) for a context longer than
        :meth:`context_limit` unless ``truncate`` (keep its last tokens) or ``skip_errors`` (count
        it in ``report.failed``, its message in ``report.errors``). ``shard=(i, n)`` builds the
        contexts whose key, read as a number from its first 16 hex digits, is ``i`` modulo ``n``
        (``report.other_shards`` counts the rest); ValueError unless ``0 <= i < n``.

        ``presses`` (``["kvzip:0.75"]``) also store each context's pressed cache under each press, with
        the store's codec (:mod:`kvstore.model.press.stored`), ``scores`` (``["kvzip"]``) each
        scorer's scores once per context (a press or scorer given twice: once; an entry stored
        corrupt: made again); ``dense=False`` keeps only those (the dense caches are computed in
        memory and dropped) and needs ``presses`` (ValueError otherwise: scores alone would belong
        to no stored context). PressError (one line) for a question-aware press or a scorer whose
        scores cannot be stored; ReadOnlyStoreError for a read-only store.

        ``compose=True`` (contexts given as passages) stores each distinct passage once and the
        rows' head, what :meth:`sample` with ``compose`` reads, instead of each row's composed ids
        as an exact prefix chain (what it reads without): :mod:`kvstore.model.compose.store`."""
        assert options is not None  # completed by takes_options (from the field keywords)
        if options.compose:
            composed = self._passages(prompt, contexts, special_tokens, prefix, labels)
            return build_passages(self.handle, composed, store, options, progress)
        texts, keying = self._built(prompt, contexts, special_tokens, prefix)
        return build.build_caches(self.handle, texts, store, options, keying, labels, progress)

    generate_kv_cache = build  # the research code's name for build (same arguments)

    @takes_options(BuildOptions)
    def plan_build(
        self,
        contexts: Sequence[TextOrIds],
        store: KVStore,
        options: BuildOptions | None = None,
        *,
        prompt: PromptFormat | None = None,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        labels: Sequence[str] | None = None,
        **fields: Unpack[BuildKeywords],
    ) -> BuildPlan:
        """What :meth:`build` would do, and nothing more (``kvstore build --dry-run``): a
        :class:`kvstore.model.plan.build.BuildPlan` per distinct context (skip, record, migrate or
        compute; pressed caches and scores to make). Arguments as for :meth:`build`."""
        assert options is not None  # completed by takes_options (from the field keywords)
        if options.compose:
            return plan_passages(self.handle, self._passages(prompt, contexts, special_tokens, prefix, labels), store,
                                 options)  # fmt: skip
        texts, keying = self._built(prompt, contexts, special_tokens, prefix)
        return plan_build(self.handle, texts, store, options, keying, labels)

    def _passages(
        self, prompt: PromptFormat | None, contexts: Sequence[Any], special_tokens: bool, prefix: TextOrIds | None,
        labels: Sequence[str] | None,
    ) -> Composed:  # fmt: skip
        """A ``compose=True`` build's rows (ComposeError unless their contexts are passages)."""
        got = compose_inputs(self.handle, prompt, contexts, None, Keying(special_tokens, prefix), labels)
        return build_of(got, "compose")

    def _built(
        self, prompt: PromptFormat | None, contexts: Sequence[Any], special_tokens: bool, prefix: TextOrIds | None
    ) -> tuple[list, Keying]:
        """A build's contexts under ``prompt`` and how they are keyed (passage rows: their composed
        ids, whose exact prefix chains a sample without ``compose`` reads)."""
        composed = compose_inputs(self.handle, prompt, contexts, None, Keying(special_tokens, prefix))
        if composed is not None:
            return list(composed.contexts), composed.keying
        texts, _, special_tokens, prefix = apply_prompt(prompt, contexts, special_tokens=special_tokens, prefix=prefix)
        return texts, Keying(special_tokens, prefix)

    # -- sampling ------------------------------------------------------------------------------
    @takes_options(SampleOptions)
    def sample(
        self,
        contexts: Sequence[TextOrIds],
        questions: Sequence[TextOrIds],
        options: SampleOptions | None = None,
        *,
        store: KVStore | None = None,
        prompt: PromptFormat | None = None,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        generation_context: GenerationContext | None = None,
        **fields: Unpack[SampleKeywords],
    ) -> SampleResult:
        """Greedy answers to ``questions[i]`` about ``contexts[i]``: a :class:`SampleResult`.

        ``options`` (:class:`SampleOptions`; its fields may also be given as keywords) say how;
        ``prompt``, ``special_tokens`` and ``prefix`` as for :meth:`build` (the same values, or keys
        will not match). A row that produced EOS, or whose text contains one of ``stop_strings``
        (the token completing it kept), is pads after it. A batch that runs out of memory runs
        again as two halves (answers do not depend on the batch).

        ``use_cache`` loads the longest stored prefix of each context's chain from ``store`` and
        computes only the rest (storing it unless the store is read-only; without a store, in
        memory); else the reference runs context and question through the model together. Both
        give the same tokens (exactly in float64; in float32 up to rounding near ties).

        ``press`` (``snapkv:0.5``, a :class:`~kvstore.model.press.spec.Press`) keeps only some of
        each loaded context's tokens before the question is answered (:mod:`kvstore.model.press`);
        ``generation_context`` (``model -> context manager``) and ``decode_attention``
        (``topk:K``, ``sparq:R:K``, ``module:function`` or an attention function) are entered
        around each batch's question forward and decode steps only, never a prefill
        (:mod:`kvstore.model.variants.hooks`); an error under them is a one-line HookError. The
        three compose into one variant; several variants from one load are :meth:`sweep`.
        Full-attention models, eager steps only."""
        assert options is not None  # completed by takes_options (from the field keywords)
        texts, asked, keying, composed = self._prompted(prompt, contexts, questions, special_tokens, prefix)
        return self._sample([options.variant(generation_context)], (texts, asked), options, store, keying, labels,
                            progress, composed=composed)[0]  # fmt: skip

    @takes_options(SampleOptions)
    def sweep(
        self,
        contexts: Sequence[TextOrIds],
        questions: Sequence[TextOrIds],
        options: SampleOptions | None = None,
        *,
        variants: Sequence[VariantLike],
        store: KVStore | None = None,
        prompt: PromptFormat | None = None,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        **fields: Unpack[SampleKeywords],
    ) -> dict[str, SampleResult]:
        """:meth:`sample` under each of ``variants`` (specs such as ``dense``, ``knorm:0.5``,
        ``snapkv:0.5+sparq:16:64``, ``topk:64``, presses, attention functions or
        :class:`kvstore.model.variants.variant.Variant`, which are used as they are) from one load
        of each batch: results by variant name, in order. Other arguments as for :meth:`sample`;
        a sweep's presses and decode attention are its variants (ValueError for ``press`` or
        ``decode_attention`` in its options)."""
        assert options is not None  # completed by takes_options (from the field keywords)
        chosen = _swept(variants, options)
        texts, asked, keying, composed = self._prompted(prompt, contexts, questions, special_tokens, prefix)
        results = self._sample(chosen, (texts, asked), options, store, keying, labels, progress, composed=composed)
        return {r.variant: r for r in results}

    @takes_options(SampleOptions, first="num_new_tokens")
    def greedy_sample(
        self,
        contexts: Sequence[TextOrIds],
        questions: Sequence[TextOrIds],
        num_new_tokens: int | None = None,
        *,
        options: SampleOptions | None = None,
        return_details: bool = False,
        compile: bool = False,
        store: KVStore | None = None,
        prompt: PromptFormat | None = None,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        generation_context: GenerationContext | None = None,
        **fields: Unpack[GreedyKeywords],
    ) -> torch.Tensor | SampleResult:
        """:meth:`sample` as the research code calls it (``greedy_sample(contexts, questions, 20,
        ...)``): ``[n_rows, num_new_tokens]`` int64 token ids (the :class:`SampleResult` with
        ``return_details``); ``compile``: fixed-shape decode steps under ``torch.compile``
        (``steps="compiled"``, :mod:`kvstore.model.compute.static`). Other arguments as for
        :meth:`sample`."""
        assert options is not None  # completed by takes_options (from the field keywords)
        if compile:
            options = SampleOptions.of(options, steps="compiled")
        result = self.sample(
            contexts, questions, options, store=store, prompt=prompt, special_tokens=special_tokens, prefix=prefix,
            labels=labels, progress=progress, generation_context=generation_context,
        )  # fmt: skip
        return result if return_details else result.tokens

    def _prompted(
        self, prompt: PromptFormat | None, contexts: Sequence[Any], questions: Sequence[TextOrIds],
        special_tokens: bool, prefix: TextOrIds | None,
    ) -> tuple[list, list, Keying, Composed | None]:  # fmt: skip
        """The context and question texts under ``prompt``, how contexts are keyed, and the rows'
        compositions when their contexts are passages (then the contexts are the composed ids)."""
        composed = compose_inputs(self.handle, prompt, contexts, questions, Keying(special_tokens, prefix))
        if composed is not None:
            assert composed.questions is not None
            return list(composed.contexts), list(composed.questions), composed.keying, composed
        texts, asked, special_tokens, prefix = apply_prompt(
            prompt, contexts, questions, special_tokens=special_tokens, prefix=prefix
        )
        assert asked is not None
        return texts, asked, Keying(special_tokens, prefix), None

    def _sample(
        self, chosen: Sequence[Variant], texts: tuple[Sequence[TextOrIds], Sequence[TextOrIds]],
        opts: SampleOptions, store: KVStore | None, keying: Keying, labels: Sequence[str] | None,
        progress: Progress | None, *, composed: Composed | None = None,
    ) -> list[SampleResult]:  # fmt: skip
        """Every variant of ``chosen`` answered on ``texts`` (contexts, questions)."""
        contexts, questions = texts
        if opts.compose is not None:  # passages placed at their offsets (or, for full, the reference)
            return [sample_composed(self.handle, composed, opts, chosen, store, labels, progress)]
        path = sample.check_sample(self.handle, opts, chosen, store)  # a refused model: before any tokenizing
        rows = sample.tokenize_rows(self.handle, contexts, questions, opts, store, keying, labels)
        return sample.sample_variants(self.handle, rows, opts, chosen, store, path, progress)

    # -- scoring -------------------------------------------------------------------------------
    @takes_options(ScoreOptions)
    def score(
        self,
        contexts: Sequence[TextOrIds],
        continuations: Sequence[TextOrIds],
        options: ScoreOptions | None = None,
        *,
        store: KVStore | None = None,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        generation_context: GenerationContext | None = None,
        **fields: Unpack[ScoreKeywords],
    ) -> ScoreResult:
        """Log-likelihood of ``continuations[i]`` given ``contexts[i]`` per row, from stored contexts
        (``use_cache``) or without them, as lm-eval's ``hf`` model computes it: a
        :class:`ScoreResult` (per row the sum of the continuation tokens' log-probabilities, whether
        greedy decoding would produce it, and with ``token_logprobs`` each token's).

        Contexts and continuations are text or token ids, split as lm-eval's ``hf`` model splits
        them (:func:`kvstore.model.scoring.scores.encode_pair`). ``use_cache=True`` loads each
        distinct context's longest stored prefix from ``store`` once per batch for every
        continuation of it, computes and stores the rest (``prefix``, ``special_tokens``: as for
        :meth:`build`, so the keys match); ``use_cache=False`` is the reference: context +
        continuation through the model in one forward. Both agree to rounding. ``press`` (not
        question-aware: the question is part of the scored context) and ``decode_attention`` /
        ``generation_context`` apply to the continuation forwards only, never a context's prefill.

        Raises DatasetError (naming the row with ``labels``) for an empty continuation,
        ContextTooLongError when context + continuation exceed the model's positions (unless
        ``truncate``, which drops the context's first tokens as lm-eval does), ModelError for a
        model whose cache kvstore cannot reuse exactly (windowed and state models: with
        ``use_cache=False`` only)."""
        assert options is not None  # completed by takes_options (from the field keywords)
        check_supported(self.handle, store if options.use_cache else None)  # a refused model: before any tokenizing
        rows = score.encode_rows(self.handle, contexts, continuations, special_tokens, labels, options.truncate)
        variant, keying = options.variant(generation_context), Keying(special_tokens, prefix)
        return score.score_rows(self.handle, rows, options, [variant], store, keying, progress)[0]

    @takes_options(ScoreOptions)
    def score_sweep(
        self,
        contexts: Sequence[TextOrIds],
        continuations: Sequence[TextOrIds],
        options: ScoreOptions | None = None,
        *,
        variants: Sequence[VariantLike],
        store: KVStore | None = None,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        **fields: Unpack[ScoreKeywords],
    ) -> dict[str, ScoreResult]:
        """:meth:`score` under each of ``variants`` (as for :meth:`sweep`) from one load of each
        batch; results by variant name, in order."""
        assert options is not None  # completed by takes_options (from the field keywords)
        chosen = _swept(variants, options)
        check_supported(self.handle, store if options.use_cache else None)
        rows = score.encode_rows(self.handle, contexts, continuations, special_tokens, labels, options.truncate)
        results = score.score_rows(self.handle, rows, options, chosen, store, Keying(special_tokens, prefix), progress)
        return {v.name: r for v, r in zip(chosen, results)}

    @takes_options(ScoreOptions)
    def score_rolling(
        self,
        texts: Sequence[TextOrIds],
        options: ScoreOptions | None = None,
        *,
        store: KVStore | None = None,
        max_length: int | None = None,
        store_documents: bool = True,
        progress: Progress | None = None,
        generation_context: GenerationContext | None = None,
        **fields: Unpack[ScoreKeywords],
    ) -> RollingResults:
        """Log-likelihood of whole documents, as lm-eval's ``loglikelihood_rolling`` computes it:
        text encoded without special tokens, the first token scored from the BOS (or EOS) token,
        documents longer than ``max_length`` (default: the model's positions) in lm-eval's
        windows (so ``truncate`` changes nothing here). A list of one :class:`RollingResult` per
        document (perplexity, bits per token and, for text, bits per character) that also carries
        the run's ``prefill_tokens_computed`` and ``prefill_tokens_saved``.

        With the cache, each window's context (the prefix token; a last short window's overlap) is
        loaded from or stored in ``store``, so a second run computes no context token; every scored
        token is computed on every run (its log-probability needs the hidden state at its
        position, which stored keys and values do not give). With ``store_documents`` the keys and
        values that forward computed for a document's first window are stored as a chain too, at
        no extra compute, for later requests whose context starts with it."""
        assert options is not None  # completed by takes_options (from the field keywords)
        variant = options.variant(generation_context)
        documents = (max_length, store_documents)
        return score.score_rolling(self.handle, texts, options, variant, store, documents, progress)


def _swept(variants: Sequence[VariantLike], options: SampleOptions | ScoreOptions) -> list[Variant]:
    """A sweep's variants, each parsed once (a :class:`Variant` is used as it is); ValueError when
    the options also name a press or decode attention (a sweep's are its variants)."""
    if isinstance(options, SampleOptions) and options.compose is not None:
        raise ValueError("a sweep answers its variants densely; compose= is for sample")
    if options.press is not None or options.decode_attention is not None:
        raise ValueError(
            "a sweep takes its presses and decode attention from variants= (e.g. variants=['snapkv:0.5+topk:64']), "
            "not from press= or decode_attention="
        )
    return parse_variants(variants)


__all__ = ["Adapter"]
