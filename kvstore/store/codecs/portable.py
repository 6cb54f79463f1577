"""Arithmetic whose bits do not depend on the CPU, the BLAS, the thread count or the device.

A stored lossy entry must decode to the same values wherever it is read (and a fresh encoding give
the same bytes), or a golden file pinned on one machine fails on another and one stored entry means
two things. Element-wise ``+ - * /``, ``round`` and casts are correctly rounded IEEE operations: the
same bits on every x86-64 and arm64 CPU and on a GPU, as long as each is its own torch operation (no
fused multiply-add: torch runs ``a * b + c`` as two kernels). What is *not* portable: matrix
products (the BLAS kernel picks the summation order and may fuse), ``torch.addcmul`` when the
product is inexact (AVX2/AVX-512 kernels fuse it, the baseline one does not), reductions (their
order follows the vector width and the threads) and transcendental functions (``cos``/``sin`` are
SLEEF's or the C library's, accurate to about an ulp, not correctly rounded). This module gives the
codecs fixed-order replacements: :func:`fixed_sum` / :func:`fixed_mean` (a pairwise tree of
element-wise adds) and :func:`cos_sin` (argument reduction and fdlibm's kernel polynomials in
element-wise float64 operations). docs/lossy-codecs.md ("Portable decodes") lists what each codec
uses.
"""

from __future__ import annotations

import torch

# pi/2 in three pieces of 33 bits (fdlibm's pio2_1, pio2_2, pio2_3): k * piece is exact for |k| < 2**20
_PIO2 = (1.57079632673412561417e00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)
_TWO_OVER_PI = 6.36619772367581382433e-01
# fdlibm's __kernel_sin / __kernel_cos minimax coefficients on [-pi/4, pi/4]
_S = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
      2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)  # fmt: skip
_C = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
      -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)  # fmt: skip


def _horner(z: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """``c0 + z * (c1 + z * (...))``, one element-wise operation at a time."""
    acc = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * z + c
    return acc


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``angles`` (float64, any shape and device), within about an ulp of the
    true values for ``|angle| < 1.6e6`` (beyond, the reduction by pi/2 loses digits, still the same
    everywhere), computed only by element-wise float64 operations in a fixed order: the same bits on
    any CPU or device. Raises ValueError for another dtype."""
    if angles.dtype != torch.float64:
        raise ValueError(f"cos_sin takes float64 angles, not {angles.dtype}")
    k = torch.round(angles * _TWO_OVER_PI)
    r = angles - k * _PIO2[0]
    r = r - k * _PIO2[1]
    r = r - k * _PIO2[2]
    z = r * r
    sin_r = r + (z * r) * _horner(z, _S)
    hz = z * 0.5
    w = 1.0 - hz
    cos_r = w + (((1.0 - w) - hz) + (z * z) * _horner(z, _C))
    quadrant = torch.remainder(k, 4.0)
    swap = (quadrant == 1) | (quadrant == 3)
    cos = torch.where(swap, sin_r, cos_r)
    sin = torch.where(swap, cos_r, sin_r)
    cos = torch.where((quadrant == 1) | (quadrant == 2), -cos, cos)
    sin = torch.where(quadrant >= 2, -sin, sin)
    return cos, sin


def fixed_sum(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The sum of ``x`` over ``dims`` (kept as size 1), as a pairwise tree of element-wise adds in
    ``x``'s dtype: the elements (in row-major order over ``dims``, zero-padded to a power of two) are
    halved and the halves added, until one is left. Unlike ``torch.sum`` the order does not follow
    the vector width or the threads."""
    dims = tuple(sorted(d % x.dim() for d in dims))
    rest = [d for d in range(x.dim()) if d not in dims]
    shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
    flat = x.permute(*rest, *dims).reshape(*[x.shape[d] for d in rest], -1)
    n = flat.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        flat = torch.nn.functional.pad(flat, (0, width - n))
    while flat.shape[-1] > 1:
        half = flat.shape[-1] // 2
        flat = flat[..., :half] + flat[..., half:]
    return flat.reshape(shape)


def fixed_mean(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """:func:`fixed_sum` divided by the number of elements summed (kept dims of size 1)."""
    count = 1
    for d in dims:
        count *= x.shape[d]
    return fixed_sum(x, dims) / max(count, 1)


__all__ = ["cos_sin", "fixed_mean", "fixed_sum"]
