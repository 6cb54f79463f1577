"""Grouped-query attention without copying the cache: SDPA's ``enable_gqa`` for kvstore's forwards.

With a mask (left-padded batches, a question on top of a stored context), transformers' SDPA path
repeats every key/value head to the number of query heads (``repeat_kv``) before calling
``scaled_dot_product_attention``: for SmolLM2 (3 KV heads, 9 query heads) that is a copy of three
times the whole cache in every layer of every question step. ``scaled_dot_product_attention`` can
take the grouped heads itself (``enable_gqa=True``); transformers only asks for that without a mask,
because some CUDA kernels do not support it with one.

:func:`grouped_kv` turns that on for the calling thread, on CPU tensors and multi-token steps with
a mask only (eager one-token steps already skip the copy: transformers packs the query heads).
Under ``torch.compile`` transformers does not pack and repeats the cache instead, so the hook also
turns ``enable_gqa`` on for every compiled CPU forward with a 4-D mask once it is installed (the
compiled decode steps of :mod:`kvstore.model.compute.static`; same arithmetic, without the copy). The
installed hook wraps transformers' ``use_gqa_in_sdpa``; it changes nothing else for other threads
or when transformers lacks the function.
On this machine (torch 2.13 CPU) the logits are bit-identical with and without it.

Nothing is patched at import: :class:`kvstore.model.handle.ModelHandle` calls :func:`install` when
it is made. The patch is process-wide, as transformers' function is, and stays (why, and the rest of
kvstore's process-wide state: :mod:`kvstore.process`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch

from kvstore.process import ATTENTION

P = ParamSpec("P")
R = TypeVar("R")

_state = threading.local()


def install() -> bool:
    """Install the hook (once per process: :data:`kvstore.process.ATTENTION`); False when this
    transformers has no ``use_gqa_in_sdpa``."""
    with ATTENTION.lock:
        if ATTENTION.installed:
            return True
        try:
            from transformers.integrations import sdpa_attention as sdpa
        except ImportError:  # pragma: no cover - other transformers layouts: nothing to do
            return False
        original = getattr(sdpa, "use_gqa_in_sdpa", None)
        if original is None:  # pragma: no cover
            return False
        sdpa.use_gqa_in_sdpa = _wrapped(original)
        ATTENTION.installed = True
        return True


def _wrapped(original: Callable) -> Callable:

    def use_gqa_in_sdpa(attention_mask, key, value, *args, **kwargs):
        if key.device.type == "cpu" and attention_mask is not None and attention_mask.dim() == 4:
            if torch.compiler.is_compiling():  # transformers repeats KV under compile (no pack_gqa)
                return True
            if getattr(_state, "on", False) and attention_mask.shape[-2] > 1:
                return True
        return original(attention_mask, key, value, *args, **kwargs)

    return use_gqa_in_sdpa


@contextlib.contextmanager
def grouped_kv(enabled: bool = True) -> Iterator[None]:
    """Within the block, this thread's SDPA forwards on CPU attend to grouped KV heads in place."""
    if not enabled or not ATTENTION.installed:
        yield
        return
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def uses_grouped_kv(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: run ``fn`` within :func:`grouped_kv`."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with grouped_kv():
            return fn(*args, **kwargs)

    return wrapper


__all__ = ["grouped_kv", "install", "uses_grouped_kv"]
