"""Options of the model layer's work, as values: how to build, sample and score, which prompt format.

:class:`BuildOptions`, :class:`SampleOptions` and :class:`ScoreOptions` are frozen dataclasses
shared by the Python API (:meth:`kvstore.model.adapter.Adapter.build`,
:meth:`~kvstore.model.adapter.Adapter.sample`, :meth:`~kvstore.model.adapter.Adapter.score`, the
sweeps) and the CLI (``kvstore build`` / ``sample`` / ``score`` build one from their flags); the
functions below the front take them whole instead of re-declaring every knob. A field named in a
call overrides the options given (:meth:`SampleOptions.of`). ``press`` and ``decode_attention``
are parsed here, once, into typed values (:class:`~kvstore.model.press.spec.Press`,
:class:`~kvstore.model.variants.variant.Attention`) that travel down unchanged.

The prompt format (:class:`kvstore.data.prompts.PromptFormat`: template, head, special tokens) is
one value given to both ``build`` and ``sample``: :func:`apply_prompt` turns it into the context
and question texts, the ``special_tokens`` flag and the shared head (``prefix``) that keys depend
on, so the two cannot drift apart the way separately passed ``special_tokens``/``prefix`` could.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.errors import PressError
from kvstore.model.compute.forward import Decoding
from kvstore.model.press.spec import Press, parse_press, parse_scorer
from kvstore.model.press.stored import check_storable
from kvstore.model.variants import sparse
from kvstore.model.variants.variant import Attention, Variant, make_variant, parse_attention

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.data.prompts import PromptFormat

STEPS = ("dynamic", "static", "compiled")
Opts = TypeVar("Opts", "BuildOptions", "SampleOptions", "ScoreOptions")
PressLike = Press | str | None
AttentionLike = Attention | str | sparse.AttentionFunction | None


def _typed(options: Any) -> None:
    """Parse a frozen options object's ``press`` and ``decode_attention`` in place (the API edge)."""
    press = options.press
    object.__setattr__(options, "press", parse_press(press) if isinstance(press, str) else press)
    object.__setattr__(options, "decode_attention", parse_attention(options.decode_attention))


