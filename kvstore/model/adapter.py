"""The Adapter: the public front of kvstore's model layer.

``Adapter(model, tokenizer)`` wraps any loaded Hugging Face causal LM; :meth:`Adapter.from_pretrained`
loads one by name. Identity, tokenization and plans come from :class:`~kvstore.model.handle.ModelHandle`;
the work is delegated: building to :mod:`kvstore.model.pipelines.build`, decoding to :mod:`kvstore.model.pipelines.sample`,
scoring to :mod:`kvstore.model.pipelines.score`, decode-time hooks to :mod:`kvstore.model.variants.hooks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.model.handle import ModelHandle, TextOrIds
from kvstore.model.options import BuildOptions, SampleOptions, apply_prompt
from kvstore.model.pipelines import build
from kvstore.model.pipelines import sample as decode
from kvstore.model.pipelines import score as scoring
from kvstore.model.pipelines.build import BuildReport
from kvstore.model.pipelines.sample import SampleResult
from kvstore.model.pipelines.score import RollingResult, RollingResults, ScoreResult
from kvstore.model.variants import hooks, sparse
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.data.prompts import PromptFormat


class Adapter(ModelHandle):
    """Wraps a Hugging Face causal LM and its tokenizer (see :class:`ModelHandle` for the
    constructor's arguments): builds, samples, scores and sweeps over stored contexts."""

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
        **fields,
    ) -> BuildReport:
        """Store the cache of every distinct context not stored whole and intact in ``store``.

        ``options`` (:class:`BuildOptions`; ``fields`` override any of them by name) say how. The
        prompt format ``prompt`` (give :meth:`sample` the same one) turns each context text into
        its context part and sets how it is tokenized and its shared head; without one, contexts
        are tokenized with the model's special tokens (``special_tokens=False`` when the text
        already holds them, as a rendered chat template does) and ``prefix`` names their shared
        head, stored once (see :meth:`plan`). A context stored whole and intact is skipped; the
        others are computed from their longest stored prefix on, chunks several of them share
        once; corrupt chunks are rebuilt; encoding and writing run on a background thread.
        ``labels`` name rows in errors (default ``row i``).

        Raises ContextTooLongError (naming the row) for a context longer than
        :meth:`context_limit` unless ``truncate`` (keep its last tokens) or ``skip_errors`` (count
        it in ``report.failed``, its message in ``report.errors``). ``shard=(i, n)`` builds the
        contexts whose key, read as a number from its first 16 hex digits, is ``i`` modulo ``n``
        (``report.other_shards`` counts the rest); ValueError unless ``0 <= i < n``."""
        opts = BuildOptions.of(options, **fields)
        texts, _, special_tokens, prefix = apply_prompt(prompt, contexts, special_tokens=special_tokens, prefix=prefix)
        return build.build_caches(
            self, texts, store, opts, special_tokens=special_tokens, labels=labels, progress=progress, prefix=prefix
        )

    def generate_kv_cache(self, contexts: Sequence[TextOrIds], store: KVStore, **kwargs) -> BuildReport:
        """:meth:`build` under the research code's name (same arguments)."""
        return self.build(contexts, store, **kwargs)

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
        generation_context: hooks.GenerationContext | None = None,
        decode_attention: str | sparse.AttentionFunction | None = None,
        **fields,
    ) -> SampleResult:
        """Greedy answers to ``questions[i]`` about ``contexts[i]``: a :class:`SampleResult`.

        ``options`` (:class:`SampleOptions`; ``fields`` override any of them by name) say how;
        ``prompt``, ``special_tokens`` and ``prefix`` as for :meth:`build` (the same values, or keys
        will not match). A row that produced EOS, or whose text contains one of ``stop_strings``
        (the token completing it kept), is pads after it. A batch that runs out of memory runs
        again as two halves (answers do not depend on the batch).

        ``use_cache`` loads the longest stored prefix of each context's chain from ``store`` and
        computes only the rest (storing it unless the store is read-only; without a store, in
        memory); else the reference runs context and question through the model together. Both
        give the same tokens (exactly in float64; in float32 up to rounding near ties).

        ``generation_context`` (``model -> context manager``) and ``decode_attention`` (``topk:K``,
        ``sparq:R:K``, ``module:function`` or an attention function) are entered around each
        batch's question forward and decode steps only, never a prefill (:mod:`kvstore.model.variants.hooks`);
        an error under them is a one-line HookError. Full-attention models, eager steps only."""
        variant = hooks.hook_variant(generation_context, decode_attention)
        return self._sample([variant], contexts, questions, options, store, prompt, special_tokens, prefix, labels,
                            progress, fields)[0]  # fmt: skip

    def greedy_sample(
        self,
        contexts: Sequence[TextOrIds],
        questions: Sequence[TextOrIds],
        num_new_tokens: int = 20,
        *,
        use_cache: bool = True,
        return_details: bool = False,
        compile: bool = False,
        **kwargs,
    ) -> torch.Tensor | SampleResult:
        """:meth:`sample` as the research code calls it: ``[n_rows, num_new_tokens]`` int64 token ids
        (the :class:`SampleResult` with ``return_details``); ``compile``: fixed-shape decode steps
        under ``torch.compile`` (:mod:`kvstore.model.compute.static`). Other arguments as for :meth:`sample`."""
        if compile:
            kwargs["steps"] = "compiled"
        result = self.sample(contexts, questions, num_new_tokens=num_new_tokens, use_cache=use_cache, **kwargs)
        return result if return_details else result.tokens

    def _sample(self, variants, contexts, questions, options, store, prompt, special_tokens, prefix, labels, progress,
                fields) -> list[SampleResult]:  # fmt: skip
        opts = SampleOptions.of(options, **fields)
        contexts, questions, special_tokens, prefix = apply_prompt(
            prompt, contexts, questions, special_tokens=special_tokens, prefix=prefix
        )
        return decode.sample_variants(
            self, contexts, questions, opts, variants=variants, store=store, special_tokens=special_tokens,
            prefix=prefix, labels=labels, progress=progress,
        )  # fmt: skip

    def score(self, contexts: Sequence[TextOrIds], continuations: Sequence[TextOrIds], **kwargs) -> ScoreResult:
        """Log-likelihood of ``continuations[i]`` given ``contexts[i]`` per row, from stored contexts
        (``use_cache``) or without them, as lm-eval's ``hf`` model computes it: a
        :class:`ScoreResult`. Arguments (``store``, ``use_cache``, ``batch_size``, ``prefix``,
        ``token_logprobs``, ``truncate``, ``generation_context``, ``decode_attention``, ...), rules and
        errors: :func:`kvstore.model.pipelines.score.score`."""
        return scoring.score(self, contexts, continuations, **kwargs)

    def score_rolling(self, texts: Sequence[TextOrIds], **kwargs) -> RollingResults:
        """Log-likelihood of whole documents in lm-eval's ``loglikelihood_rolling`` windows: one
        :class:`RollingResult` per document. Arguments: :func:`kvstore.model.pipelines.score.score_rolling`."""
        return scoring.score_rolling(self, texts, **kwargs)

    def score_sweep(
        self, contexts: Sequence[TextOrIds], continuations: Sequence[TextOrIds], *, variants: Sequence, **kwargs
    ) -> dict[str, ScoreResult]:
        """:meth:`score` under each of ``variants`` from one load of each batch; results by variant
        name (:func:`kvstore.model.pipelines.score.score_sweep`)."""
        return scoring.score_sweep(self, contexts, continuations, variants=variants, **kwargs)

    def sweep(
        self,
        contexts: Sequence[TextOrIds],
        questions: Sequence[TextOrIds],
        options: SampleOptions | None = None,
        *,
        variants: Sequence[str | hooks.Variant | sparse.AttentionFunction | None],
        store: KVStore | None = None,
        prompt: PromptFormat | None = None,
        special_tokens: bool = True,
        prefix: TextOrIds | None = None,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
        **fields,
    ) -> dict[str, SampleResult]:
        """:meth:`sample` under each of ``variants`` (decode-attention specs, attention functions or
        :class:`kvstore.model.variants.hooks.Variant`) from one load of each batch: results by variant name,
        in order. Other arguments as for :meth:`sample`."""
        chosen = hooks.variants(variants)
        results = self._sample(chosen, contexts, questions, options, store, prompt, special_tokens, prefix, labels,
                               progress, fields)  # fmt: skip
        return {r.variant: r for r in results}

    def decode(self, tokens: torch.Tensor | Sequence[int]) -> str:
        """Text of one row of generated ids, up to (not including) its first EOS."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        for j, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[:j]
                break
        return self.tokenizer.decode(ids, skip_special_tokens=True)


__all__ = [
    "Adapter", "BuildOptions", "BuildReport", "RollingResult", "SampleOptions", "SampleResult", "ScoreResult",
    "TextOrIds",
]  # fmt: skip
