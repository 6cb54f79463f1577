"""4-D attention masks built from positions, not cache slots.

transformers applies a sliding window or an attention chunk to cache *slots* (``kv_idx > q_idx -
W`` in ``masking_utils``), which are positions only when a row has no padding. kvstore's batches
lay rows out with pads and holes (``[pad | context | pad | question | new]``), so for windowed and
hybrid models it builds the masks itself from a slot -> position table (``-1``: nothing there)
and passes them as 4-D tensors, which every model uses as given.

Rules, for a query at position ``q`` and a key at position ``k``: causal ``0 <= k <= q``; sliding
window ``W``: ``k > q - W``; attention chunk ``C``: ``k // C == q // C``. A pad query sees only its
own slot, so no row is ever fully masked (eager attention in float64 turns a fully masked row into
NaN, and ``0 * NaN`` then poisons real rows). SDPA takes a bool mask (True: attend); eager adds
the mask to its scores, so it gets ``0`` / the dtype's most negative number (a bool would add 1).
"""

from __future__ import annotations

import torch

from kvstore.facts import CHUNKED, SLIDING


def position_mask(
    kv_pos: torch.Tensor, q_pos: torch.Tensor, q_slot: int, group: str, dtype: torch.dtype, attn: str
) -> torch.Tensor:
    """The ``[b, 1, s, K]`` mask of ``s`` queries at slots ``q_slot .. q_slot + s - 1`` with
    positions ``q_pos`` ``[b, s]`` (``-1``: a pad) over keys at positions ``kv_pos`` ``[b, K]``
    (``-1``: empty). ``group``: ``attn``, ``sliding:W`` or ``chunked:C``. Bool for ``sdpa``,
    additive in ``dtype`` for ``eager``."""
    kp = kv_pos[:, None, :]
    qp = q_pos[:, :, None]
    ok = (kp >= 0) & (kp <= qp)
    kind, _, size = group.partition(":")
    if kind == SLIDING:
        ok &= kp > qp - int(size)
    elif kind == CHUNKED:
        ok &= torch.div(kp, int(size), rounding_mode="floor") == torch.div(qp, int(size), rounding_mode="floor")
    pad = q_pos < 0
    if bool(pad.any()):
        s = q_pos.shape[1]
        own = torch.zeros_like(ok)
        j = torch.arange(s, device=q_pos.device)
        own[:, j, q_slot + j] = pad
        ok = (ok & ~pad[:, :, None]) | own
    return attention_form(ok[:, None], dtype, attn)


def attention_form(ok: torch.Tensor, dtype: torch.dtype, attn: str) -> torch.Tensor:
    """A "may attend" bool mask as ``attn`` takes it: as is for sdpa (True: attend), additive in
    ``dtype`` for eager (``0`` / the dtype's most negative number)."""
    if attn == "eager":
        return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, torch.finfo(dtype).min)
    return ok


__all__ = ["attention_form", "position_mask"]
