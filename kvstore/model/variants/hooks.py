"""Generation contexts: hooks that are active only while questions are answered.

A **generation context** is a callable taking the model and returning a context manager
(``Callable[[model], ContextManager]``), e.g. one that patches a layer, scales attention or adds
noise. :meth:`kvstore.model.adapter.Adapter.greedy_sample` enters it around the question forward
and the decode steps of each batch, and only there: every context is loaded from the store, or
computed and handed to the store's writer, *before* the hook is entered, so a hook never sees a
prefill and cannot change what is stored or under which key. The reference without a cache
(``use_cache=False``) splits the same way when a hook is given: the contexts are prefilled densely
outside it, question and answer run inside, so cached and no-cache answers agree under any hook.

Decode-time attention (:mod:`kvstore.model.variants.sparse`) is a generation context too:
:func:`attention_context` registers an attention function with transformers'
``AttentionInterface`` (and a mask function with ``AttentionMaskInterface``, so the function gets
a 4-D bool mask) and switches ``model.config._attn_implementation`` to it for the duration, so
anything that takes a generation context takes a decode-attention variant.

A :class:`Variant` names a generation context (or None: plain decoding) for sweeps and for error
messages; :func:`running` enters one and turns an exception raised under it into a one-line
:class:`~kvstore.errors.HookError` naming it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import HookError, KVStoreError, ModelError
from kvstore.model.compute.forward import is_out_of_memory
from kvstore.model.variants import sparse

GenerationContext = Callable[[torch.nn.Module], AbstractContextManager[Any]]
ATTN_PREFIX = "kvstore-"  # registered attention implementations are named kvstore-<spec>
DENSE_ATTN_ATTR = "_kvstore_dense_attn"  # on the model while a variant is active: its own implementation

_lock = threading.Lock()


@dataclass(frozen=True)
class Variant:
    """One way to answer: ``name`` (``dense``, ``topk:16``, a hook's name) and its generation
    context (None: the model as loaded)."""

    name: str
    context: GenerationContext | None = None

    @property
    def dense(self) -> bool:
        return self.context is None


DENSE = Variant(sparse.DENSE)


def _mask_function(*args: Any, **kwargs: Any) -> Any:
    """The mask transformers builds for a kvstore attention implementation: SDPA's bool mask,
    always materialized (never None for "plain causal"), so a function sees every pad."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register(name: str, fn: sparse.AttentionFunction) -> str:
    """Register ``fn`` as attention implementation ``name`` (with kvstore's mask function);
    returns ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _lock:
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, _mask_function)
    return name


def attention_context(spec_or_fn: str | sparse.AttentionFunction) -> GenerationContext:
    """A generation context that runs the model with the decode-time attention ``spec_or_fn``: a
    spec (``topk:K``, ``sparq:R:K``, ``module:function``; see :func:`kvstore.model.variants.sparse.parse`)
    or an attention function with transformers' interface. ``dense`` gives a context that
    changes nothing. Raises HookError for a bad spec (at once, not when entered)."""
    if isinstance(spec_or_fn, str):
        fn = sparse.parse(spec_or_fn)
        label = spec_or_fn.strip()
    else:
        fn = spec_or_fn
        label = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    if fn is None:
        return lambda model: contextlib.nullcontext()
    name = ATTN_PREFIX + label.replace(" ", "")

    @contextlib.contextmanager
    def switched(model: torch.nn.Module) -> Iterator[None]:
        register(name, fn)  # on entry: another function may have taken the name since (two lambdas)
        config: Any = model.config
        before = config._attn_implementation
        had = hasattr(model, DENSE_ATTN_ATTR)
        if not had:  # the model's own implementation, for whoever reads it meanwhile (keys, numerics)
            setattr(model, DENSE_ATTN_ATTR, before)
        config._attn_implementation = name
        try:
            yield
        finally:
            config._attn_implementation = before
            if not had:
                delattr(model, DENSE_ATTN_ATTR)

    switched.__qualname__ = f"decode attention {label}"
    return switched


def dense_attn_implementation(model: torch.nn.Module) -> str | None:
    """The model's own attention implementation while a decode-attention variant is active
    (None otherwise)."""
    return getattr(model, DENSE_ATTN_ATTR, None)


def variant(item: str | Variant | sparse.AttentionFunction | None) -> Variant:
    """A :class:`Variant` from a decode-attention spec (``dense``, ``topk:K``, ...), an attention
    function, a Variant, or None (dense)."""
    if item is None:
        return DENSE
    if isinstance(item, Variant):
        return item
    if isinstance(item, str):
        spec = item.strip()
        return DENSE if spec == sparse.DENSE else Variant(spec, attention_context(spec))
    if callable(item):
        ctx = attention_context(item)
        return Variant(getattr(ctx, "__qualname__", repr(item)).removeprefix("decode attention "), ctx)
    raise HookError(f"{item!r} is not a decode-attention spec, attention function or Variant")


def variants(items: Sequence[str | Variant | sparse.AttentionFunction | None]) -> list[Variant]:
    """:func:`variant` of each item; HookError when two share a name (rows are told apart by it)."""
    out = [variant(x) for x in items]
    names = [v.name for v in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HookError(f"variants named twice: {', '.join(dup)}")
    if not out:
        raise HookError("no variant to run")
    return out


def hook_variant(generation_context: GenerationContext | None, decode_attention: Any = None) -> Variant:
    """The single variant of ``greedy_sample(generation_context=..., decode_attention=...)``:
    either, both (the generation context outermost), or neither (dense)."""
    att = variant(decode_attention)
    if generation_context is None:
        return att
    name = getattr(generation_context, "__qualname__", None) or type(generation_context).__name__
    if att.context is None:
        return Variant(name, generation_context)
    inner = att.context

    @contextlib.contextmanager
    def both(model: torch.nn.Module) -> Iterator[None]:
        with generation_context(model), inner(model):
            yield

    return Variant(f"{name}+{att.name}", both)


def check_steps(chosen: Sequence[Variant], steps: str) -> None:
    """HookError (one line) when a variant with a generation context would run fixed-shape or
    compiled decode steps (``steps`` other than ``dynamic``): hooks run eager steps only."""
    hooked = [v.name for v in chosen if not v.dense]
    if hooked and steps != "dynamic":
        raise HookError(
            f"generation contexts and decode attention ({', '.join(hooked)}) run eager decode steps; drop compile / "
            "--compile"
        )


def check_model(adapter: Any, needed: bool) -> None:
    """ModelError (one line) when generation contexts, decode attention or a variant sweep
    (``needed``) would run on a model with sliding-window, chunked or state layers: they are for
    models whose every layer is full attention."""
    if needed and not adapter.path.supports("hooks"):
        raise ModelError(
            f"{adapter.name} ({adapter.model.config.model_type}): generation contexts, decode attention and variant "
            "sweeps need a model whose every layer is full attention; this one has sliding-window, chunked or state "
            "layers"
        )


@contextlib.contextmanager
def running(v: Variant, model: torch.nn.Module) -> Iterator[None]:
    """Enter ``v``'s generation context on ``model`` (nothing for a dense variant). An exception
    raised while entering, inside or while leaving becomes a HookError naming ``v``; kvstore's
    own errors and out-of-memory errors (which the caller retries in halves) pass unchanged."""
    if v.context is None:
        yield
        return
    try:
        with v.context(model):
            yield
    except HookError as exc:
        if v.name in str(exc):
            raise
        raise HookError(f"generation context {v.name!r}: {exc}") from exc
    except KVStoreError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            raise
        msg = str(exc).splitlines()[0] if str(exc) else ""
        raise HookError(
            f"generation context {v.name!r} failed: {type(exc).__name__}: {msg} (run without it to check the rest; "
            "KVSTORE_DEBUG=1 shows the traceback)"
        ) from exc


__all__ = [
    "ATTN_PREFIX",
    "DENSE",
    "GenerationContext",
    "Variant",
    "attention_context",
    "check_steps",
    "dense_attn_implementation",
    "hook_variant",
    "register",
    "running",
    "variant",
    "variants",
]
