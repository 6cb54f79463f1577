"""Press specs: which tokens of a stored context a press keeps, as a typed value parsed once.

A spec is ``NAME:RATIO`` followed by optional fields, each once: ``q`` (question-aware), a budget
name (``head``, ``adakv``, ``pyramid``, ``global``, ``layer``), a boolean parameter's name (true),
or ``KEY=VALUE`` for a parameter of the press or of its budget: ``knorm:0.5``, ``snapkv:0.25:q``,
``streaming_llm:0.5:n_sink=8``, ``snapkv:0.5:adakv``, ``kvzip:0.75:layer:plus``,
``expected_attention:0.5:adakv:alpha_safeguard=0.1``. ``RATIO`` is kvpress's
``compression_ratio``, in ``[0, 1)``; 0 keeps everything. The presses, budgets and parameters are
the registry's (:mod:`kvstore.model.press.registry`); :func:`parse_press` gives a :class:`Press`,
whose :attr:`Press.name` is the one printed form of it (``snapkv:.5``, ``snapkv:0.50`` and
``snapkv:0.5:window=64`` are all ``snapkv:0.5``: defaults are left out).

Numbers are ASCII only (``²`` is not a digit here); a ratio has no sign; a field given twice is an
error, never "the last one wins". Errors (:class:`~kvstore.errors.PressError`) are one line
quoting the spec as given. Plain data, no torch: options and variants import it at no cost.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import PressError
from kvstore.model.press.registry import (
    BudgetRule,
    Param,
    ParamValue,
    PressMethod,
    budget_names,
    budget_rule,
    press_catalog,
    press_method,
)

_INT = re.compile(r"[0-9]+")
_FLOAT = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE]-?[0-9]+)?")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def ratio_text(ratio: float) -> str:
    """The printed form of a ratio: the shortest text that reads back as the same float."""
    short = f"{ratio:g}"
    return short if float(short) == ratio else repr(ratio)


def _value_text(v: ParamValue) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return ratio_text(v)
    return str(v)


@dataclass(frozen=True)
class Press:
    """A press: ``method`` (a registered press), ``ratio`` in ``[0, 1)``, ``question`` (``:q``:
    score with the question's queries instead of an observation window), every parameter of the
    method as ``(name, value)`` pairs in name order, the ``budget`` (the method's default when
    given as ``""``) and every parameter of the budget, likewise."""

    method: str
    ratio: float
    question: bool = False
    params: tuple[tuple[str, ParamValue], ...] = ()
    budget: str = ""
    budget_params: tuple[tuple[str, ParamValue], ...] = ()

    def __post_init__(self) -> None:
        m = press_method(self.method)
        if m is None:
            raise PressError(f"unknown press {self.method!r} ({press_catalog()})")
        if (
            not (
                isinstance(self.ratio, (int, float)) and not isinstance(self.ratio, bool) and math.isfinite(self.ratio)
            )
            or not 0 <= self.ratio < 1
        ):
            raise PressError(f"press {self.method}: ratio {self.ratio!r} is not in [0, 1)")
        object.__setattr__(self, "ratio", float(self.ratio))
        object.__setattr__(self, "params", _filled(f"press {self.method}", m.params, self.params))
        budget = self.budget or m.budget
        rule = budget_rule(budget)
        if rule is None:
            raise PressError(f"press {self.method}: unknown budget {budget!r} (budgets: {', '.join(budget_names())})")
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "budget_params", _filled(f"budget {budget}", rule.params, self.budget_params))
        if self.question and not m.question:
            asks = "reads keys alone" if m.reads == "keys" else f"reads its {m.reads}"
            raise PressError(f"press {self.method} {asks}; ':q' (question-aware) is for window presses such as snapkv")
        alpha = dict(self.budget_params).get("alpha_safeguard")
        if alpha is not None and not 0 <= float(alpha) <= 1:
            raise PressError(f"press {self.method}: alpha_safeguard={alpha!r} is not in [0, 1]")

    @property
    def record(self) -> PressMethod:
        """The registry's record of this press's method."""
        m = press_method(self.method)
        if m is None:  # unregistered since it was parsed
            raise PressError(f"press {self.method!r} is no longer registered")
        return m

    @property
    def rule(self) -> BudgetRule:
        rule = budget_rule(self.budget)
        assert rule is not None
        return rule

    @property
    def name(self) -> str:
        """The canonical spec (result keys, variant names): ``method:ratio[:q][:budget][:k=v...]``,
        defaults left out, a true boolean parameter that defaults to false as its bare name."""
        m = self.record
        parts = [self.method, ratio_text(self.ratio)] + (["q"] if self.question else [])
        if self.budget != m.budget:
            parts.append(self.budget)
        for (k, v), owner in [(kv, m) for kv in self.params] + [(kv, self.rule) for kv in self.budget_params]:
            default = owner.defaults.get(k)
            if v == default and type(v) is type(default):
                continue
            parts.append(k if v is True and default is False else f"{k}={_value_text(v)}")
        return ":".join(parts)

    def param(self, key: str) -> ParamValue:
        """A parameter of the method or of the budget."""
        for k, v in self.params + self.budget_params:
            if k == key:
                return v
        raise KeyError(f"press {self.method} has no parameter {key!r}")

    def has_param(self, key: str) -> bool:
        return any(k == key for k, _ in self.params + self.budget_params)

    @property
    def reads(self) -> str:
        """What it scores from: ``keys``, ``window``, ``context`` or ``replay``."""
        return self.record.reads

    @property
    def needs_queries(self) -> bool:
        """Whether it scores tokens with queries (an observation window, or the question)."""
        return self.record.reads == "window"

    @property
    def window(self) -> int:
        """Observation window: the context's last tokens whose queries score the others (0: none,
        or the question's with ``:q``)."""
        if self.record.reads != "window" or self.question:
            return 0
        return int(self.param("window")) if self.has_param("window") else 1

    def n_kept(self, n_tokens: int) -> int:
        """Tokens each head of a context of ``n_tokens`` keeps under the ``head`` budget:
        ``int(n_tokens * (1 - ratio))``, at least one (kvpress 0.5.5's rule); other budgets start
        from it (:mod:`kvstore.model.press.select`)."""
        return max(1, int(n_tokens * (1 - self.ratio))) if n_tokens else 0

    def scorer_key(self) -> tuple:
        """What its scores depend on: every ratio and budget of one method and parameters scores
        alike (but for a press whose record is not ``ratio_free``)."""
        ratio = () if self.record.ratio_free else (self.ratio,)
        return (self.method, self.question, self.params, *ratio)

    @property
    def scorer_spec(self) -> str:
        """The scorer as text (what stored scores are keyed by): ``method[:q][:k=v...]`` with every
        parameter, defaults included, so that a changed default never reads old scores."""
        parts = [self.method] + (["q"] if self.question else [])
        parts += [f"{k}={_value_text(v)}" for k, v in self.params]
        if not self.record.ratio_free:
            parts.append(f"ratio={ratio_text(self.ratio)}")
        return ":".join(parts)


@dataclass(frozen=True)
class ScoringTokens:
    """Context tokens the presses' scoring forwards ran (never prefill): ``window`` (observation
    windows: snapkv, tova), ``context`` (a re-run of the context's own tokens: expected_attention)
    and ``replay`` (kvzip's replays, prompts included)."""

    window: int = 0
    context: int = 0
    replay: int = 0

    @property
    def total(self) -> int:
        return self.window + self.context + self.replay

    def __add__(self, other: ScoringTokens) -> ScoringTokens:
        return ScoringTokens(self.window + other.window, self.context + other.context, self.replay + other.replay)

    def plus(self, kind: str, n: int) -> ScoringTokens:
        """These counts with ``n`` more of ``kind`` (``window``, ``context`` or ``replay``)."""
        return ScoringTokens(**{**self.__dict__, kind: getattr(self, kind) + n})


def _filled(
    owner: str, declared: tuple[Param, ...], given: tuple[tuple[str, ParamValue], ...]
) -> tuple[tuple[str, ParamValue], ...]:
    """Every declared parameter's value (the given ones checked against their type), in name order."""
    kinds = {p.name: p for p in declared}
    out = {p.name: p.default for p in declared}
    for k, v in given:
        p = kinds.get(k)
        if p is None:
            known = ", ".join(kinds) or "none"
            raise PressError(f"{owner}: unknown parameter {k!r} (known: {known})")
        if p.kind is float and type(v) is int:
            v = float(v)
        if type(v) is not p.kind or (isinstance(v, float) and not math.isfinite(v)):
            raise PressError(f"{owner}: {k}={v!r} must be {_kind_text(p)}")
        if p.kind is int and (v < 0 or (v < 1 and k != "seed")):
            raise PressError(f"{owner}: {k}={v!r} must be a positive integer")
        out[k] = v
    return tuple(sorted(out.items()))


def _kind_text(p: Param) -> str:
    return {int: "a positive integer", float: "a number", bool: "true or false"}[p.kind]


def _number(text: str, field: str, spec: str, kind: type) -> ParamValue:
    """``text`` as ``kind``, ASCII digits only (PressError quoting ``spec`` otherwise)."""
    if kind is bool:
        low = text.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise PressError(f"press {spec!r}: {field} must be true or false, not {text!r}")
    pattern = _INT if kind is int else _FLOAT
    if not pattern.fullmatch(text):
        raise PressError(f"press {spec!r}: {field} must be {'a whole number' if kind is int else 'a number'}, "
                         f"written in ASCII digits (not {text!r})")  # fmt: skip
    return int(text) if kind is int else float(text)


def parse_press(spec: str) -> Press:
    """The :class:`Press` of a spec (see the module docstring). PressError (one line) otherwise."""
    if not isinstance(spec, str):
        raise PressError(f"press spec {spec!r} is not text")
    text = spec.strip()
    if "+" in text:
        raise PressError(
            f"press {spec!r}: a press spec has no '+'; give the decode attention apart (decode_attention= or "
            "--decode-attention), or the composed variant PRESS+ATTENTION to variants= / --variant"
        )
    parts = text.split(":")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise PressError(f"press {spec!r}: expected NAME:RATIO (e.g. snapkv:0.5); {press_catalog()}")
    name, ratio_s, rest = parts[0], parts[1], parts[2:]
    method = press_method(name)
    if method is None:
        raise PressError(
            f"press {spec!r}: unknown press {name!r} ({press_catalog()}; a press added with register_press is "
            "known only in the Python process that registered it: use it through the Python API there)"
        )
    if not _FLOAT.fullmatch(ratio_s):
        raise PressError(f"press {spec!r}: the ratio {ratio_s!r} is not a number in [0, 1) (ASCII digits, no sign)")
    ratio = float(ratio_s)
    question, budget, bare = _fields(spec, rest)
    rule = budget_rule(budget or method.budget)
    assert rule is not None
    params, budget_given = _parameters(spec, name, method, rule, bare)
    try:
        return Press(name, ratio, question, tuple(params.items()), budget, tuple(budget_given.items()))
    except PressError as exc:
        raise PressError(f"press {spec!r}: {str(exc).split(': ', 1)[-1]}") from None


def _fields(spec: str, rest: Sequence[str]) -> tuple[bool, str, list[tuple[str, str]]]:
    """The fields of a press spec after its ratio: ``q``, the budget named, and the rest as
    ``(field, NAME[=VALUE])``, resolved once the budget is known. PressError for an empty or
    repeated field, or two budgets."""
    question, budget = False, ""
    bare: list[tuple[str, str]] = []
    seen: set[str] = set()
    for part in rest:
        key, eq, value = part.partition("=")
        if not key:
            raise PressError(f"press {spec!r}: an empty field (two ':' in a row)")
        if key in seen:
            raise PressError(f"press {spec!r}: {key!r} is given twice")
        seen.add(key)
        if not eq:
            if key == "q":
                question = True
            elif budget_rule(key) is not None:
                if budget:
                    raise PressError(f"press {spec!r}: two budgets ({budget}, {key}); give one")
                budget = key
            else:
                bare.append((part, key))
            continue
        bare.append((part, key + "=" + value))
    return question, budget, bare


def _parameters(
    spec: str, name: str, method: PressMethod, rule: BudgetRule, bare: Sequence[tuple[str, str]]
) -> tuple[dict[str, ParamValue], dict[str, ParamValue]]:
    """The press's and the budget's parameters of ``bare`` fields; PressError naming a field that
    is neither (and the budget it belongs to, if any) or a value of the wrong kind."""
    params: dict[str, ParamValue] = {}
    budget_given: dict[str, ParamValue] = {}
    for part, item in bare:
        key, eq, value = item.partition("=")
        p = method.param(key)
        target = params
        if p is None:
            p = rule.param(key)
            target = budget_given
        if p is None:
            other = next((b for b in budget_names() if (r := budget_rule(b)) is not None and r.param(key)), None)
            hint = f"; it belongs to the {other} budget: add ':{other}'" if other else ""
            known = [x.name for x in method.params + rule.params]
            raise PressError(
                f"press {spec!r}: {part!r} is neither 'q', a budget ({', '.join(budget_names())}) nor a parameter of "
                f"{name}{' / ' + rule.name if rule.params else ''} ({', '.join(known) or 'none'}){hint}"
            )
        if not eq:
            if p.kind is not bool:
                raise PressError(f"press {spec!r}: {key} needs a value ({key}=...)")
            target[key] = True
        else:
            target[key] = _number(value, key, spec, p.kind)
    return params, budget_given


def parse_scorer(spec: str) -> Press:
    """A scorer spec (what ``--score`` takes: a press without its ratio, ``kvzip`` or
    ``kvzip:chunk=1024``; a whole press spec's ratio, whatever its value, and its budget are
    ignored) as a :class:`Press` of ratio 0. PressError (one line, quoting ``spec``) otherwise."""
    if not isinstance(spec, str):
        raise PressError(f"scorer spec {spec!r} is not text")
    parts = spec.strip().split(":")
    if len(parts) >= 2 and _FLOAT.fullmatch(parts[1]):
        parts[1] = "0"  # the ratio is ignored
    else:
        parts.insert(1, "0")
    as_press = ":".join(parts)
    try:
        press = parse_press(as_press)
    except PressError as exc:  # name what was given, not the press spec made of it
        raise PressError(str(exc).replace(f"press {as_press!r}", f"scorer {spec!r}", 1)) from None
    return Press(press.method, 0.0, press.question, press.params)


def check_storable(press: Press) -> None:
    """PressError (one line) unless ``press``'s scores can be stored (``build --score``)."""
    if press.question:
        raise PressError(
            f"--score {press.method}:q: a question-aware press scores with each question's queries, so its scores "
            "cannot be stored once per context; drop ':q'"
        )
    if not press.record.ratio_free:
        raise PressError(f"--score {press.method}: its scores depend on the ratio; nothing to store once")


def is_press_spec(spec: str) -> bool:
    """Whether ``spec`` names a press (its first field is a registered press)."""
    return isinstance(spec, str) and press_method(spec.strip().split(":", 1)[0]) is not None


__all__ = ["Press", "ScoringTokens", "check_storable", "is_press_spec", "parse_press", "parse_scorer", "ratio_text"]
