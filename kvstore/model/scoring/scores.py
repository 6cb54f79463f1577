"""What a score is and which tokens a row is scored as: the result types of
:mod:`kvstore.model.pipelines.score`, lm-evaluation-harness's split of a (context, continuation) pair, its
prefix token and its rolling windows. No model runs here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import ModelError

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle, TextOrIds


@dataclass(frozen=True)
class ScoredRow:
    """One continuation's score. ``logprob``: sum of its tokens' log-probabilities (accumulated in
    float64); ``is_greedy``: greedy decoding from the context would have produced it (argmax at
    every position); ``n_tokens``: its tokens; ``token_logprobs``: per token (only when asked);
    ``cached_tokens``: context tokens loaded from the store."""

    logprob: float
    is_greedy: bool
    n_tokens: int
    token_logprobs: tuple[float, ...] | None = None
    cached_tokens: int = 0


@dataclass
class ScoreResult:
    """What :meth:`Adapter.score` returns: ``rows`` in input order; ``prefill_tokens_computed``:
    context tokens run through the model (each distinct context once per batch with the cache;
    every row's context without it); ``prefill_tokens_saved``: context tokens the no-cache path
    would have computed and this run did not. ``variant``: what it was scored under (``dense``, a
    press, a decode-attention spec or a generation context's name). ``kept_tokens``: per row, the
    context tokens its continuation was scored over (fewer under a press); ``cache_bytes``: bytes of
    their keys and values, summed over rows; ``scoring_tokens_computed``: context tokens the presses'
    scoring forwards ran (shared by every variant of a sweep; not prefill), of which
    ``window_tokens_computed`` observation windows and ``replay_tokens_computed`` replays.
    ``load_wait_seconds``: time scoring waited between batches for the next batch's load, which
    runs ahead on a worker (the accelerator's idle time between batches; shared by the variants)."""

    rows: list[ScoredRow]
    prefill_tokens_computed: int = 0
    prefill_tokens_saved: int = 0
    variant: str = "dense"
    kept_tokens: list[int] = field(default_factory=list)
    cache_bytes: int = 0
    window_tokens_computed: int = 0
    scoring_tokens_computed: int = 0
    replay_tokens_computed: int = 0
    load_wait_seconds: float = 0.0

    @property
    def logprobs(self) -> list[float]:
        return [r.logprob for r in self.rows]


@dataclass(frozen=True)
class RollingResult:
    """The log-likelihood of one whole document (:meth:`Adapter.score_rolling`). ``n_chars``:
    characters of the document's text (None when it was given as ids); ``context_tokens``: tokens
    of its windows' contexts (the prefix token, overlaps of a last short window);
    ``cached_tokens``: how many of them came from the store; ``windows``: how many windows it took."""

    logprob: float
    n_tokens: int
    n_chars: int | None = None
    token_logprobs: tuple[float, ...] | None = None
    cached_tokens: int = 0
    context_tokens: int = 0
    windows: int = 0

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per token (nats); NaN for an empty document."""
        return -self.logprob / self.n_tokens if self.n_tokens else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll) if self.n_tokens else math.nan

    @property
    def bits_per_token(self) -> float:
        return self.nll / math.log(2) if self.n_tokens else math.nan

    @property
    def bits_per_char(self) -> float | None:
        """Bits per character of the text (None without text; NaN for an empty one)."""
        if self.n_chars is None:
            return None
        return -self.logprob / (self.n_chars * math.log(2)) if self.n_chars else math.nan


class RollingResults(list[RollingResult]):
    """What :meth:`Adapter.score_rolling` returns: one :class:`RollingResult` per document (a
    list), and the run's ``prefill_tokens_computed`` / ``prefill_tokens_saved`` (window context
    tokens, counted as :class:`ScoreResult` counts them) and ``load_wait_seconds`` (as there)."""

    prefill_tokens_computed: int = 0
    prefill_tokens_saved: int = 0
    load_wait_seconds: float = 0.0


def prefix_token_id(handle: ModelHandle) -> int:
    """The token an empty context is scored from, as lm-eval's ``hf`` model picks it: the
    tokenizer's BOS, or its EOS when it has no BOS."""
    tok = handle.tokenizer
    bos = getattr(tok, "bos_token_id", None)
    if bos is not None:
        return int(bos)
    eos = getattr(tok, "eos_token_id", None)
    if eos is None:
        raise ModelError(f"{handle.name}: the tokenizer has neither a BOS nor an EOS token to score from")
    return int(eos)


def encode_pair(
    handle: ModelHandle, context: TextOrIds, continuation: TextOrIds, *, special_tokens: bool = True
) -> tuple[list[int], list[int]]:
    """The ``(context ids, continuation ids)`` a row is scored as, split the way lm-eval's ``hf``
    model splits a request:

    * both ids: used as they are;
    * both text: whitespace at the end of the context moves to the start of the continuation; the
      context is encoded alone (with the model's special tokens when ``special_tokens``) and so is
      context + continuation; the continuation's ids are the whole's ids past the context's
      length. A continuation whose first token merges with the context's last when tokenized
      together is thus scored from the context's own ids (lm-eval's rule: the context is what
      would be cached and reused);
    * an empty context: the continuation (encoded without special tokens) is scored from
      :func:`prefix_token_id`; when the continuation already starts with that token, its first
      token becomes the context instead;
    * text and ids mixed: the context with :meth:`Adapter.encode_context`, the continuation
      without special tokens.

    lm-eval's own tokenization adds no special tokens (its ``add_bos_token`` defaults to False):
    ``special_tokens=False`` reproduces it for text.
    """
    both_text = isinstance(context, str) and isinstance(continuation, str)
    if both_text:
        assert isinstance(context, str) and isinstance(continuation, str)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:  # a context of whitespace only becomes empty: scored from the prefix token
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
    ctx = handle.encode_context(context, special_tokens=special_tokens) if _nonempty(context) else []
    if not ctx:
        cont = handle.encode_question(continuation)
        head = prefix_token_id(handle)
        if cont and cont[0] == head:
            return cont[:1], cont[1:]
        return [head], cont
    if both_text:
        assert isinstance(context, str) and isinstance(continuation, str)
        whole = handle.encode_context(context + continuation, special_tokens=special_tokens)
        return ctx, whole[len(ctx) :]
    return ctx, handle.encode_question(continuation)


def _nonempty(x: TextOrIds) -> bool:
    return bool(x.strip()) if isinstance(x, str) else len(x) > 0


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's ``loglikelihood_rolling`` windows of a document's ``tokens`` as disjoint
    ``(context, continuation)`` pairs (one token of context per window): the first predicts the
    first ``max_length`` tokens from ``[prefix_token]``; each next one predicts the next
    ``max_length`` tokens from the token before them; a last, shorter window takes as much
    preceding text as context as fits in ``max_length`` positions. Every token is predicted once."""
    if max_length < 1:
        raise ValueError("max_length must be at least 1")
    toks = list(tokens)
    if not toks:
        return []
    first = min(max_length, len(toks))
    out = [([prefix_token], toks[:first])]
    done = first
    while done < len(toks):
        n = min(len(toks) - done, max_length)
        end = done + n
        out.append((toks[end - max_length - 1 : end - n], toks[end - n : end]))
        done = end
    return out


__all__ = [
    "RollingResult",
    "RollingResults",
    "ScoreResult",
    "ScoredRow",
    "encode_pair",
    "prefix_token_id",
    "rolling_windows",
]