def _of(cls: type[Opts], options: Opts | None, fields: dict[str, Any]) -> Opts:
    base = options if options is not None else cls()
    if not isinstance(base, cls):
        raise TypeError(f"options must be a {cls.__name__}, not {type(base).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown {cls.__name__} field(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return dataclasses.replace(base, **fields) if fields else base


@dataclass(frozen=True)
class BuildOptions:
    """How contexts are built into a store.

    ``batch_size``: contexts per prefill (None: 1 on CPU, where it measured faster than padded
    batches, 8 on accelerators); ``max_batch_tokens``: padded tokens per batch; ``truncate``: keep
    a too long context's last tokens instead of refusing it; ``max_context_tokens``: the context
    limit (default: the model's positions less the handle's reserve); ``skip_errors``: count a
    bad row in the report and build the others; ``shard=(i, n)``: build only the contexts whose
    key is ``i`` modulo ``n``; ``presses``: press specs whose pressed caches are stored beside each
    context (``kvzip:0.75``), with the store's codec; ``scores``: scorers whose scores are stored
    once per context (``kvzip``, ``expected_attention``: a press spec without its ratio);
    ``dense``: store the dense chains too (False keeps only what ``presses`` and ``scores`` make)."""

    batch_size: int | None = None
    max_batch_tokens: int | None = 16384
    truncate: bool = False
    max_context_tokens: int | None = None
    skip_errors: bool = False
    shard: tuple[int, int] | None = None
    presses: tuple[Press, ...] = ()
    scores: tuple[Press, ...] = ()
    dense: bool = True

    def __post_init__(self) -> None:
        presses = tuple(parse_press(p) if isinstance(p, str) else p for p in self.presses)
        for p in presses:
            if p.question:
                raise PressError(f"press {p.name}: a question-aware press keeps what each question reads; there is no "
                                 "one pressed cache per context to store")  # fmt: skip
            if p.ratio == 0:
                raise PressError(f"press {p.name}: a ratio of 0 keeps every token; the dense cache is that")
        object.__setattr__(self, "presses", presses)
        object.__setattr__(self, "scores", tuple(parse_scorer(s) if isinstance(s, str) else s for s in self.scores))
        for s in self.scores:
            check_storable(s)
        if not self.dense and not (self.presses or self.scores):
            raise ValueError("dense=False stores nothing without presses or scores to store instead")

    @classmethod
    def of(cls, options: BuildOptions | None = None, **fields: Any) -> BuildOptions:
        """``options`` (default: the defaults) with ``fields`` replaced; TypeError for a field
        that does not exist."""
        return _of(cls, options, fields)


@dataclass(frozen=True)
class SampleOptions:
    """How questions are answered.

    ``num_new_tokens`` per row; ``use_cache``: load contexts from (and store them in) the store,
    else the no-cache reference; ``batch_size`` rows and ``max_batch_tokens`` padded tokens per
    batch; ``stop_at_eos`` and ``stop_strings`` end a row (pads after it); ``truncate`` and
    ``max_context_tokens`` as for :class:`BuildOptions` (use the same values, or keys differ);
    ``return_scores``: keep each step's logits; ``steps``: ``dynamic`` (eager, the key length
    grows), ``static`` (fixed shapes, eager) or ``compiled`` (fixed shapes under
    ``torch.compile``); ``load_ahead``: load the next batch's stored prefixes on a worker while a
    batch decodes; ``press``: a press spec or :class:`~kvstore.model.press.spec.Press` applied to
    each batch's loaded contexts before answering (``snapkv:0.5``); ``decode_attention``: a
    decode-attention spec or function the question and answer steps run under (``topk:64``)."""

    num_new_tokens: int = 20
    use_cache: bool = True
    batch_size: int = 8
    max_batch_tokens: int | None = None
    stop_at_eos: bool = True
    stop_strings: tuple[str, ...] = ()
    truncate: bool = False
    max_context_tokens: int | None = None
    return_scores: bool = False
    steps: str = "dynamic"
    load_ahead: bool = True
    press: PressLike = None
    decode_attention: AttentionLike = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        _typed(self)
        if self.steps not in STEPS:
            raise ValueError(f"steps must be one of {', '.join(STEPS)}, not {self.steps!r}")
        if self.num_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("num_new_tokens and batch_size must be at least 1")

    @classmethod
    def of(cls, options: SampleOptions | None = None, **fields: Any) -> SampleOptions:
        """``options`` (default: the defaults) with ``fields`` replaced; TypeError for a field
        that does not exist."""
        return _of(cls, options, fields)

    def decoding(self) -> Decoding:
        """How each batch decodes under these options."""
        return Decoding(self.num_new_tokens, self.stop_at_eos, tuple(s for s in self.stop_strings if s), self.steps,
                        self.return_scores)  # fmt: skip

    def variant(self, generation_context: Any = None) -> Variant:
        """The one variant a plain ``sample`` answers under: its press, ``generation_context`` and
        decode attention (``dense`` without any)."""
        return make_variant(self.press, self.decode_attention, generation_context)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ScoreOptions:
    """How continuations are scored.

    ``use_cache``: load contexts from (and store them in) the store, else the reference (context and
    continuation in one forward, as lm-eval's ``hf`` model runs it); ``batch_size`` rows and
    ``max_batch_tokens`` padded tokens per batch (the continuations of one context together);
    ``token_logprobs``: keep each token's log-probability; ``truncate``: drop a too long row's first
    context tokens, as lm-eval does, instead of refusing it; ``press`` and ``decode_attention`` as
    for :class:`SampleOptions` (a question-aware press is refused: the question is part of the
    scored context)."""

    use_cache: bool = True
    batch_size: int = 8
    max_batch_tokens: int | None = None
    token_logprobs: bool = False
    truncate: bool = False
    press: PressLike = None
    decode_attention: AttentionLike = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        _typed(self)

    @classmethod
    def of(cls, options: ScoreOptions | None = None, **fields: Any) -> ScoreOptions:
        """``options`` (default: the defaults) with ``fields`` replaced; TypeError for a field
        that does not exist."""
        return _of(cls, options, fields)

    def variant(self, generation_context: Any = None) -> Variant:
        """The one variant a plain ``score`` runs under (``dense`` without a press or hook)."""
        return make_variant(self.press, self.decode_attention, generation_context)  # type: ignore[arg-type]


def apply_prompt(
    prompt: PromptFormat | None,
    contexts: Sequence[Any],
    questions: Sequence[Any] | None = None,
    *,
    special_tokens: bool = True,
    prefix: Any = None,
) -> tuple[list[Any], list[Any] | None, bool, Any]:
    """``(contexts, questions, special_tokens, prefix)`` under ``prompt``: each context as its
    context part and each question as its question part, the prompt's ``add_special_tokens`` and
    its head as the shared prefix. Without a prompt, everything as given. Raises ValueError when
    both a prompt and ``special_tokens``/``prefix`` are given (the prompt sets them), TypeError for
    a context or question given as token ids (a prompt formats text)."""
    if prompt is None:
        return list(contexts), None if questions is None else list(questions), special_tokens, prefix
    if special_tokens is not True or prefix is not None:
        raise ValueError("give prompt= or special_tokens=/prefix=, not both: the prompt format sets them")
    for kind, texts in (("context", contexts), ("question", questions or ())):
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"row {i}: prompt= formats text, but this {kind} is token ids")
    out_q = None if questions is None else [prompt.question_part(q) for q in questions]
    return [prompt.context_part(c) for c in contexts], out_q, prompt.add_special_tokens, prompt.head or None


__all__ = ["STEPS", "BuildOptions", "SampleOptions", "ScoreOptions", "apply_prompt"]
