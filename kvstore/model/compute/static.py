"""Fixed-shape decode steps, optionally under ``torch.compile`` (``sample --compile``).

The eager decode loop (:func:`kvstore.model.compute.forward.greedy_loop`) attends to the filled prefix of
the preallocated buffers, so every step has a new key length: fine eagerly, a recompile per step
under ``torch.compile``. :class:`StaticSteps` keeps every shape of a step fixed instead:

* the KV buffers are allocated for a **bucket** of slots (``P + Q + N`` rounded up to
  :data:`SLOT_BUCKET`), zeroed past the prompt (masked slots must be finite);
* each step writes its new keys/values with ``index_copy_`` at a slot held in a 0-d tensor
  (:class:`FixedLayer`, a transformers ``StaticLayer`` over kvstore's own buffers) and attends to
  **all** slots through a 4-D mask ``[B, 1, 1, slots]`` (bool for sdpa, additive for eager
  attention), which the step updates in place;
* positions come explicitly from each row's context and question lengths, as in the eager loop.

A compiled step is compiled once per (batch size, slot bucket, dtype, device) and reused by every
later batch of that shape (``torch.compile(dynamic=False)``). The prompt (question) forward stays
eager: its length changes with every batch.

Masked slots get exactly zero weight, so a fixed-shape step computes the same attention as the eager
one; the floating-point order of the reductions may differ with the key length. The tests check
token identity with the eager loop and Hugging Face ``generate``; the benchmark reports it on the
bundled model.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, StaticLayer

from kvstore.model.compute import masks
from kvstore.model.compute.cache import Buffers

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle

SLOT_BUCKET = 256  # slots are allocated in multiples of this, so nearby lengths share one compiled step
RECOMPILE_LIMIT = 64  # compiled shapes per step function before torch.compile gives up (torch's default: 8)

_lock = threading.Lock()
_compiled: weakref.WeakKeyDictionary[torch.nn.Module, Callable[..., torch.Tensor]] = weakref.WeakKeyDictionary()


def bucket_slots(slots: int, fixed: bool) -> int:
    """Buffer slots for a decode that needs ``slots``: rounded up to a bucket for fixed-shape steps."""
    if not fixed:
        return slots
    return -(-slots // SLOT_BUCKET) * SLOT_BUCKET


class FixedLayer(StaticLayer):
    """A ``StaticLayer`` over existing ``[B, kv_heads, slots, head_dim]`` buffers whose first
    ``filled`` slots are already written."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int):
        super().__init__(keys.shape[2])
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.cumulative_length = torch.tensor(filled, dtype=torch.long, device=keys.device)
        self.is_initialized = True
        for t in (self.keys, self.values, self.cumulative_length):
            torch._dynamo.mark_static_address(t)  # written in place by the compiled step


class FixedCache(Cache):
    """A cache of :class:`FixedLayer` (one per model layer) over kvstore's buffers."""

    def __init__(self, buffers: Buffers, filled: int):
        Cache.__init__(self, layers=[FixedLayer(k, v, filled) for k, v in buffers])


def _step(model: torch.nn.Module, cache_arg: str, input_ids, mask, position_ids, cache) -> torch.Tensor:
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **{cache_arg: cache},
    )
    return out.logits[:, -1]


def step_function(handle: ModelHandle, compiled: bool) -> Callable[..., torch.Tensor]:
    """The model's fixed-shape step; compiled once per model (``torch.compile`` keeps a graph per
    shape underneath)."""
    cache_arg = handle.layout.cache_arg
    if not compiled:
        return lambda *args: _step(handle.model, cache_arg, *args)
    with _lock:
        fn = _compiled.get(handle.model)
        if fn is None:
            dynamo = torch._dynamo.config
            if getattr(dynamo, "recompile_limit", RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
                dynamo.recompile_limit = RECOMPILE_LIMIT
            model = handle.model
            fn = torch.compile(lambda *args: _step(model, cache_arg, *args), dynamic=False)
            _compiled[handle.model] = fn
    return fn


class StaticSteps:
    """The ``step`` callback of :func:`kvstore.model.compute.forward.greedy_loop` with fixed shapes.

    ``buffers``: the batch's KV buffers, prompt written in slots ``[0, first_slot)``; ``mask``:
    the eager loop's ``[B, slots]`` attention mask (1 on real prompt slots); ``next_pos``: each
    row's position of generated token 0."""

    def __init__(self, handle: ModelHandle, buffers: Buffers, mask: torch.Tensor, first_slot: int,
                 next_pos: torch.Tensor, compiled: bool):  # fmt: skip
        slots = buffers[0][0].shape[2]
        for k, v in buffers:  # unwritten slots: finite (0 * NaN would poison the masked sum)
            k[:, :, first_slot:].zero_()
            v[:, :, first_slot:].zero_()
        self.cache = FixedCache(buffers, first_slot)
        B = mask.shape[0]
        attend = torch.zeros((B, 1, 1, slots), dtype=torch.bool, device=mask.device)
        attend[:, 0, 0, :first_slot] = mask[:, :first_slot].bool()
        attn = handle.attn_implementation
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"fixed-shape decoding needs sdpa or eager attention, not {attn}")
        self.mask = masks.attention_form(attend, buffers[0][0].dtype, attn)
        self.open = True if attn == "sdpa" else 0.0  # a slot's value once it may be attended to
        self.first_slot = first_slot
        self.next_pos = next_pos
        self.fn = step_function(handle, compiled)

    def __call__(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Run generated token ``t`` of each row (slot ``first_slot + t``); the next logits."""
        self.mask[:, 0, 0, self.first_slot + t] = self.open
        return self.fn(tokens[:, None], self.mask, (self.next_pos + t)[:, None], self.cache)


__all__ = ["FixedCache", "FixedLayer", "SLOT_BUCKET", "StaticSteps", "bucket_slots", "step_function"]
