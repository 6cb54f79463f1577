"""Options of the model layer's work, as values: how to build, sample and score, which prompt format.

:class:`BuildOptions`, :class:`SampleOptions` and :class:`ScoreOptions` are frozen dataclasses
shared by the Python API (:meth:`kvstore.model.adapter.Adapter.build`,
:meth:`~kvstore.model.adapter.Adapter.sample`, :meth:`~kvstore.model.adapter.Adapter.score`, the
sweeps) and the CLI (``kvstore build`` / ``sample`` / ``score`` build one from their flags); the
functions below the front take them whole instead of re-declaring every knob. Each field is
declared once, here, with its default and what it means (:func:`kvstore.model.keywords.option`):
the Adapter's methods take every field as a keyword (:func:`kvstore.model.keywords.takes_options`)
and the CLI reads the defaults from here. A field named in a call overrides the options given
(:meth:`SampleOptions.of`). What each method accepts as those keywords is typed for the type checker by
a ``TypedDict`` beside its class (:class:`BuildKeywords`, :class:`SampleKeywords`,
:class:`ScoreKeywords`: ``**fields: Unpack[...]``, PEP 692), so ``sample(..., max_new_tokns=3)`` is an
error under mypy; they name the same fields as the class (a test keeps them equal) and the types a
caller may pass (``presses=["kvzip:0.75"]`` as well as Press values).

``press`` and ``decode_attention`` are parsed here, once, into typed values
(:class:`~kvstore.model.press.spec.Press`, :class:`~kvstore.model.variants.variant.Attention`)
that travel down unchanged (:func:`press_of`, :func:`attention_of`: the CLI calls the same two with
its flag names, so a message names what the user typed). One variant composes them
(:meth:`SampleOptions.variant`); a sweep's variants are ``variants=`` (``--variant``).

The prompt format (:class:`kvstore.data.prompts.PromptFormat`: template, head, special tokens) is
one value given to both ``build`` and ``sample``: :func:`apply_prompt` turns it into the context
and question texts, the ``special_tokens`` flag and the shared head (``prefix``) that keys depend
on, so the two cannot drift apart the way separately passed ``special_tokens``/``prefix`` could.

Importing this module imports no torch (the variant and decoding types are imported when used).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from kvstore.errors import HookError, PressError
from kvstore.model.compose.spec import Compose, parse_compose
from kvstore.model.keywords import documented, option, replaced
from kvstore.model.press.spec import Press, check_storable, parse_press, parse_scorer

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.compute.forward import Decoding
    from kvstore.model.variants.sparse import AttentionFunction
    from kvstore.model.variants.variant import Attention, Variant

    PressLike = Press | str | None
    AttentionLike = Attention | str | AttentionFunction | None

STEPS = ("dynamic", "static", "compiled")


@dataclass(frozen=True)
class Spelling:
    """How messages about ``press``/``decode_attention``/variants spell them: as the API's keywords
    (:data:`KEYWORDS`: ``press='snapkv:0.5'``) or as flags (``flags=True``: ``--press snapkv:0.5``)."""

    press: str = "press"
    decode_attention: str = "decode_attention"
    variants: str = "variants"
    flags: bool = False

    def __call__(self, name: str, value: str) -> str:
        """``name`` (``press``, ``decode_attention`` or ``variants``) given ``value``, as typed."""
        label = getattr(self, name)
        if self.flags:
            return f"{label} {value}"
        return f"{label}=[{value!r}]" if name == "variants" else f"{label}={value!r}"


KEYWORDS = Spelling()


def press_of(value: PressLike, spelling: Spelling = KEYWORDS) -> Press | None:
    """The :class:`Press` of a ``press`` value: a spec (parsed by
    :func:`kvstore.model.press.spec.parse_press`: PressError naming the presses for a bad one), a
    Press, or None. A spec that also names a decode attention (``snapkv:0.5+topk:4``) is a
    PressError pointing to ``decode_attention`` (one variant) and to ``variants`` (a sweep)."""
    if value is None or isinstance(value, Press):
        return value
    if not isinstance(value, str):
        raise PressError(f"{spelling('press', repr(value))}: a press spec such as snapkv:0.5 or a Press")
    text = value.strip()
    head, plus, tail = text.partition("+")
    press = parse_press(head)
    if plus:
        attention = attention_of(tail, spelling)
        name = attention.name if attention is not None else tail.strip()
        raise PressError(
            f"{spelling('press', text)} is a press and a decode attention: give {spelling('press', press.name)} and "
            f"{spelling('decode_attention', name)} for one variant, or {spelling('variants', text)} in a sweep"
        )
    return press


def attention_of(value: AttentionLike, spelling: Spelling = KEYWORDS) -> Attention | None:
    """The :class:`~kvstore.model.variants.variant.Attention` of a ``decode_attention`` value: a
    spec (``topk:64``, ``sparq:16:64``, ``module:function``; ``dense``: None), read by
    :func:`kvstore.model.variants.variant.parse_variant` (HookError for a bad one), an attention
    function, an Attention, or None. A spec naming a press is a HookError pointing to ``press``."""
    from kvstore.model.press.spec import is_press_spec
    from kvstore.model.variants.variant import Attention, parse_attention, parse_variant

    if value is None or isinstance(value, Attention):
        return value
    if not isinstance(value, str) or not is_press_spec(value.partition("+")[0]):
        return parse_attention(value)  # the attention parser's own message for a bad spec
    variant = parse_variant(value)
    if variant.press is not None:
        hint = spelling("press", variant.press.name)
        if variant.decode_attention is not None:
            hint += f" and {spelling('decode_attention', variant.decode_attention.name)}"
        raise HookError(f"{spelling('decode_attention', value.strip())} names a press: give {hint}")
    return variant.decode_attention


def _typed(options: Any) -> None:
    """Parse a frozen options object's ``press`` and ``decode_attention`` in place (the API edge)."""
    object.__setattr__(options, "press", press_of(options.press))
    object.__setattr__(options, "decode_attention", attention_of(options.decode_attention))


