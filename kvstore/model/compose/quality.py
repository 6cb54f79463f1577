"""The quality gate of the composition policies: how far a composed context moves the model from the
full prefill of the same ids (``kvstore quality --compose POLICY``).

For each passage row the composed ids (head, passages, :mod:`kvstore.model.compose.rows`) are
prefilled whole (the reference: what ``compose="full"`` and no cache answer over) and the model
answers the question greedily from that cache (``new_tokens`` tokens, no stop at EOS). Each policy
then assembles the row as a composed sample does (each distinct passage computed once per run at
positions ``0..n-1`` and placed at its offsets, the policy's recompute over them) and is measured as
:mod:`kvstore.quality` measures a codec, with its machinery:

* **next-token KL and top-1**: the reference answer teacher-forced from the policy's cache,
  ``KL(full || policy)`` of the next-token distributions (natural log, mean over steps and rows)
  and whether their top tokens agree;
* **answers**: the policy's own greedy answer: rows equal to the reference's over all
  ``new_tokens``, and the mean common prefix (tokens before the first difference / ``new_tokens``);
* **recomputed**: the share of the rows' passage tokens the policy computed again.

Nothing is stored. ``full`` is accepted and measures the reference against itself (0 by
construction: a check of the harness, not of a policy).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.model.compose.recompute import recompute
from kvstore.model.compose.rows import ComposedRow
from kvstore.model.compose.run import _Parts, assemble
from kvstore.model.compose.spec import Compose, parse_compose
from kvstore.quality import _forced, _greedy, _kl_top1


@dataclass(frozen=True)
class ComposeQuality:
    """One policy against the full prefill over ``rows`` rows (module docstring)."""

    compose: str
    rows: int
    new_tokens: int
    identical: int
    common_prefix: float
    kl: float
    top1: float
    recomputed: float  # share of passage tokens computed again
    answers: tuple[tuple[int, ...], ...] = ()  # each row's greedy answer (ids; not in the record)

    def record(self) -> dict:
        """A JSON-serialisable dict of every field."""
        return {
            "compose": self.compose, "rows": self.rows, "new_tokens": self.new_tokens, "identical": self.identical,
            "common_prefix": self.common_prefix, "kl": self.kl, "top1": self.top1, "recomputed": self.recomputed,
        }  # fmt: skip


def policy_layers(handle: Any, row: ComposedRow, policy: Compose, parts: _Parts, full: Any) -> tuple[Any, int]:
    """``(the row's keys and values under policy, tokens recomputed)``; ``full`` (the row's full
    prefill) is the answer for ``compose="full"``. Passages come from ``parts`` (computed once)."""
    if policy.exact:
        return full, len(row.ids) - len(row.head)
    layers, _ = assemble(handle, row, None, parts)
    return recompute(handle, row, layers, policy)


def compose_quality(
    adapter: Any, rows: Sequence[ComposedRow], questions: Sequence[Sequence[int]],
    policies: Sequence[Compose | str], *, new_tokens: int = 16, progress: Callable[[int], None] | None = None,
) -> list[ComposeQuality]:  # fmt: skip
    """Measure each of ``policies`` against the full prefill of each row's composed ids, the
    question ``questions[i]`` (ids, at least one) fed after row ``i`` (module docstring).
    ``progress`` is called with 1 per row and policy. ComposeError for a bad policy or a model whose
    passages cannot be placed."""
    chosen = [p for p in (parse_compose(s) for s in policies) if p is not None]
    handle = adapter.handle
    parts = _Parts()
    fields = ("same", "prefix", "kl", "top1", "redo", "answers")
    per: dict[str, dict[str, list]] = {p.name: {f: [] for f in fields} for p in chosen}
    passage_tokens = 0
    with torch.inference_mode():
        for row, follow in zip(rows, questions):
            passage_tokens += len(row.ids) - len(row.head)
            (full,) = adapter.prefill([list(row.ids)])
            full = [(k, v) for k, v in full]
            ref_answer, ref_dist = _greedy(adapter, full, follow, new_tokens)
            forced = list(follow) + ref_answer[:-1]
            start = len(follow) - 1
            for policy in chosen:
                acc = per[policy.name]
                layers, redone = policy_layers(handle, row, policy, parts, full)
                layers = [(k, v) for k, v in layers]
                kl, top1 = _kl_top1(ref_dist, _forced(adapter, layers, forced)[start:])
                answer, _ = _greedy(adapter, layers, follow, new_tokens)
                same = next((j for j, (a, b) in enumerate(zip(ref_answer, answer)) if a != b), new_tokens)
                for name, value in (("same", same == new_tokens), ("prefix", same / new_tokens), ("kl", kl),
                                    ("top1", top1), ("redo", redone), ("answers", tuple(answer))):  # fmt: skip
                    acc[name].append(value)
                if progress is not None:
                    progress(1)
    mean = statistics.mean
    return [
        ComposeQuality(
            compose=name,
            rows=len(acc["kl"]),
            new_tokens=new_tokens,
            identical=sum(acc["same"]),
            common_prefix=mean(acc["prefix"]) if acc["prefix"] else 0.0,
            kl=mean(acc["kl"]) if acc["kl"] else 0.0,
            top1=mean(acc["top1"]) if acc["top1"] else 0.0,
            recomputed=sum(acc["redo"]) / passage_tokens if passage_tokens else 0.0,
            answers=tuple(acc["answers"]),
        )  # fmt: skip
        for name, acc in per.items()
    ]


__all__ = ["ComposeQuality", "compose_quality", "policy_layers"]
