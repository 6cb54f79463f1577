"""Host bytes the accelerator copies from or into, shared by the staging ring (loads) and the
writer's offload buffers (computed chunks): uint8, pinned on CUDA (a pageable copy crosses PCIe at
a fraction of the rate, issue 39), a whole number of :data:`ALIGN`-byte blocks."""

from __future__ import annotations

import torch

ALIGN = 64  # bytes: every tensor's place in a buffer starts at a multiple of this (any dtype's view, vectorized copies)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of :data:`ALIGN`-byte blocks."""
    return -(-nbytes // ALIGN) * ALIGN


def host_bytes(nbytes: int, pinned: bool) -> torch.Tensor:
    """An uninitialized uint8 host buffer of at least ``nbytes`` (:func:`aligned`), page-locked when
    ``pinned`` (CUDA only: pinning needs a CUDA context)."""
    return torch.empty(aligned(nbytes), dtype=torch.uint8, pin_memory=pinned)


__all__ = ["ALIGN", "aligned", "host_bytes"]