def _make_variant(options: SampleOptions | ScoreOptions, generation_context: Any) -> Variant:
    from kvstore.model.variants.variant import make_variant

    return make_variant(options.press, options.decode_attention, generation_context)  # type: ignore[arg-type]


@documented
@dataclass(frozen=True)
class BuildOptions:
    """How contexts are built into a store."""

    batch_size: int | None = option(
        None, "contexts per prefill (None: 1 on CPU, where it measured faster than padded batches, 8 on accelerators)"
    )
    max_batch_tokens: int | None = option(16384, "padded tokens per batch")
    truncate: bool = option(False, "keep a too long context's last tokens instead of refusing it")
    max_context_tokens: int | None = option(None, "the context limit (None: the model's positions less the reserve)")
    skip_errors: bool = option(False, "count a bad row in the report and build the others")
    shard: tuple[int, int] | None = option(None, "(i, n): build only the contexts whose key is i modulo n")
    presses: tuple[Press, ...] = option(
        (), "press specs whose pressed caches are stored beside each context (kvzip:0.75), with the store's codec"
    )
    scores: tuple[Press, ...] = option(
        (), "scorers whose scores are stored once per context (kvzip, expected_attention: a press without its ratio)"
    )
    dense: bool = option(True, "store the dense chains too (False keeps only what presses and scores make)")
    compose: bool = option(
        False,
        "for contexts given as passages: store each distinct passage once and the head (what sample with "
        "compose reads) instead of each row's exact prefix chain (what sample without compose reads)",
    )

    def __post_init__(self) -> None:
        presses = tuple(parse_press(p) if isinstance(p, str) else p for p in self.presses)
        for p in presses:
            if p.question:
                raise PressError(f"press {p.name}: a question-aware press keeps what each question reads; there is no "
                                 "one pressed cache per context to store")  # fmt: skip
            if p.ratio == 0:
                raise PressError(f"press {p.name}: a ratio of 0 keeps every token; the dense cache is that")
        # one entry per canonical spec: kvzip:0.75 given twice (or as kvzip:0.75:global) is one entry
        object.__setattr__(self, "presses", tuple({p.name: p for p in presses}.values()))
        scores = (parse_scorer(s) if isinstance(s, str) else s for s in self.scores)
        object.__setattr__(self, "scores", tuple({s.scorer_spec: s for s in scores}.values()))
        for s in self.scores:
            check_storable(s)
        if not self.dense and not self.presses:
            if self.scores:  # scores belong to a context stored dense or pressed: alone, gc removes them
                raise ValueError(
                    "dense=False with scores and no presses would store scores that no stored context keeps (gc "
                    "removes them as orphans): keep the dense chains, or add the presses that read them"
                )
            raise ValueError("dense=False stores nothing without presses or scores to store instead")

    @classmethod
    def of(cls, options: BuildOptions | None = None, **fields: Any) -> BuildOptions:
        """``options`` (default: the defaults) with ``fields`` replaced; TypeError for a field
        that does not exist."""
        return replaced(cls, options, fields)


class BuildKeywords(TypedDict, total=False):
    """:class:`BuildOptions`' fields as the keywords of the methods that take it (for the type checker)."""

    batch_size: int | None
    max_batch_tokens: int | None
    truncate: bool
    max_context_tokens: int | None
    skip_errors: bool
    shard: tuple[int, int] | None
    presses: Sequence[Press | str]
    scores: Sequence[Press | str]
    dense: bool
    compose: bool


