"""Variants: one way to answer from a batch's loaded contexts, as a typed value parsed once.

A :class:`Variant` is named by its spec and holds what it changes:

* ``press`` (:class:`kvstore.model.press.spec.Press`): which context tokens are kept before the
  question is answered (``snapkv:0.5``);
* ``decode_attention`` (:class:`Attention`): the attention function the question and answer steps
  run under (``topk:64``, ``sparq:16:64``, a ``module:function`` plug-in);
* ``context``: any other generation context (``model -> context manager``), entered around the
  question forward and the decode steps.

A spec is ``dense``, a decode-attention spec, a press spec, or a press and a decode attention
joined by ``+``, press first (``snapkv:0.5+sparq:16:64``); :func:`parse_variant` reads it once (at
the CLI or API edge) and everything below takes the :class:`Variant`. Its :attr:`Variant.name` is
the canonical spec, the key of a sweep's results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import HookError, PressError
from kvstore.model.press.spec import Press, is_press_spec, parse_press
from kvstore.model.variants import sparse

GenerationContext = Callable[[torch.nn.Module], AbstractContextManager[Any]]
DENSE_NAME = sparse.DENSE_NAME


@dataclass(frozen=True)
class Attention:
    """A decode-time attention function and its name (the spec, or the plug-in's dotted name)."""

    name: str
    function: sparse.AttentionFunction


def parse_attention(item: str | sparse.AttentionFunction | Attention | None) -> Attention | None:
    """An :class:`Attention` from a spec (``topk:K``, ``sparq:R:K``, ``module:function``), an
    attention function or an Attention; None for ``dense`` or None (the model's own). HookError
    (one line) for a bad spec."""
    if item is None or isinstance(item, Attention):
        return item
    if isinstance(item, str):
        spec = item.strip()
        fn = sparse.parse(spec)
        return None if fn is None else Attention(spec.replace(" ", ""), fn)
    if callable(item):
        name = f"{getattr(item, '__module__', '')}.{getattr(item, '__qualname__', type(item).__name__)}"
        return Attention(name, item)
    raise HookError(f"{item!r} is not a decode-attention spec or attention function")


@dataclass(frozen=True)
class Variant:
    """One way to answer: ``name`` (``dense``, ``topk:16``, ``snapkv:0.5``, a hook's name) and what
    it changes: a generation ``context`` (None: the model as loaded), a ``press`` and a
    ``decode_attention``. ``Variant(name, context)`` is the hook form; :func:`parse_variant` and
    :func:`make_variant` build the others."""

    name: str
    context: GenerationContext | None = None
    press: Press | None = None
    decode_attention: Attention | None = None

    @property
    def dense(self) -> bool:
        """Answers as the model does on the whole context (no hook, no press)."""
        return self.context is None and self.press is None and self.decode_attention is None

    @property
    def hooked(self) -> bool:
        """Runs its question forward and decode steps under a generation context."""
        return self.context is not None or self.decode_attention is not None


DENSE = Variant(DENSE_NAME)


def make_variant(
    press: Press | None = None, decode_attention: Attention | None = None, context: GenerationContext | None = None
) -> Variant:
    """The variant of a press, a decode attention and a generation context (any of them None),
    named ``press+context+attention`` (``dense`` when all are None)."""
    parts = []
    if press is not None:
        parts.append(press.name)
    if context is not None:
        parts.append(getattr(context, "__qualname__", None) or type(context).__name__)
    if decode_attention is not None:
        parts.append(decode_attention.name)
    if not parts:
        return DENSE
    return Variant("+".join(parts), context, press, decode_attention)


def parse_variant(item: str | Variant | Press | sparse.AttentionFunction | None) -> Variant:
    """A :class:`Variant` from a spec (see the module docstring), a Press, an attention function,
    a Variant, or None (dense). HookError / PressError (one line) for a bad spec."""
    if item is None:
        return DENSE
    if isinstance(item, Variant):
        return item
    if isinstance(item, Press):
        return make_variant(press=item)
    if isinstance(item, str):
        spec = item.strip()  # "dense" is the attention parser's word: parse_attention gives None for it
        head, plus, tail = spec.partition("+")
        if is_press_spec(head):
            if plus and head.endswith(":") and tail[:1] and tail[0] in "0123456789.":  # snapkv:+0.5: a signed ratio
                raise PressError(
                    f"variant {spec!r}: a ratio is written without a sign ('+' joins a press and a decode "
                    "attention: snapkv:0.5+topk:64)"
                )
            return make_variant(press=parse_press(head), decode_attention=parse_attention(tail) if plus else None)
        if plus:
            raise HookError(
                f"variant {spec!r}: only a press may come before '+' (PRESS+ATTENTION, e.g. snapkv:0.5+topk:64)"
            )
        if not sparse.is_attention_spec(spec):  # neither: say both, the press parser's list included
            try:
                parse_press(spec)
            except PressError as exc:
                raise PressError(
                    f"variant {spec!r} is neither a decode attention (dense, topk:K, sparq:R:K, module:function) "
                    f"nor a press: {exc}"
                ) from None
        return make_variant(decode_attention=parse_attention(spec))
    if callable(item):
        return make_variant(decode_attention=parse_attention(item))
    raise HookError(f"{item!r} is not a variant spec, press, attention function or Variant")


def variants(items: Sequence[str | Variant | Press | sparse.AttentionFunction | None]) -> list[Variant]:
    """:func:`parse_variant` of each item; HookError when none is given or two share a name (a
    sweep's results are told apart by it)."""
    out = [parse_variant(x) for x in items]
    names = [v.name for v in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HookError(f"variants named twice: {', '.join(dup)}")
    if not out:
        raise HookError("no variant to run")
    return out


__all__ = [
    "DENSE",
    "Attention",
    "GenerationContext",
    "Variant",
    "make_variant",
    "parse_attention",
    "parse_variant",
    "variants",
]
