"""Integer codes of any width from 2 to 8 bits, for :mod:`.asym` (``kvh``): the bit planes they are
stored in, and the element-wise steps that make and read them.

Codes of ``B`` bits are stored as bit planes of 4, 2 and 1 bits (``B`` written in binary: 6 = 4 + 2,
5 = 4 + 1, 3 = 2 + 1; 8 is one byte per code). A plane of ``w`` bits packs ``p = 8 / w`` channels
per byte, byte ``j`` holding channels ``j, j + D/p, j + 2D/p ...`` from the low bits up (the 4-bit
plane is ``int4``'s nibble layout); the planes hold the code's bits from the low end and lie one
after another along the last axis: ``[H, m, B * D / 8]`` bytes. Reading them is integer shifts and
masks, then one cast: exact, the same on any CPU or device.
"""

from __future__ import annotations

import torch

from kvstore.errors import CodecError
from kvstore.store.codecs.quant import IntQuantizer, _param_dtype, _round_outward, _scratch


def planes(bits: int) -> tuple[int, ...]:
    """The bit planes ``bits``-bit codes are stored in, low bits first: 8 -> (8,), 6 -> (4, 2),
    5 -> (4, 1), 3 -> (2, 1)."""
    if bits == 8:
        return (8,)
    return tuple(w for w in (4, 2, 1) if bits & w)


def check_dim(bits: int, dim: int) -> None:
    """Raise CodecError unless ``dim`` channels split into the bytes of every plane of ``bits``."""
    for w in planes(bits):
        if dim % (8 // w):
            raise CodecError(f"{bits}-bit codes need a head_dim divisible by {8 // w}, not {dim}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8 ``[H, m, D]``, each below ``2 ** bits``) as the planes of :func:`planes`
    (uint8 ``[H, m, bits * D / 8]``, see the module docstring). Raises CodecError when ``D`` does not
    split into a plane's bytes."""
    dim = codes.shape[-1]
    check_dim(bits, dim)
    out, shift = [], 0
    for w in planes(bits):
        per = 8 // w
        field = (codes >> shift) & ((1 << w) - 1) if w < 8 else codes
        n = dim // per
        byte = field[..., :n].clone()
        for i in range(1, per):
            byte |= field[..., i * n : (i + 1) * n] << (i * w)
        out.append(byte)
        shift += w
    return torch.cat(out, -1).contiguous()


def unpack_into(packed: torch.Tensor, bits: int, work: torch.Tensor, stage_on: torch.device | None) -> None:
    """The codes of ``packed`` (see :func:`pack`) into ``work`` (float ``[H, m, D]``, exact: codes
    are small integers). Integer shifts and masks only. ``stage_on``: a device, whose fresh tensors
    replace the host's per-thread scratch."""
    dim = work.shape[-1]
    if bits == 8:
        work.copy_(packed)
        return
    ws = planes(bits)
    acc = None
    if len(ws) > 1:  # the code is assembled in uint8, then cast once
        shape = (*packed.shape[:-1], dim)
        acc = (
            _scratch("kvh_acc", work.numel(), torch.uint8).view(shape)
            if stage_on is None
            else torch.empty(shape, dtype=torch.uint8, device=stage_on)
        )
    tmp = _scratch("u8", packed.numel() * 8 // bits, torch.uint8) if stage_on is None else None
    off, shift = 0, 0
    for w in ws:
        per = 8 // w
        n = dim // per
        plane = packed[..., off : off + n]
        field = tmp[: plane.numel()].view(plane.shape) if tmp is not None else torch.empty_like(plane)
        for i in range(per):
            torch.bitwise_right_shift(plane, i * w, out=field)
            if i < per - 1:
                field.bitwise_and_((1 << w) - 1)
            if acc is None:
                work[..., i * n : (i + 1) * n].copy_(field)
            elif shift == 0:
                acc[..., i * n : (i + 1) * n].copy_(field)
            else:
                acc[..., i * n : (i + 1) * n].bitwise_or_(field.bitwise_left_shift_(shift))
        off, shift = off + n, shift + w
    if acc is not None:
        work.copy_(acc)


def affine(role: str, group: int, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
    """``w = w * scale + zero`` by group, in place: ``int4``'s element-wise steps (keys per channel in
    groups of ``group`` tokens, the last partial; values per token in groups of ``group`` channels)."""
    if role == "values":
        wv = w.unflatten(2, (w.shape[2] // group, group))
        wv.mul_(s.unsqueeze(-1))
        wv.add_(z.unsqueeze(-1))
        return
    m = w.shape[1]
    full = (m // group) * group
    if full:
        wv = w[:, :full].unflatten(1, (m // group, group))
        torch.addcmul(z[:, : m // group].unsqueeze(2), wv, s[:, : m // group].unsqueeze(2), out=wv)
    if m > full:
        torch.addcmul(z[:, -1:], w[:, full:], s[:, -1:], out=w[:, full:])


def levels(role: str, x: torch.Tensor, g: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``int8``'s/``int4``'s asymmetric codes of ``x`` (float32 ``[H, m, D]``) in ``0..qmax``, one per
    byte, with their scales and zeros (16-bit, rounded outward so that every code stays in range)."""
    heads, m, dim = x.shape
    if role == "keys":
        groups = [x[:, i : i + g] for i in range(0, m, g)]
        lo = torch.stack([t.amin(dim=1) for t in groups], 1) if groups else x.new_empty(heads, 0, dim)
        hi = torch.stack([t.amax(dim=1) for t in groups], 1) if groups else x.new_empty(heads, 0, dim)
    else:
        grouped = x.unflatten(2, (dim // g, g))
        lo, hi = grouped.amin(dim=3), grouped.amax(dim=3)
    pdt = _param_dtype(lo, hi)
    zeros = _round_outward(lo, pdt, up=False)
    scales = _round_outward(torch.clamp((hi - zeros.float()) / qmax, min=1e-8), pdt, up=True)
    s, z = IntQuantizer._expand(role, scales.float(), zeros.float(), x.shape, g)
    codes = x.sub(z).div_(s).round_().clamp_(0, qmax).to(torch.uint8)
    return codes.contiguous(), scales, zeros


__all__ = ["affine", "check_dim", "levels", "pack", "planes", "unpack_into"]
