"""What a composed context is made of, and how much of it is recomputed: values, no torch.

A row whose context is a :class:`Passages` (a dataset field holding a list of strings) has the
composed context ``head + passage_1 + ... + passage_k``: the prompt's head (its shared prefix, a
chain as for any context), then each passage's tokens (its text, then :data:`SEPARATOR`, tokenized
alone without special tokens), in the row's order. Every path (no cache, the exact prefix chains,
a composition) answers over exactly these token ids, so ``compose="full"`` equals the no-cache
answer.

A :class:`Compose` policy says what a composition recomputes over the passages loaded at their
offsets (:func:`parse_compose` reads ``full``, ``none``, ``last:N``, ``blend:R``):

* ``full``: everything (the exact answer: the reference, no stored passage is read);
* ``none``: nothing (each passage attends only to itself: approximate);
* ``last:N``: the composed context's last ``N`` tokens, over the loaded rest (approximate);
* ``blend:R``: the share ``R`` of passage tokens whose keys and values differ most from their
  recomputed values at an early layer, through every layer (CacheBlend's selection; approximate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import ComposeError

SEPARATOR = "\n\n"  # appended to each passage's text before it is tokenized (alone)
POLICIES = ("full", "none", "last:N", "blend:R")
BLEND_LAYER = 1  # the early layer whose deviations pick the tokens blend:R recomputes


@dataclass(frozen=True)
class Passages:
    """A context given as passages, composed in this order after the prompt's head (each passage
    stored once, placeable at any offset: :mod:`kvstore.model.compose`)."""

    texts: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "texts", tuple(self.texts))
        if not self.texts or not all(isinstance(t, str) and t.strip() for t in self.texts):
            raise ComposeError("passages must be a non-empty list of non-empty strings")

    def joined(self) -> str:
        """The passages as one text (for display; the composed ids are each passage's own)."""
        return "".join(t + SEPARATOR for t in self.texts)


@dataclass(frozen=True)
class Compose:
    """A composition policy: ``kind`` (``full``, ``none``, ``last``, ``blend``), the tokens
    ``last`` recomputes, the share ``blend`` recomputes."""

    kind: str
    tokens: int = 0
    ratio: float = 0.0

    @property
    def name(self) -> str:
        """The canonical spec (what each result row records)."""
        if self.kind == "last":
            return f"last:{self.tokens}"
        if self.kind == "blend":
            return f"blend:{self.ratio:g}"
        return self.kind

    @property
    def exact(self) -> bool:
        """Whether the answers are the no-cache answers (``full`` only)."""
        return self.kind == "full"


def parse_compose(spec: Compose | str | None) -> Compose | None:
    """The :class:`Compose` of ``spec`` (``full``, ``none``, ``last:N`` with ``N >= 1``,
    ``blend:R`` with ``0 <= R <= 1``), a Compose as is, or None. ComposeError (one line naming
    the policies) for anything else."""
    if spec is None or isinstance(spec, Compose):
        return spec
    text = str(spec).strip()
    kind, _, arg = text.partition(":")
    bad = ComposeError(f"compose policy {text!r}: use one of {', '.join(POLICIES)} (last:64, blend:0.15)")
    if kind in ("full", "none") and not arg:
        return Compose(kind)
    try:
        if kind == "last":
            n = int(arg)
            if n >= 1:
                return Compose("last", tokens=n)
        elif kind == "blend":
            r = float(arg)
            if 0.0 <= r <= 1.0:
                return Compose("blend", ratio=r)
    except ValueError:
        pass
    raise bad


def passages_of(contexts: Sequence[object]) -> list[Passages] | None:
    """The rows' passages when every context is one (a :class:`Passages`, or a list or tuple of
    strings), None when none is; ComposeError when some are and some are not."""
    found = [_as_passages(c) for c in contexts]
    if all(p is None for p in found):
        return None
    if any(p is None for p in found):
        raise ComposeError("some contexts are passage lists and some are not: compose all rows or none")
    return [p for p in found if p is not None]


def _as_passages(context: object) -> Passages | None:
    if isinstance(context, Passages):
        return context
    if isinstance(context, (list, tuple)) and context and all(isinstance(t, str) for t in context):
        return Passages(tuple(context))
    return None


__all__ = ["BLEND_LAYER", "POLICIES", "SEPARATOR", "Compose", "Passages", "parse_compose", "passages_of"]
