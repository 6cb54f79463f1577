"""From a press to the tokens each layer and KV head keeps: scores, then the budget's cut.

:func:`row_scores` gives one row's scores per layer (``[kv_heads, c]``, higher is kept) under a
press: its scorer (:mod:`kvstore.model.press.scorers`, :mod:`kvstore.model.press.kvzip`) on the
row's cached keys and values, after the forward it reads (an observation window, a re-run of the
context, a replay; :func:`kvstore.model.press.window.run_on_row`), or the question's queries with
``:q``. :func:`kept_masks` applies the press's budget: its record in the registry
(:mod:`kvstore.model.press.registry`) holds the ``keep`` function (the built-ins':
:mod:`kvstore.model.press.budgets`). A ratio of 0 keeps every token under every budget (the dense
cache, bit for bit).

A :class:`PressMemo` holds what one batch's presses share: the observation windows' queries (one
forward per distinct context and window size), each scorer's scores per context (every ratio and
budget of a method selects from the same scores), the scoring tokens run by kind
(:class:`~kvstore.model.press.spec.ScoringTokens`), and a
:class:`ScoreSource` of stored scores (issue: scores computed once and stored).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvstore.errors import PressError
from kvstore.model.compute.cache import BatchCache
from kvstore.model.press.scorers import LayerInputs, RowContext, check_scores, record_shapes
from kvstore.model.press.spec import Press, ScoringTokens
from kvstore.model.press.window import run_on_row

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

LayerKV = Sequence[tuple[torch.Tensor, torch.Tensor]]
# per row, per layer: the question's (queries [heads, q, d], keys [kv_heads, q, d]) for a question-aware press
Observations = Callable[[int], Sequence[tuple[torch.Tensor, torch.Tensor]]]


class ScoreSource(Protocol):
    """Stored scores: :meth:`lookup` a row's scores under a press (None: not stored, or unusable),
    :meth:`save` scores just computed (a no-op where nothing is stored)."""

    def lookup(
        self, press: Press, ids: Sequence[int], shapes: Sequence[tuple[int, int]]
    ) -> list[torch.Tensor] | None: ...

    def save(self, press: Press, ids: Sequence[int], scores: Sequence[torch.Tensor], force: bool = False) -> None: ...


@dataclass
class PressMemo:
    """What one batch's presses share (see the module docstring). ``tokens``: context tokens the
    scoring forwards ran, by kind (not prefill)."""

    windows: dict[tuple, dict[int, torch.Tensor]] = field(default_factory=dict)
    scores: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)
    tokens: ScoringTokens = ScoringTokens()
    stored: ScoreSource | None = None

    def count(self, kind: str, n: int) -> None:
        self.tokens = self.tokens.plus(kind, n)

    def window(self, handle: ModelHandle, layers: LayerKV, ids: tuple[int, ...], size: int) -> dict[int, torch.Tensor]:
        """Per layer ``[heads, w, d]`` queries of the context's last ``w = min(size, c - 1)`` tokens
        (none for a one-token context)."""
        key = (ids, size)
        if key not in self.windows:
            c = len(ids)
            w = min(size, c - 1)
            got: dict[int, torch.Tensor] = {}

            def keep(layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, module) -> None:
                got[layer] = queries.detach().clone()

            if w >= 1:
                self.count("window", run_on_row(handle, layers, ids[c - w :], c - w, keep))
            self.windows[key] = got
        return self.windows[key]


def _row_layers(cache: BatchCache, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    a, b = cache.spans[row]
    if b - a != cache.lengths[row] or cache.heads is not None:
        raise ValueError("a press scores a row's whole context (press the dense cache)")
    return [(kb[row, :, a:b], vb[row, :, a:b]) for kb, vb in cache.bufs]


def row_scores(
    handle: ModelHandle, cache: BatchCache, press: Press, row: int, memo: PressMemo,
    observe: Observations | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Per layer, ``[kv_heads, c]`` scores of row ``row``'s context under ``press`` (see the module
    docstring); ``observe(row)`` gives the question's queries of a question-aware press. PressError
    (one line) when a registered scorer returns scores of the wrong shape."""
    layers = _row_layers(cache, row)
    ids = cache.ids[row]
    shapes = record_shapes(layers)
    shared = observe is None
    key = (press.scorer_key(), ids)
    if shared and key in memo.scores:
        return memo.scores[key]
    if shared and memo.stored is not None:
        got = memo.stored.lookup(press, ids, shapes)
        if got is not None:
            memo.scores[key] = got
            return got
    record = press.record
    scorer = record.load_scorer()
    out: list[torch.Tensor]
    if record.reads in ("context", "replay"):

        def runner(run_ids: Sequence[int], start: int, on_layer, kind: str) -> None:
            memo.count(kind, run_on_row(handle, layers, run_ids, start, on_layer))

        out = list(scorer(RowContext(press, ids, layers, runner, handle)))
    else:
        per_layer: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]]
        if observe is not None:
            per_layer = [(q, k) for q, k in observe(row)]
        elif record.reads == "window":
            queries = memo.window(handle, layers, ids, press.window)
            per_layer = [(queries.get(i), None) for i in range(len(layers))]
        else:
            per_layer = [(None, None)] * len(layers)
        out = []
        for i, ((k, v), (q, qk)) in enumerate(zip(layers, per_layer)):
            if record.reads == "window" and q is None:  # a one-token context: nothing observes it
                out.append(torch.zeros(k.shape[:-1], dtype=k.dtype, device=k.device))
            else:
                out.append(scorer(LayerInputs(press, i, k, v, q, qk)))
    check_scores(press, out, shapes)
    if shared:
        memo.scores[key] = out
        if memo.stored is not None:
            memo.stored.save(press, ids, out)
    return out


def kept_masks(press: Press, scores: Sequence[torch.Tensor], c: int) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, c]`` bool: the tokens each head keeps under ``press``'s budget (its
    registry record's ``keep``: :mod:`kvstore.model.press.budgets`)."""
    if press.ratio == 0 or c == 0:
        return [torch.ones(s.shape, dtype=torch.bool, device=s.device) for s in scores]
    masks = press.rule.load_keep()(press, scores, c)
    if len(masks) != len(scores) or any(m.shape != s.shape or m.dtype != torch.bool for m, s in zip(masks, scores)):
        raise PressError(f"budget {press.budget}: keep must return one bool mask per layer, shaped as its scores")
    return list(masks)


def kept_positions(
    handle: ModelHandle, cache: BatchCache, press: Press, row: int, memo: PressMemo
) -> list[list[torch.Tensor]]:
    """Per layer, per KV head: the context positions (int64, ascending) row ``row`` keeps."""
    masks = kept_masks(press, row_scores(handle, cache, press, row, memo), cache.lengths[row])
    return [[m[h].nonzero().flatten() for h in range(m.shape[0])] for m in masks]


__all__ = ["Observations", "PressMemo", "ScoreSource", "kept_masks", "kept_positions", "row_scores"]
