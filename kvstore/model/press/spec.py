"""Press specs: which tokens of a stored context a press keeps, as a typed value parsed once.

A press spec is ``NAME:RATIO``, optionally ``:q`` (question-aware) and ``:KEY=VALUE`` parameters:
``knorm:0.5``, ``snapkv:0.25:q``, ``streaming_llm:0.5:n_sink=8``. ``RATIO`` is kvpress's
``compression_ratio``, in ``[0, 1)``: a context of ``c`` tokens keeps ``int(c * (1 - RATIO))`` of
them, at least one (sink and window tokens count in that budget); 0 keeps everything. :func:`parse_press` gives
a :class:`Press`, whose :attr:`Press.name` is the one printed form of it (``snapkv:.5`` and
``snapkv:0.50`` are both ``snapkv:0.5``; parameters at their defaults are left out).

The methods and their fixed parameters (defaults: kvpress 0.5.5's) are :data:`PRESS_METHODS`; how each
scores tokens is :mod:`kvstore.model.press.scorers`. Plain data, no torch: options and variants
import it at no cost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvstore.errors import PressError


@dataclass(frozen=True)
class Method:
    """One press method: its fixed parameters (name -> default), whether it reads queries (of an
    observation window of the context's last tokens, or of the question with ``:q``), and what it
    always keeps, in one phrase (for the docs and errors)."""

    name: str
    params: Mapping[str, int]
    queries: bool
    keeps: str


def _method(name: str, params: dict[str, int], queries: bool, keeps: str) -> Method:
    return Method(name, MappingProxyType(params), queries, keeps)


# kvpress 0.5.5's defaults: KnormPress, StreamingLLMPress(n_sink=4), RandomPress (seed: kvpress draws
# unseeded by default; kvstore's is seeded so that runs repeat), KeyDiffPress,
# SnapKVPress(window_size=64, kernel_size=5), TOVAPress (a window of the last token)
PRESS_METHODS: Mapping[str, Method] = MappingProxyType(
    {
        "knorm": _method("knorm", {}, False, "nothing: the tokens with the smallest key norms"),
        "streaming_llm": _method("streaming_llm", {"n_sink": 4}, False, "the first n_sink tokens and the most recent"),
        "random": _method("random", {"seed": 0}, False, "nothing: a seeded random choice"),
        "keydiff": _method("keydiff", {}, False, "nothing: the keys least like the mean key direction"),
        "snapkv": _method("snapkv", {"window": 64, "kernel": 5}, True, "the last window tokens"),
        "tova": _method("tova", {}, True, "the last token"),
    }
)


def ratio_text(ratio: float) -> str:
    """The printed form of a ratio: the shortest text that reads back as the same float."""
    short = f"{ratio:g}"
    return short if float(short) == ratio else repr(ratio)


@dataclass(frozen=True)
class Press:
    """A press: ``method`` (a key of :data:`PRESS_METHODS`), ``ratio`` in ``[0, 1)``, ``question``
    (``:q``: score with the question's queries instead of an observation window), and every
    fixed parameter of the method as ``(name, value)`` pairs in name order."""

    method: str
    ratio: float
    question: bool = False
    params: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        m = PRESS_METHODS.get(self.method)
        if m is None:
            raise PressError(f"unknown press {self.method!r} (presses: {', '.join(PRESS_METHODS)})")
        if not (isinstance(self.ratio, (int, float)) and math.isfinite(self.ratio) and 0 <= self.ratio < 1):
            raise PressError(f"press {self.method}: ratio {self.ratio!r} is not in [0, 1)")
        object.__setattr__(self, "ratio", float(self.ratio))
        given = dict(self.params)
        unknown = sorted(set(given) - set(m.params))
        if unknown:
            known = ", ".join(m.params) or "none"
            raise PressError(f"press {self.method}: unknown parameter(s) {', '.join(unknown)} (known: {known})")
        full = {**m.params, **given}
        for k, v in full.items():
            if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and k != "seed") or v < 0:
                raise PressError(f"press {self.method}: {k}={v!r} must be a positive integer")
        object.__setattr__(self, "params", tuple(sorted(full.items())))
        if self.question and not m.queries:
            raise PressError(
                f"press {self.method} scores tokens from keys alone; ':q' (question-aware) is for presses that read "
                f"queries ({', '.join(n for n, x in PRESS_METHODS.items() if x.queries)})"
            )

    @property
    def name(self) -> str:
        """The canonical spec (result keys, variant names): ``method:ratio[:q][:k=v...]``."""
        defaults = PRESS_METHODS[self.method].params
        extra = [f"{k}={v}" for k, v in self.params if defaults.get(k) != v]
        return ":".join([self.method, ratio_text(self.ratio)] + (["q"] if self.question else []) + extra)

    def param(self, key: str) -> int:
        return dict(self.params)[key]

    @property
    def needs_queries(self) -> bool:
        """Whether it scores tokens with queries (an observation window, or the question)."""
        return PRESS_METHODS[self.method].queries

    @property
    def window(self) -> int:
        """Observation window: the context's last tokens whose queries score the others (0: none)."""
        if not self.needs_queries or self.question:
            return 0
        return self.param("window") if self.method == "snapkv" else 1

    def kept(self, n_tokens: int) -> int:
        """Tokens a context of ``n_tokens`` keeps: ``int(n_tokens * (1 - ratio))``, at least one
        (kvpress 0.5.5's rule)."""
        return max(1, int(n_tokens * (1 - self.ratio))) if n_tokens else 0

    def scorer_key(self) -> tuple:
        """What its scores depend on (every ratio of one method and parameters scores alike)."""
        return (self.method, self.question, self.params)


def parse_press(spec: str) -> Press:
    """The :class:`Press` of a spec (see the module docstring). PressError (one line) otherwise."""
    text = spec.strip()
    parts = text.split(":")
    if len(parts) < 2 or not parts[1]:
        raise PressError(f"press {text!r}: expected NAME:RATIO (e.g. snapkv:0.5), presses: {', '.join(PRESS_METHODS)}")
    name, ratio_s, rest = parts[0], parts[1], parts[2:]
    try:
        ratio = float(ratio_s)
    except ValueError:
        raise PressError(f"press {text!r}: ratio {ratio_s!r} is not a number in [0, 1)") from None
    question = False
    params: dict[str, int] = {}
    for part in rest:
        if part == "q":
            question = True
            continue
        key, eq, value = part.partition("=")
        if not eq or not value.lstrip("-").isdigit():
            raise PressError(f"press {text!r}: {part!r} is neither 'q' nor KEY=INTEGER")
        params[key] = int(value)
    return Press(name, ratio, question, tuple(params.items()))


def is_press_spec(spec: str) -> bool:
    """Whether ``spec`` names a press (its first field is a press method)."""
    return spec.strip().split(":", 1)[0] in PRESS_METHODS


__all__ = ["PRESS_METHODS", "Method", "Press", "is_press_spec", "parse_press", "ratio_text"]