@documented
@dataclass(frozen=True)
class SampleOptions:
    """How questions are answered."""

    num_new_tokens: int = option(20, "tokens generated per row")
    use_cache: bool = option(True, "load contexts from (and store them in) the store; else the no-cache reference")
    batch_size: int = option(8, "rows per batch")
    max_batch_tokens: int | None = option(None, "padded tokens per batch: rows x (context + question + new tokens)")
    stop_at_eos: bool = option(True, "end a row at its first EOS (pads after it)")
    stop_strings: tuple[str, ...] = option((), "end a row once its text contains one of these (pads after it)")
    truncate: bool = option(False, "keep a too long context's last tokens (as for BuildOptions: use the same value)")
    max_context_tokens: int | None = option(None, "the context limit (as for BuildOptions: use the same value)")
    return_scores: bool = option(False, "keep each step's logits")
    steps: str = option(
        "dynamic", "dynamic (eager, the key length grows), static (fixed shapes) or compiled (static, torch.compile)"
    )
    load_ahead: bool = option(True, "load the next batch's stored prefixes on a worker while a batch decodes")
    press: Press | str | None = option(
        None, "a press spec (snapkv:0.5) or Press applied to each batch's loaded contexts before answering"
    )
    decode_attention: Attention | str | AttentionFunction | None = option(
        None, "a decode-attention spec (topk:64) or function the question and answer steps run under"
    )
    compose: Compose | str | None = option(
        None,
        "for contexts given as passages: full (exact), none, last:N or blend:R (approximate: passages stored once, "
        "placed at their offsets, part recomputed)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "compose", parse_compose(self.compose))
        _typed(self)
        if self.steps not in STEPS:
            raise ValueError(f"steps must be one of {', '.join(STEPS)}, not {self.steps!r}")
        if self.num_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("num_new_tokens and batch_size must be at least 1")

    @classmethod
    def of(cls, options: SampleOptions | None = None, **fields: Any) -> SampleOptions:
        """``options`` (default: the defaults) with ``fields`` replaced; TypeError for a field
        that does not exist."""
        return replaced(cls, options, fields)

    def decoding(self) -> Decoding:
        """How each batch decodes under these options."""
        from kvstore.model.compute.forward import Decoding

        return Decoding(self.num_new_tokens, self.stop_at_eos, tuple(s for s in self.stop_strings if s), self.steps,
                        self.return_scores)  # fmt: skip

    def variant(self, generation_context: Any = None) -> Variant:
        """The one variant a plain ``sample`` answers under: its press, ``generation_context`` and
        decode attention (``dense`` without any)."""
        return _make_variant(self, generation_context)


class GreedyKeywords(TypedDict, total=False):
    """:class:`SampleOptions`' fields but ``num_new_tokens`` (which ``greedy_sample`` takes third,
    positionally) as keywords (for the type checker)."""

    use_cache: bool
    batch_size: int
    max_batch_tokens: int | None
    stop_at_eos: bool
    stop_strings: Sequence[str]
    truncate: bool
    max_context_tokens: int | None
    return_scores: bool
    steps: str
    load_ahead: bool
    press: PressLike
    decode_attention: AttentionLike
    compose: Compose | str | None


class SampleKeywords(GreedyKeywords, total=False):
    """:class:`SampleOptions`' fields as the keywords of the methods that take it (for the type checker)."""

    num_new_tokens: int


@documented
@dataclass(frozen=True)
class ScoreOptions:
    """How continuations are scored (``use_cache=False``: context and continuation in one forward,
    as lm-eval's ``hf`` model runs it)."""

    use_cache: bool = option(True, "load contexts from (and store them in) the store; else the reference forward")
    batch_size: int = option(8, "rows per batch (the continuations of one context together)")
    max_batch_tokens: int | None = option(None, "padded tokens per batch")
    token_logprobs: bool = option(False, "keep each token's log-probability")
    truncate: bool = option(False, "drop a too long row's first context tokens (lm-eval's rule) instead of refusing it")
    press: Press | str | None = option(
        None, "as for SampleOptions; not question-aware (the question is part of the scored context)"
    )
    decode_attention: Attention | str | AttentionFunction | None = option(None, "as for SampleOptions")

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        _typed(self)

    @classmethod
    def of(cls, options: ScoreOptions | None = None, **fields: Any) -> ScoreOptions:
        """``options`` (default: the defaults) with ``fields`` replaced; TypeError for a field
        that does not exist."""
        return replaced(cls, options, fields)

    def variant(self, generation_context: Any = None) -> Variant:
        """The one variant a plain ``score`` runs under (``dense`` without a press or hook)."""
        return _make_variant(self, generation_context)


class ScoreKeywords(TypedDict, total=False):
    """:class:`ScoreOptions`' fields as the keywords of the methods that take it (for the type checker)."""

    use_cache: bool
    batch_size: int
    max_batch_tokens: int | None
    token_logprobs: bool
    truncate: bool
    press: PressLike
    decode_attention: AttentionLike


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


__all__ = [
    "KEYWORDS",
    "STEPS",
    "BuildKeywords",
    "BuildOptions",
    "GreedyKeywords",
    "SampleKeywords",
    "SampleOptions",
    "ScoreKeywords",
    "ScoreOptions",
    "Spelling",
    "apply_prompt",
    "attention_of",
    "press_of",
]
