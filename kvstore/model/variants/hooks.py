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

A :class:`~kvstore.model.variants.variant.Variant` names what a sweep's answer runs under;
:func:`running` enters its generation context and decode attention and turns an exception raised
under them into a one-line :class:`~kvstore.errors.HookError` naming it. :func:`switched` is the
one place an attention implementation is switched (decode attention, and the presses' query
capture, :mod:`kvstore.model.press.window`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from kvstore.errors import HookError, KVStoreError
from kvstore.model.compute.forward import is_out_of_memory
from kvstore.model.handle import DENSE_ATTN_ATTR
from kvstore.model.variants import sparse
from kvstore.model.variants.variant import Attention, GenerationContext, Variant

ATTN_PREFIX = "kvstore-"  # registered attention implementations are named kvstore-<spec>

_lock = threading.Lock()


def _mask_function(*args: Any, **kwargs: Any) -> Any:
    """The mask transformers builds for a kvstore attention implementation: SDPA's bool mask,
    always materialized (never None for "plain causal"), so a function sees every pad."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register(name: str, fn: sparse.AttentionFunction, mask_function: Any = None) -> str:
    """Register ``fn`` as attention implementation ``name`` with ``mask_function`` (default:
    kvstore's bool mask); returns ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _lock:
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, mask_function or _mask_function)
    return name


@contextlib.contextmanager
def switched(
    model: torch.nn.Module, name: str, fn: sparse.AttentionFunction, mask_function: Any = None
) -> Iterator[None]:
    """Within the block, ``model`` attends with ``fn`` (registered as attention implementation
    ``name``, with ``mask_function`` or kvstore's bool mask). The model's own implementation stays
    readable meanwhile (:func:`kvstore.model.handle.dense_attn_implementation`: keys and numerics
    always name it); blocks nest."""
    register(name, fn, mask_function)  # on entry: another function may have taken the name since (two lambdas)
    config: Any = model.config
    before = config._attn_implementation
    had = hasattr(model, DENSE_ATTN_ATTR)
    if not had:
        setattr(model, DENSE_ATTN_ATTR, before)
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
        if not had:
            delattr(model, DENSE_ATTN_ATTR)


def attention_context(attention: Attention) -> GenerationContext:
    """A generation context that runs the model with the decode-time attention ``attention``."""
    name = ATTN_PREFIX + attention.name

    def context(model: torch.nn.Module) -> AbstractContextManager[None]:
        return switched(model, name, attention.function)

    context.__qualname__ = f"decode attention {attention.name}"
    return context


def check_steps(chosen: Sequence[Variant], steps: str) -> None:
    """HookError (one line) when a variant with a generation context would run fixed-shape or
    compiled decode steps (``steps`` other than ``dynamic``): hooks run eager steps only."""
    hooked = [v.name for v in chosen if not v.dense]
    if hooked and steps != "dynamic":
        raise HookError(
            f"generation contexts, decode attention and presses ({', '.join(hooked)}) run eager decode steps; drop "
            "compile / --compile"
        )


@contextlib.contextmanager
def running(v: Variant, model: torch.nn.Module) -> Iterator[None]:
    """Enter ``v``'s generation context, then its decode attention, on ``model`` (nothing for a
    variant without either). An exception raised while entering, inside or while leaving becomes a
    HookError naming ``v``; kvstore's own errors and out-of-memory errors (which the caller retries
    in halves) pass unchanged."""
    if not v.hooked:
        yield
        return
    try:
        with contextlib.ExitStack() as stack:
            if v.context is not None:
                stack.enter_context(v.context(model))
            if v.decode_attention is not None:
                stack.enter_context(attention_context(v.decode_attention)(model))
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


__all__ = ["ATTN_PREFIX", "attention_context", "check_steps", "register", "running", "switched"]
