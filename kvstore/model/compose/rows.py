"""Rows whose contexts are passages, tokenized: the head, each passage's ids, the question.

Every passage is tokenized alone (its text and :data:`~kvstore.model.compose.spec.SEPARATOR`, no
special tokens), the head as a shared prefix (with the special tokens the prompt or caller asks
for: a BOS where the model uses one), so the composed ids are the same whichever way the row is
answered: from prefix chains, without a cache, or composed from stored passages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import ComposeError, ContextTooLongError
from kvstore.model.compose.spec import SEPARATOR, passages_of
from kvstore.model.handle import row_label
from kvstore.model.io.chains import Keying

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.handle import ModelHandle


@dataclass(frozen=True)
class ComposedRow:
    """One row's composed context: ``head`` ids, then each passage's ids, in the row's order."""

    head: tuple[int, ...]
    passages: tuple[tuple[int, ...], ...]

    @property
    def ids(self) -> tuple[int, ...]:
        return self.head + tuple(t for p in self.passages for t in p)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each passage starts in the composed context."""
        out, at = [], len(self.head)
        for p in self.passages:
            out.append(at)
            at += len(p)
        return tuple(out)


@dataclass(frozen=True)
class Composed:
    """A run's passage rows: each row's composition, the composed ids as contexts (what the
    exact paths answer over), the questions' texts and how the composed ids are keyed (their
    shared head as a prefix)."""

    rows: tuple[ComposedRow, ...]
    contexts: tuple[tuple[int, ...], ...]
    questions: tuple[Any, ...] | None
    keying: Keying


def compose_inputs(
    handle: ModelHandle, prompt: PromptFormat | None, contexts: Sequence[Any], questions: Sequence[Any] | None,
    keying: Keying, labels: Sequence[str] | None = None,
) -> Composed | None:  # fmt: skip
    """The rows' compositions when their contexts are passages (None when they are not):
    ``prompt`` gives the head, special tokens and question parts (else ``keying``: its prefix is
    the head). ComposeError for passage rows mixed with others or a prompt together with
    ``keying``'s special tokens or prefix; ContextTooLongError for a composed context over the
    model's limit."""
    passages = passages_of(contexts)
    if passages is None:
        return None
    special, head_text = keying.special_tokens, keying.prefix
    asked = None if questions is None else tuple(questions)
    if prompt is not None:
        if keying.prefix is not None or not keying.special_tokens:
            raise ComposeError("give prompt= or special_tokens=/prefix=, not both: the prompt format sets them")
        special, head_text = prompt.add_special_tokens, prompt.head or None
        asked = None if questions is None else tuple(prompt.question_part(q) for q in questions)
    head = tuple(
        handle.prefix_ids(head_text, special) if head_text else handle.encode_context("", special_tokens=special)
    )
    memo: dict[str, tuple[int, ...]] = {}
    rows = tuple(ComposedRow(head, tuple(_passage_ids(handle, t, memo) for t in p.texts)) for p in passages)
    limit = handle.context_limit()
    for i, row in enumerate(rows):
        if limit is not None and len(row.ids) > limit:
            raise ContextTooLongError(
                f"{row_label(labels, i)}: composed context has {len(row.ids)} tokens but at most {limit} fit; "
                "give fewer or shorter passages"
            )
    return Composed(rows, tuple(r.ids for r in rows), asked, Keying(special, list(head) if head else None))


def _passage_ids(handle: ModelHandle, text: str, memo: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    if text not in memo:
        memo[text] = tuple(handle.encode_context(text + SEPARATOR, special_tokens=False))
    return memo[text]


__all__ = ["Composed", "ComposedRow", "compose_inputs"]
