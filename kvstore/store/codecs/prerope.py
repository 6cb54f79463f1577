"""Rotation-aware integer quantizers: ``int4r`` and ``int8r`` (keys quantized before their rotary
embedding).

A rotary model (Llama, GPT-NeoX...) stores keys *after* rotating each channel pair ``(j, j + R/2)``
of the first ``R`` channels by the angle ``position * inv_freq[j]``. Before that rotation a channel
keeps the same scale and offset from token to token (a few channels carry large, steady
magnitudes); after it, every channel pair swings between ``+a`` and ``-a`` along the tokens, so a
per-channel scale over a group of tokens has to cover the whole swing. These quantizers undo the
rotation (float64), quantize the pre-rotation keys per channel exactly like ``int8``/``int4`` do
(:mod:`kvstore.store.codecs.quant`), and redo the rotation after decoding. Values are quantized as
``int8``/``int4`` quantize them (per token, groups of channels): they are never rotated.

The rotation only has to be the same one at encode and decode time (the pair ``un-rotate,
re-rotate`` is the identity up to rounding whatever the angles); matching the model's own angles is
what makes the pre-rotation channels steady, i.e. what makes the codes small. The angles come from
the model's inverse frequencies (``Rotary``), recorded in every entry's header (``codec.quant.rotary``)
so decoding needs no model; a chunk's token ``t`` is at context position ``start + t`` (entries of
full-attention layers, the only ones lossy codecs store). A pressed cache's kept tokens are not
contiguous: encoded with their ``positions``, each token is un-rotated at its own position (and the
reader, given the same positions, rotates it back there).

Error bound: the pre-rotation values are within half a step of their codes (as for ``int4``); a
rotation is orthonormal, so an output element ``a cos - b sin`` is off by at most
``(|cos| + |sin|) * step / 2 <= sqrt(2) * step / 2``, where ``step`` is the larger of the pair's two
channel steps; plus one rounding to the model's dtype (and float32 rotation arithmetic for float32
and 16-bit models: float64 models are decoded in float64).

Stored tensors: those of ``int8``/``int4`` (``NAME.codes``, ``.scales``, ``.zeros``, ``.sink``); for
keys the codes, scales and zeros describe the pre-rotation values, the sink (a context's first
tokens) holds the keys as the model made them.

Specs: ``int4r[:G]`` or ``int4r:GK/GV`` (default ``32/32``: the best measured on SmolLM2's long
contexts; with ``+zstd:1`` it stores 0.150x float32, ``experiments/results/quant_prerope_groups.json``)
and ``int8r[:G]`` / ``int8r:GK/GV`` (default ``128/64``, as ``int8``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import Codec, register_quantizer
from kvstore.store.codecs.portable import cos_sin
from kvstore.store.codecs.quant import (
    PARTS,
    IntParts,
    IntQuantizer,
    _scratch,
    _view,
    int_factory,
    sink_count,
    sink_then_rest,
)
from kvstore.store.codecs.records import StoredTensorBase, TensorRecord

LAYOUTS = ("half",)  # channel j pairs with j + R/2 (transformers' rotate_half); the only one handled


@dataclass(frozen=True)
class Rotary:
    """A model's rotary embedding as kvstore undoes it: ``inv_freq`` (``R/2`` inverse frequencies,
    the model's own float32 values as Python floats) rotate channel pairs ``(j, j + R/2)`` of the
    first ``R = 2 * len(inv_freq)`` channels of each head by ``position * inv_freq[j]``; channels
    from ``R`` on are not rotated (partial rotary, e.g. GPT-NeoX's ``rotary_pct``)."""

    inv_freq: tuple[float, ...]
    layout: str = "half"

    @property
    def dim(self) -> int:
        return 2 * len(self.inv_freq)

    def record(self) -> dict:
        return {"inv_freq": list(self.inv_freq), "layout": self.layout}

    @classmethod
    def from_record(cls, rec: object) -> Rotary:
        """Parse a header's ``rotary`` record. Raises CorruptEntryError."""
        if not isinstance(rec, Mapping):
            raise CorruptEntryError("entry header has no rotary parameters for its pre-rotation codec")
        freqs, layout = rec.get("inv_freq"), rec.get("layout")
        if (
            not isinstance(freqs, list)
            or not 1 <= len(freqs) <= 4096
            or not all(isinstance(f, float) and math.isfinite(f) and f >= 0 for f in freqs)
            or layout not in LAYOUTS
        ):
            raise CorruptEntryError("entry header has malformed rotary parameters")
        return cls(tuple(freqs), layout)


def need_rotary(rotary: Rotary | None, spec: str, error: type[Exception], head_dim: int) -> Rotary:
    """``rotary``, or ``error`` saying that codec ``spec`` needs the model's rotary parameters or
    that they rotate more channels than a head of ``head_dim`` has."""
    if rotary is None:
        raise error(
            f"{spec} quantizes keys before their rotary embedding and needs the model's rotary parameters "
            "(entries built by an Adapter carry them; kvstore.store.convert takes rotary=)"
        )
    if rotary.dim > head_dim:
        raise error(f"{spec}: the rotary dimension {rotary.dim} exceeds head_dim {head_dim}")
    return rotary


@lru_cache(maxsize=64)
def _angles(inv_freq: tuple[float, ...], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[n, R/2]`` float64 of positions ``start..start+n-1``. The angles are
    float32 products, as transformers computes them (so the pre-rotation keys are the model's own
    to within its float32 ``cos``/``sin``); their cosines and sines are float64, so that rotating
    back is exact to float64 rounding, and computed by :func:`~kvstore.store.codecs.portable.cos_sin`
    (element-wise operations in a fixed order), so that they are the same on every CPU and device."""
    pos = torch.arange(start, start + n, dtype=torch.float64).float()
    ang = (pos[:, None] * torch.tensor(inv_freq, dtype=torch.float32)[None, :]).double()
    return cos_sin(ang)


def _angles_at(inv_freq: tuple[float, ...], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_angles` of any positions (int64 ``[n]``): the same float32 products, so that a token
    gets the angles it would get in a contiguous chunk."""
    pos = positions.detach().to("cpu", torch.float64).float()
    ang = (pos[:, None] * torch.tensor(inv_freq, dtype=torch.float32)[None, :]).double()
    return cos_sin(ang)


def rotate(
    x: torch.Tensor, rotary: Rotary, start: int, *, inverse: bool = False, out: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
):  # fmt: skip
    """Keys ``x`` ``[heads, n, head_dim]`` of positions ``start..`` (or of ``positions``, int64
    ``[n]``, when given) rotated as the model rotates them (``inverse``: un-rotated), computed in
    ``x``'s dtype (pass float64 for an exact inverse) into ``out`` (default a new tensor; may be
    ``x`` itself or a view of another dtype)."""
    r, h = rotary.dim, rotary.dim // 2
    if r > x.shape[-1]:
        raise CodecError(f"rotary dimension {r} exceeds head_dim {x.shape[-1]}")
    angles = (
        _angles(rotary.inv_freq, start, x.shape[1]) if positions is None else _angles_at(rotary.inv_freq, positions)
    )
    cos, sin = (t.to(device=x.device, dtype=x.dtype) for t in angles)
    if inverse:
        sin = -sin
    a, b = x[..., :h], x[..., h:r]
    new_a = a * cos - b * sin
    new_b = b * cos + a * sin
    if out is None:
        out = torch.empty_like(x)
    if out is not x and r < x.shape[-1]:
        out[..., r:].copy_(x[..., r:])
    out[..., :h].copy_(new_a)
    out[..., h:r].copy_(new_b)
    return out


class PreRopeQuantizer(IntQuantizer):
    """``int4r`` / ``int8r``: ``int4``/``int8`` with keys quantized before their rotary embedding
    (see the module docstring). ``rotary`` is bound at encode time (from the entry) or read from
    an entry header at decode time."""

    def __init__(self, bits: int, group_k: int, group_v: int, rotary: Rotary | None = None):
        super().__init__(bits, group_k, group_v)
        self.name = f"int{bits}r"
        self.rotary = rotary

    def with_rotary(self, rotary: Rotary | None) -> PreRopeQuantizer:
        return PreRopeQuantizer(self.bits, self.group_k, self.group_v, rotary)

    def params(self) -> dict:
        out = super().params()
        if self.rotary is not None:
            out["rotary"] = self.rotary.record()
        return out

    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        if role != "keys":
            return super().encode(role, tensor, start, positions)
        x = tensor.detach().to("cpu")
        heads, n, dim = x.shape
        rotary = need_rotary(self.rotary, self.spec, CodecError, dim)
        k = sink_count(n, start, positions)
        sink = x[:, :k].contiguous()
        rest = None if positions is None else positions[k:]
        pre = rotate(x[:, k:].double(), rotary, start + k, inverse=True, positions=rest).float()
        # the same per-channel codes int4/int8 store, of the pre-rotation values (start > 0: no sink)
        parts = dict(super().encode(role, pre, start=max(start, 1) if positions is None else 1))
        parts[".sink"] = sink
        return [(p, parts[p]) for p in PARTS]

    def reader(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype,
        start: int = 0, positions: torch.Tensor | None = None,
    ):  # fmt: skip
        if role != "keys":
            return super().reader(role, name, records, shape, dtype)
        rotary = need_rotary(self.rotary, self.spec, CorruptEntryError, shape[2])
        parts = self.checked_parts(role, name, records, shape, dtype)
        return _PreRopeReader(self, rotary, name, tuple(shape), dtype, parts, where=(start, positions))


class _PreRopeReader(StoredTensorBase):
    """Decodes one pre-rotation key tensor into a destination buffer: codes -> float32 (float64
    for a float64 model) -> rotated -> destination."""

    def __init__(self, q: PreRopeQuantizer, rotary: Rotary, name, shape, dtype, parts: IntParts, where):
        self.q, self.rotary, self.name = q, rotary, name
        self.shape, self.dtype = shape, dtype
        self.codes, self.scales, self.zeros, self.sink = parts.codes, parts.scales, parts.zeros, parts.sink
        self.start, self.positions = where  # the first token's position, or every token's

    def copy_into(self, dest: torch.Tensor) -> None:
        d = sink_then_rest(self, dest)
        k = self.sink.shape[1]
        heads, m, dim = d.shape
        wdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        work = _scratch("pre_f64" if wdt == torch.float64 else "pre_f32", d.numel(), wdt).view(d.shape)
        codes = _view(self.codes)
        if self.q.bits == 8:
            work.copy_(codes)
        else:
            half = codes.shape[-1]
            nib = _scratch("pre_u8", codes.numel(), torch.uint8).view(codes.shape)
            torch.bitwise_and(codes, 15, out=nib)
            work[..., :half].copy_(nib)
            torch.bitwise_right_shift(codes, 4, out=nib)
            work[..., half:].copy_(nib)
        g = self.q.group_k
        s, z = self.scales.to(wdt), self.zeros.to(wdt)
        full = (m // g) * g
        if full:
            wv = work[:, :full].unflatten(1, (m // g, g))
            torch.addcmul(z[:, : m // g].unsqueeze(2), wv, s[:, : m // g].unsqueeze(2), out=wv)
        if m > full:
            torch.addcmul(z[:, -1:], work[:, full:], s[:, -1:], out=work[:, full:])
        rest = None if self.positions is None else self.positions[k:]
        rotated = rotate(work, self.rotary, self.start + k, positions=rest)
        d.copy_(rotated)

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out


def with_rotary(codec: Codec, rotary: Rotary | None) -> Codec:
    """``codec`` with ``rotary`` bound to its quantizer when that quantizer needs one (else as is)."""
    bind = getattr(codec.quantizer, "with_rotary", None)
    if bind is not None and rotary is not None:
        return dataclasses.replace(codec, quantizer=bind(rotary))
    return codec


def needs_rotary(codec: Codec) -> bool:
    """Whether ``codec`` quantizes keys before their rotary embedding (and so needs a rotary model):
    its quantizer binds one (``with_rotary``: ``int4r``, ``int8r``, ``ecq``)."""
    return callable(getattr(codec.quantizer, "with_rotary", None))


def _factory(bits: int, default_k: int, default_v: int) -> Callable[[str], PreRopeQuantizer]:
    return int_factory(PreRopeQuantizer, f"int{bits}r", bits, default_k, default_v)


def _from_params(bits: int, default_k: int, default_v: int):
    make = _factory(bits, default_k, default_v)

    def from_params(params: Mapping) -> PreRopeQuantizer:
        q = make(str(params.get("args", "")))
        return q.with_rotary(Rotary.from_record(params.get("rotary")))

    return from_params


register_quantizer("int4r", _factory(4, 32, 32), from_params=_from_params(4, 32, 32), since=3)
register_quantizer("int8r", _factory(8, 128, 64), from_params=_from_params(8, 128, 64), since=3)

__all__ = ["PreRopeQuantizer", "Rotary", "need_rotary", "needs_rotary", "rotate", "with_rotary"]
