"""The press registry: one record per press, one per budget, and :func:`register_press`.

A **press** keeps some of a context's cached tokens and drops the rest. It is one
:class:`PressMethod` record: its name, its parameters with their defaults, what it reads to score
tokens (``keys``: the cached keys and values; ``window``: the queries of the context's last
``window`` tokens, or of the question with ``:q``; ``context``: a forward over the context's own
tokens; ``replay``: the context replayed after a prompt), what it always keeps, its default budget
and its scorer. A **budget** (:class:`BudgetRule`) says how many tokens each layer and head keeps
from the scores: ``head`` (every head the same count), ``adakv`` (a layer's heads share its count,
each keeping a safeguard), ``pyramid`` (fewer tokens in later layers), ``global`` (one cut over
every layer and head), ``layer`` (one cut per layer over its heads). A spec names a press, its
ratio, and optionally ``:q``, a budget and parameters (:mod:`kvstore.model.press.spec`).

Everything that lists presses (the spec parser's errors, the CLI's help, the docs' table) reads
this registry; nothing else compares a press name with a literal. The module is plain data (no
torch): built-in scorers are named by ``module:function`` and imported on first use, so that
``kvstore --help`` stays fast. A user registers a press from Python with one call::

    from kvstore import register_press

    def score(inputs):                      # per layer: higher is kept
        return inputs.values.norm(dim=-1)   # [kv_heads, c]

    register_press("vnorm", score, keeps="the tokens with the largest value norms")
    adapter.sample(contexts, questions, store=store, press="vnorm:0.5")

(:class:`kvstore.model.press.scorers.LayerInputs` is what a per-layer scorer receives.)
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypedDict

from kvstore.errors import PressError
from kvstore.model.keywords import documented, option, takes_options
from kvstore.model.press.identity import OpaqueValueError, scorer_identity

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Unpack

ParamValue = int | float | bool
READS = ("keys", "window", "context", "replay")
NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
RESERVED = frozenset({"q", "dense"})  # spec words that are never a press, budget or parameter


@dataclass(frozen=True)
class Param:
    """One parameter: its name, default (its type is the default's: int, float or bool) and what it
    does (one phrase, for the docs and the help)."""

    name: str
    default: ParamValue
    help: str = ""

    @property
    def kind(self) -> type:
        return type(self.default)


@dataclass(frozen=True)
class PressMethod:
    """One press (see the module docstring). ``scorer``: for ``keys`` and ``window`` presses a
    per-layer function ``scorer(inputs: LayerInputs) -> [kv_heads, c]`` scores; for ``context``
    and ``replay`` presses a row function ``scorer(row: RowContext) -> list of [kv_heads, c]``
    (:mod:`kvstore.model.press.scorers`); or a ``module:function`` naming one. ``question``: it may
    score with the question's queries instead (``:q``, ``window`` presses). ``ratio_free``: its
    scores do not depend on the ratio, so every ratio shares them and they can be stored.
    ``follows``: the kvpress press and paper it follows; ``formula``: its score in one line.
    ``identity``: what the scorer computes, as :func:`scorer_identity` digests it (``""`` for the
    built-ins, whose specs alone key their stored entries); part of the keys of its stored scores
    and pressed caches, so that a redefined press never answers from its old entries."""

    name: str
    params: tuple[Param, ...]
    reads: str
    keeps: str
    budget: str
    scorer: Callable[..., Any] | str
    follows: str = ""
    formula: str = ""
    question: bool = False
    ratio_free: bool = True
    identity: str = ""

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def defaults(self) -> Mapping[str, ParamValue]:
        return MappingProxyType({p.name: p.default for p in self.params})

    def load_scorer(self) -> Callable[..., Any]:
        """The scorer function (imported on first use when named by ``module:function``)."""
        if callable(self.scorer):
            return self.scorer
        module, _, fn = self.scorer.partition(":")
        return getattr(importlib.import_module(module), fn)


@dataclass(frozen=True)
class BudgetRule:
    """How many tokens each layer and head keeps, given every token's scores (see the module
    docstring); ``params`` are the budget's own; ``follows`` and ``summary`` for the docs. ``keep``:
    ``keep(press, scores, c) -> masks``, per layer a ``[kv_heads, c]`` bool mask of the tokens kept
    from that layer's ``[kv_heads, c]`` scores (higher is kept) for a ratio above 0 and ``c > 0``
    tokens; or a ``module:function`` naming one (the built-ins': :mod:`kvstore.model.press.budgets`)."""

    name: str
    params: tuple[Param, ...]
    summary: str
    follows: str = ""
    keep: Callable[..., Any] | str = ""

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def defaults(self) -> Mapping[str, ParamValue]:
        return MappingProxyType({p.name: p.default for p in self.params})

    def load_keep(self) -> Callable[..., Any]:
        """The ``keep`` function (imported on first use when named by ``module:function``)."""
        if callable(self.keep):
            return self.keep
        module, _, fn = self.keep.partition(":")
        return getattr(importlib.import_module(module), fn)


_lock = threading.Lock()
_PRESSES: dict[str, PressMethod] = {}
_BUDGETS: dict[str, BudgetRule] = {}


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not NAME.match(name) or name in RESERVED:
        raise PressError(f"{what} name {name!r} must be lowercase letters, digits and _ (not q or dense)")


def _check_params(owner: str, params: tuple[Param, ...]) -> None:
    names = [p.name for p in params]
    for p in params:
        _check_name(p.name, f"{owner}: parameter")
        if type(p.default) not in (int, float, bool):
            raise PressError(f"{owner}: parameter {p.name} needs an int, float or bool default, not {p.default!r}")
    if len(set(names)) != len(names):
        raise PressError(f"{owner}: a parameter is declared twice ({', '.join(names)})")


def register_budget(rule: BudgetRule) -> BudgetRule:
    """Add a budget (its record, with its ``keep`` function): then ``PRESS:RATIO:NAME`` selects
    with it wherever a press spec works, and the catalog, the help and docs/presses.md's table list
    it. Raises PressError for a bad name or parameter, a name a press has, or no ``keep``."""
    _check_name(rule.name, "budget")
    if not (callable(rule.keep) or (isinstance(rule.keep, str) and ":" in rule.keep)):
        raise PressError(f"budget {rule.name}: keep must be a function or 'module:function'")
    _check_params(f"budget {rule.name}", rule.params)
    with _lock:
        if rule.name in _PRESSES:
            raise PressError(f"budget {rule.name!r} would shadow the press of that name")
        _BUDGETS[rule.name] = rule
    return rule


@documented
@dataclass(frozen=True)
class PressRegistration:
    """How :func:`register_press` registers a press, beside its name and scorer (its keywords)."""

    params: Mapping[str, ParamValue] | None = option(None, "its parameters and their int, float or bool defaults")
    reads: str = option("keys", "what the scorer sees: keys, window, context or replay")
    keeps: str = option("nothing: the best-scored tokens", "what it keeps besides, for the docs")
    budget: str = option("head", "its default budget")
    question: bool = option(False, "whether it may be used with :q (a window press)")
    ratio_free: bool = option(True, "False when its scores depend on the ratio")
    version: str = option("", "any text; change it when the scorer computes something its digest cannot see")


class PressRegistrationKeywords(TypedDict, total=False):
    """:class:`PressRegistration`'s fields as :func:`register_press`'s keywords (for the type checker)."""

    params: Mapping[str, ParamValue] | None
    reads: str
    keeps: str
    budget: str
    question: bool
    ratio_free: bool
    version: str


@takes_options(PressRegistration)
def register_press(
    name: str,
    score: Callable[..., Any] | str,
    *,
    options: PressRegistration | None = None,
    **fields: Unpack[PressRegistrationKeywords],
) -> PressMethod:
    """Register a press under ``name`` and return its record; then ``NAME:RATIO`` works wherever a
    press spec does (``sample``, ``sweep``, ``score``, the lm-eval ``press=`` argument).

    ``score`` is the scorer (see :class:`PressMethod`): with ``reads="keys"`` or ``"window"`` it
    takes a :class:`kvstore.model.press.scorers.LayerInputs` and returns ``[kv_heads, c]`` scores
    (higher is kept) for one row and layer. ``params``: its parameters and their defaults (int, float
    or bool), which specs may set (``name:0.5:alpha=2``) and the scorer reads with
    ``inputs.press.param(name)``; a ``window`` press observes its int ``window`` parameter's last
    tokens (the last token without one). ``budget``: its default budget (``head``, ``adakv``,
    ``pyramid``, ``global`` or ``layer``). ``ratio_free``: False when its scores depend on the
    ratio. ``version``: any text; change it when the scorer computes something else in a way its
    code digest cannot see (see :func:`scorer_identity`: what it reads from other modules or
    globals); it is required when the scorer holds a value the digest cannot read by content. The
    record's ``identity`` digests all of these, so the scores and pressed caches stored under an
    earlier definition of ``name`` are never read for this one. Raises PressError for a bad name or
    parameter, a name taken (:func:`unregister_press` first to redefine one), an unknown ``reads``
    or budget, or (OpaqueValueError) such a value without ``version``. (Built-in records, with the kvpress
    press they follow and their formula for the docs, go through :func:`add_press`.) The keywords are
    the fields of :class:`PressRegistration`; ``options=`` gives them as one object."""
    assert options is not None  # takes_options gives the complete options
    o = options
    params, reads, budget, question, ratio_free, version = (
        o.params, o.reads, o.budget, o.question, o.ratio_free, o.version
    )  # fmt: skip
    _check_name(name, "press")
    if not (callable(score) or (isinstance(score, str) and ":" in score)):
        raise PressError(f"press {name}: the scorer must be a function or 'module:function'")
    if reads not in READS:
        raise PressError(f"press {name}: reads must be one of {', '.join(READS)}, not {reads!r}")
    declared = tuple(Param(k, v) for k, v in (params or {}).items())
    _check_params(f"press {name}", declared)
    if reads == "window" and any(p.name == "window" and p.kind is not int for p in declared):
        raise PressError(f"press {name}: its 'window' parameter must be an int")
    if not isinstance(version, str):
        raise PressError(f"press {name}: version must be text, not {version!r}")
    facts = (reads, budget, question, ratio_free, tuple((p.name, p.default) for p in declared))
    try:
        identity = scorer_identity(score, version, facts)
    except OpaqueValueError as e:
        raise OpaqueValueError(f"press {name}: {e}") from None
    return add_press(PressMethod(name, declared, reads, o.keeps, budget, score, question=question,
                                 ratio_free=ratio_free, identity=identity))  # fmt: skip


def add_press(method: PressMethod, *, replace: bool = False) -> PressMethod:
    """Register a complete record (what :func:`register_press` builds)."""
    _check_name(method.name, "press")
    _check_params(f"press {method.name}", method.params)
    with _lock:
        if method.budget not in _BUDGETS:
            raise PressError(f"press {method.name}: unknown budget {method.budget!r} (budgets: {', '.join(_BUDGETS)})")
        if method.name in _BUDGETS:
            raise PressError(f"press {method.name!r} would shadow the budget of that name")
        if method.name in _PRESSES and not replace:
            raise PressError(f"press {method.name!r} is registered already (replace=True to redefine it)")
        clash = {p.name for p in method.params} & {p.name for b in _BUDGETS.values() for p in b.params}
        if clash:
            raise PressError(f"press {method.name}: parameter(s) {', '.join(sorted(clash))} belong to a budget")
        _PRESSES[method.name] = method
    return method


def unregister_press(name: str) -> None:
    """Remove a press registered with :func:`register_press` (tests; built-ins stay)."""
    with _lock:
        method = _PRESSES.get(name)
        if method is not None and isinstance(method.scorer, str) and method.scorer.startswith("kvstore."):
            raise PressError(f"press {name!r} is built in")
        _PRESSES.pop(name, None)


def unregister_budget(name: str) -> None:
    """Remove a budget :func:`register_budget` added (a built-in one stays: PressError)."""
    rule = _BUDGETS.get(name)
    if rule is not None and isinstance(rule.keep, str) and rule.keep.startswith("kvstore."):
        raise PressError(f"budget {name!r} is built in")
    with _lock:
        _BUDGETS.pop(name, None)


def press_method(name: str) -> PressMethod | None:
    return _PRESSES.get(name)


def budget_rule(name: str) -> BudgetRule | None:
    return _BUDGETS.get(name)


def press_names() -> tuple[str, ...]:
    return tuple(_PRESSES)


def budget_names() -> tuple[str, ...]:
    return tuple(_BUDGETS)


def press_catalog() -> str:
    """One line naming every press (with its parameters) and budget, for errors and help."""
    presses = ", ".join(
        m.name
        + (f"({', '.join(f'{p.name}={p.default}' for p in m.params)})" if m.params else "")
        + (" [:q]" if m.question else "")
        for m in _PRESSES.values()
    )
    budgets = ", ".join(
        b.name + (f"({', '.join(f'{p.name}={p.default}' for p in b.params)})" if b.params else "")
        for b in _BUDGETS.values()
    )
    return f"presses: {presses}; budgets: {budgets}"


def press_table() -> str:
    """The presses and budgets as Markdown tables (docs/presses.md holds this text; a test keeps
    the two the same): one row per press, one per budget."""

    def params(ps: tuple[Param, ...]) -> str:
        return ", ".join(f"`{p.name}={_text(p.default)}`" for p in ps) or "none"

    rows = ["| press | reads | score (higher is kept) | always kept | budget | parameters | follows |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for m in _PRESSES.values():
        reads = m.reads + (", or the question with `:q`" if m.question else "")
        rows.append(
            f"| `{m.name}` | {reads} | {m.formula} | {m.keeps} | `{m.budget}` | {params(m.params)} | {m.follows} |"
        )
    rows += ["", "| budget | how many tokens each layer and head keeps | parameters | follows |", "|---|---|---|---|"]
    for b in _BUDGETS.values():
        rows.append(f"| `{b.name}` | {b.summary} | {params(b.params)} | {b.follows or 'kvpress ScorerPress'} |")
    return "\n".join(rows)


def _text(v: ParamValue) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


# -- the built-ins ----------------------------------------------------------------------------------
_S = "kvstore.model.press.scorers:"
_B = "kvstore.model.press.budgets:keep_"

for _rule in (
    BudgetRule(
        "head", (), "every KV head keeps int(c(1 - ratio)) of its tokens (kvpress's ScorerPress)", keep=_B + "head"
    ),
    BudgetRule(
        "adakv",
        (Param("alpha_safeguard", 0.2, "each head keeps at least this share of a head's budget"),),
        "a layer keeps int(c(1 - ratio)) tokens per head in all, shared by its heads by score; each head keeps at "
        "least int(alpha_safeguard x that) of its best tokens",
        "AdaKVPress, Feng et al. 2024 (arXiv 2407.11550)",
        _B + "adakv",
    ),
    BudgetRule(
        "pyramid",
        (Param("beta", 20, "the pyramid's steepness: the last layer keeps 1/beta of the first's share"),),
        "every head of layer l keeps n_l tokens, n_l falling linearly from the first layer to the last, the "
        "layers' mean c(1 - ratio), the first layer at most c - window (the press's window, else 64); where "
        "the schedule does not fit, every layer round(c(1 - ratio))",
        "PyramidKVPress, Cai et al. 2024 (arXiv 2406.02069)",
        _B + "pyramid",
    ),
    BudgetRule(
        "global",
        (),
        "one cut over every layer and head: the int(L H c ratio) lowest scores of the context go",
        "KVzipPress (its default, non-uniform budgets)",
        _B + "global",
    ),
    BudgetRule(
        "layer",
        (),
        "one cut per layer over its heads: each layer drops its int(H c ratio) lowest scores",
        "KVzipPress(layerwise=True)",
        _B + "layer",
    ),
):
    register_budget(_rule)

for _method in (
    PressMethod(
        "knorm", (), "keys", "nothing: the keys with the smallest norms", "head", _S + "knorm",
        "KnormPress, Devoto et al. 2024 (arXiv 2406.11430)", "-‖k‖",
    ),
    PressMethod(
        "streaming_llm", (Param("n_sink", 4, "first tokens always kept"),), "keys",
        "the first n_sink tokens and the most recent", "head", _S + "streaming_llm",
        "StreamingLLMPress, Xiao et al. (arXiv 2309.17453)",
        "1 on the first n_sink tokens and the most recent, 0 on the c - kept after the sinks", ratio_free=False,
    ),
    PressMethod(
        "random", (Param("seed", 0, "the generator's seed (kvpress draws unseeded)"),), "keys",
        "nothing: a seeded random choice", "head", _S + "random", "RandomPress",
        "uniform draws from a generator seeded with seed, the same at every layer",
    ),
    PressMethod(
        "keydiff", (), "keys", "nothing: the keys least like the mean key direction", "head", _S + "keydiff",
        "KeyDiffPress (arXiv 2504.15364)", "-cos(k, a), a the mean unit key of the head",
    ),
    PressMethod(
        "snapkv",
        (Param("window", 64, "observation window: the last tokens whose queries score"),
         Param("kernel", 5, "width of the average pool over the scores")),
        "window", "the last window tokens", "head", _S + "snapkv",
        "SnapKVPress, Li et al. 2024 (arXiv 2404.14469)",
        "the window's softmax attention over the context, averaged over the window, pooled (kernel), averaged over "
        "each KV head's query heads",
        question=True,
    ),
    PressMethod(
        "tova", (), "window", "the last token", "head", _S + "tova", "TOVAPress, Oren et al. 2024 (arXiv 2401.06104)",
        "the last token's attention over the others, averaged over every query head", question=True,
    ),
    PressMethod(
        "expected_attention",
        (Param("n_future_positions", 512, "future positions the query statistics are rotated to"),
         Param("n_sink", 4, "first tokens always kept, left out of the statistics"),
         Param("use_covariance", True, "add the queries' covariance term"),
         Param("use_vnorm", True, "scale by the value norms"),
         Param("epsilon", 0.0, "added to the scores before the value-norm scaling")),
        "context", "the first n_sink tokens", "head", _S + "expected_attention",
        "ExpectedAttentionPress (kvpress)",
        "the softmax over the context of k·μ/√d + kΣk/2d (μ, Σ: the mean and covariance of the context's queries "
        "after the sinks, before their rotary embedding, rotated by the mean rotation of the next "
        "n_future_positions positions), averaged over each KV head's query heads, times ‖v‖",
    ),
    PressMethod(
        "kvzip",
        (Param("chunk", 2048, "context tokens replayed per forward"),
         Param("n_sink", 4, "first tokens always kept"),
         Param("plus", False, "KVzip+ normalization: divide by ‖h‖, multiply by ‖W_o v‖")),
        "replay", "the first n_sink tokens", "global", "kvstore.model.press.kvzip:kvzip_scores",
        "KVzipPress, Kim et al. 2025 (arXiv 2505.23416)",
        "the largest attention the context's replay (after a 'repeat the previous context' prompt, teacher-forced "
        "on top of the cache) pays the token, over the replay's queries and each KV head's query heads",
    ),
):  # fmt: skip
    add_press(_method)


__all__ = [
    "READS",
    "BudgetRule",
    "Param",
    "ParamValue",
    "PressMethod",
    "PressRegistration",
    "PressRegistrationKeywords",
    "add_press",
    "budget_names",
    "budget_rule",
    "press_catalog",
    "press_method",
    "press_names",
    "press_table",
    "register_budget",
    "register_press",
    "unregister_budget",
    "unregister_press",
]
