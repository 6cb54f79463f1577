"""Lossy quantizers: ``int8``, ``int4`` (integer codes with 16-bit scales and zeros) and ``fp8``.

Integer codes follow the KIVI axes: **keys per channel** (each head and channel gets a scale and a
zero per group of ``G`` tokens) and **values per token** (each head and token gets a scale and a
zero per group of ``G`` channels). Codes are asymmetric, ``x ~ code * scale + zero`` with codes in
``0..255`` (int8) or ``0..15`` (int4). Scales and zeros are float16 (bfloat16 for a tensor whose
range float16 cannot hold), rounded outward (zero down, scale up) so that every code stays in range
and no element is off by more than half a step. A chunk that starts a context keeps its first
``SINK_TOKENS`` tokens unquantized, in the model's dtype (the attention sink; measured to halve the
first-step logit error at every bit width).

Stored tensors, for a key or value tensor ``NAME`` ``[kv_heads, n, head_dim]`` (``k`` sink tokens,
``m = n - k``):

============== ===== =============================================================================
``NAME.codes``  U8   int8: ``[H, m, D]``; int4: ``[H, m, D/2]``, channel ``j`` in the low nibble and
                     channel ``j + D/2`` in the high nibble of byte ``j``
``NAME.scales`` F16  keys: ``[H, ceil(m/G), D]`` (the last group may be partial: its own scale);
                     values: ``[H, m, D/G]`` (``G`` divides ``D``; a larger ``G`` is cut to ``D``)
``NAME.zeros``  F16  the shape of ``NAME.scales``
``NAME.sink``   any  ``[H, k, D]`` in the model's dtype (``k = 0`` past a context's first chunk)
============== ===== =============================================================================

A tensor whose tokens are not contiguous (a pressed cache's kept tokens, encoded with their
``positions``) keeps as its sink those of its first tokens that are among the context's first
``SINK_TOKENS`` (:func:`sink_count`).

``fp8`` stores e4m3 codes (``F8_E4M3``) of ``x / scale`` with one float16 scale per head and token
(``NAME.scales`` ``[H, n, 1]``, the row's largest magnitude over 448); it decodes through the
float16 bit pattern (exact for every finite code) because torch's own cast is not vectorized on CPU.

Specs: ``int8[:G]`` or ``int8:GK/GV`` (default ``128/64``: keys in groups of 128 tokens, values in
groups of 64 channels; measured smaller *and* closer to the lossless answers than 64/64),
``int4[:G]`` or ``int4:GK/GV`` (default ``32/64``, the measured best within 0.15x of float32), ``fp8``.
Decoding writes straight into the destination (a strided view of the batch buffers): a cast copy
of the codes, then one in-place multiply-add; destinations other than float32 go through a
per-thread float32 scratch and one cast (bfloat16 arithmetic is slow on CPU), so the result is the
float32 dequantization rounded once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import register_quantizer
from kvstore.store.codecs.records import StoredTensorBase, TensorRecord

# ``stage(source, device)``: a stored tensor (``copy_into``) or host tensor, as a tensor on ``device``
Stage = Callable[[Any, torch.device], torch.Tensor]

SINK_TOKENS = 4
Q = TypeVar("Q", bound="IntQuantizer")
PARTS = (".codes", ".scales", ".zeros", ".sink")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_F16_MAX = 65504.0

_local = threading.local()


def _scratch(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread reusable 1-D buffer of at least ``n`` elements."""
    buf = getattr(_local, name, None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: usable inside and outside inference mode
            buf = torch.empty(max(n, 1), dtype=dtype)
        setattr(_local, name, buf)
    return buf[:n]


def _round_outward(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, rounded towards +inf (``up``) or -inf."""
    r = x.to(dtype)
    wrong = (r.float() < x) if up else (r.float() > x)
    if bool(wrong.any()):
        r = torch.where(wrong, torch.nextafter(r, torch.full_like(r, math.inf if up else -math.inf)), r)
    return r


def _param_dtype(*tensors: torch.Tensor) -> torch.dtype:
    big = max((float(t.abs().amax()) for t in tensors if t.numel()), default=0.0)
    return torch.float16 if big < _F16_MAX / 2 else torch.bfloat16


def _rec(records: Mapping[str, TensorRecord], name: str) -> TensorRecord:
    rec = records.get(name)
    if rec is None:
        raise CorruptEntryError(f"entry lacks tensor {name}")
    return rec


def _view(rec: TensorRecord) -> torch.Tensor:
    """A record's values without a copy where its bytes are contiguous (1-byte codes always are)."""
    if rec.source is None:
        return rec.materialize()
    return rec.source.view(rec.dtype).view(rec.shape)


def _finite_params(name: str, scales: torch.Tensor, zeros: torch.Tensor | None) -> None:
    if scales.numel() and not bool(torch.isfinite(scales).all() & (scales > 0).all()):
        raise CorruptEntryError(f"tensor {name} has scales that are zero, negative or not finite")
    if zeros is not None and zeros.numel() and not bool(torch.isfinite(zeros).all()):
        raise CorruptEntryError(f"tensor {name} has zeros that are not finite")


def checked_sink(sink: TensorRecord, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The number of sink tokens ``sink`` holds for a tensor of ``shape`` ``[H, n, D]`` and ``dtype``
    (0 to ``SINK_TOKENS``). Raises CorruptEntryError when it does not fit."""
    heads, n, dim = shape
    k = sink.shape[1] if len(sink.shape) == 3 else -1
    if sink.shape != (heads, k, dim) or sink.dtype != dtype or not 0 <= k <= min(SINK_TOKENS, n):
        raise CorruptEntryError(
            f"tensor {sink.name} is {sink.shape} {sink.dtype}, expected [{heads}, <=4, {dim}] {dtype}"
        )
    return k


def sink_count(n: int, start: int = 0, positions: torch.Tensor | None = None) -> int:
    """How many leading tokens of an ``n``-token tensor stay unquantized: the context's first
    ``SINK_TOKENS`` tokens among them. Without ``positions`` the tensor covers ``start..start+n``;
    with them (ascending context positions), its tokens at positions below ``SINK_TOKENS``."""
    if positions is None:
        return min(SINK_TOKENS, n) if start == 0 else 0
    return int((positions[:SINK_TOKENS] < SINK_TOKENS).sum())


def value_group(group: int, head_dim: int, prefix: str = "") -> int:
    """The channels a value group spans: ``group``, or the whole head when it is wider; CodecError
    (its message after ``prefix``) when that does not divide ``head_dim``."""
    g = min(group, head_dim)
    if head_dim % g:
        raise CodecError(f"{prefix}a value group of {g} channels does not divide head_dim {head_dim}")
    return g


def sink_then_rest(reader: Any, dest: torch.Tensor, stage: Stage | None = None) -> torch.Tensor:
    """Check ``dest`` against ``reader``'s shape and dtype (ValueError), copy the reader's sink
    tokens into its first slots (through ``stage`` when given) and return the view of the rest,
    which the reader decodes its codes into."""
    if tuple(dest.shape) != reader.shape or dest.dtype != reader.dtype:
        got, want = f"{tuple(dest.shape)}/{dest.dtype}", f"{reader.shape}/{reader.dtype}"
        raise ValueError(f"{reader.name}: destination {got} != {want}")
    k = reader.sink.shape[1]
    if k and stage is not None:
        dest[:, :k].copy_(stage(reader.sink, dest.device))
    elif k:
        reader.sink.copy_into(dest[:, :k])
    return dest[:, k:]


class IntQuantizer:
    """``int8`` / ``int4``: asymmetric integer codes on the KIVI axes (see the module docstring)."""

    lossless = False

    def __init__(self, bits: int, group_k: int, group_v: int):
        self.bits, self.group_k, self.group_v = bits, group_k, group_v
        self.name = f"int{bits}"

    @property
    def spec(self) -> str:
        g = str(self.group_k) if self.group_k == self.group_v else f"{self.group_k}/{self.group_v}"
        return f"{self.name}:{g}"

    def params(self) -> dict:
        return {"name": self.name, "args": self.spec.partition(":")[2]}

    def stored_names(self, name: str) -> list[str]:
        return [name + p for p in PARTS]

    def bits_per_value(self, head_dim: int, dtype_bits: int, n_layers: int = 0) -> float:
        # a 16-bit scale and a 16-bit zero per group, keys grouped by tokens, values by channels
        return self.bits + 16.0 / self.group_k + 16.0 / min(self.group_v, head_dim)

    def _group(self, role: str, head_dim: int) -> int:
        if role == "keys":
            return self.group_k
        return value_group(self.group_v, head_dim, f"{self.spec}: ")

    # -- encoding -------------------------------------------------------------------------------
    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        x = tensor.detach().to("cpu")
        heads, n, dim = x.shape
        if self.bits == 4 and dim % 2:
            raise CodecError(f"{self.spec} needs an even head_dim, not {dim}")
        k = sink_count(n, start, positions)
        sink, x = x[:, :k].contiguous(), x[:, k:].float()
        g = self._group(role, dim)
        qmax = (1 << self.bits) - 1
        if role == "keys":  # per channel: groups of g tokens, the last one possibly partial
            groups = [x[:, i : i + g] for i in range(0, x.shape[1], g)]
            lo = torch.stack([t.amin(dim=1) for t in groups], 1) if groups else x.new_empty(heads, 0, dim)
            hi = torch.stack([t.amax(dim=1) for t in groups], 1) if groups else x.new_empty(heads, 0, dim)
        else:  # per token: groups of g channels
            grouped = x.unflatten(2, (dim // g, g))
            lo, hi = grouped.amin(dim=3), grouped.amax(dim=3)
        pdt = _param_dtype(lo, hi)
        zeros = _round_outward(lo, pdt, up=False)
        scales = _round_outward(torch.clamp((hi - zeros.float()) / qmax, min=1e-8), pdt, up=True)
        s, z = self._expand(role, scales.float(), zeros.float(), x.shape, g)
        q = x.sub(z).div_(s).round_().clamp_(0, qmax).to(torch.uint8)
        if self.bits == 4:
            half = dim // 2
            q = q[..., :half] | (q[..., half:] << 4)
        return [(".codes", q.contiguous()), (".scales", scales), (".zeros", zeros), (".sink", sink)]

    @staticmethod
    def _expand(role: str, s: torch.Tensor, z: torch.Tensor, shape, g: int):
        heads, m, dim = shape
        if role == "keys":
            return s.repeat_interleave(g, 1)[:, :m], z.repeat_interleave(g, 1)[:, :m]
        return s.repeat_interleave(g, 2), z.repeat_interleave(g, 2)

    # -- decoding -------------------------------------------------------------------------------
    def reader(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype,
        start: int = 0, positions: torch.Tensor | None = None,
    ) -> _IntReader:  # fmt: skip
        return _IntReader(self, role, name, shape, dtype, self.checked_parts(role, name, records, shape, dtype))

    def checked_parts(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype
    ) -> IntParts:
        """The parts (codes, scales, zeros, sink, group) of ``name``, each part checked against the
        ``shape`` and ``dtype`` the header declares (scales and zeros as float32, finite).
        Raises CorruptEntryError when they do not fit."""
        heads, n, dim = shape
        codes, scales, zeros, sink = (_rec(records, name + p) for p in PARTS)
        m = n - checked_sink(sink, shape, dtype)
        width = dim if self.bits == 8 else dim // 2
        if codes.shape != (heads, m, width) or codes.dtype != torch.uint8 or (self.bits == 4 and dim % 2):
            raise CorruptEntryError(
                f"tensor {codes.name} is {codes.shape} {codes.dtype}, expected ({heads}, {m}, {width}) uint8"
            )
        try:
            g = self._group(role, dim)
        except CodecError as exc:
            raise CorruptEntryError(str(exc)) from None
        want = (heads, -(-m // g), dim) if role == "keys" else (heads, m, dim // g)
        for rec in (scales, zeros):
            if rec.shape != want or rec.dtype not in (torch.float16, torch.bfloat16):
                raise CorruptEntryError(f"tensor {rec.name} is {rec.shape} {rec.dtype}, expected {want} float16")
        s, z = scales.materialize().float(), zeros.materialize().float()
        _finite_params(name, s, z)
        return IntParts(codes, s, z, sink, g)


@dataclass(frozen=True)
class IntParts:
    """The checked stored parts of one int8/int4 tensor (see :meth:`IntQuantizer.checked_parts`): its
    ``codes``, float32 ``scales`` and ``zeros``, ``sink`` and quantization ``group``."""

    codes: TensorRecord
    scales: torch.Tensor
    zeros: torch.Tensor
    sink: TensorRecord
    group: int


class _IntReader(StoredTensorBase):
    """Decodes one int8/int4 tensor into a destination buffer. ``device_decode``: with a ``stage``
    (see :meth:`copy_into`) it dequantizes where the destination is."""

    device_decode = True

    def __init__(self, q: IntQuantizer, role, name, shape, dtype, parts: IntParts):
        self.q, self.role, self.name = q, role, name
        self.shape, self.dtype = tuple(shape), dtype
        self.codes, self.scales, self.zeros, self.sink = parts.codes, parts.scales, parts.zeros, parts.sink
        self.group = parts.group

    def copy_into(self, dest: torch.Tensor, stage: Stage | None = None) -> None:
        """Dequantize into ``dest``. Without ``stage``: on the host (a non-CPU ``dest`` gets one
        copy of the float values). With ``stage`` (``stage(source, device)`` -> that stored or
        host tensor on ``device``, e.g. :meth:`kvstore.model.io.staging.Staging.upload`): the codes
        (uint8), scales, zeros and sink go to ``dest``'s device and the same arithmetic runs there,
        in fresh device tensors instead of the host's per-thread scratch."""
        d = sink_then_rest(self, dest, stage)
        scales, zeros = self.scales, self.zeros
        if stage is not None:
            codes, scales, zeros = (stage(t, d.device) for t in (self.codes, scales, zeros))
            work = d if d.dtype == torch.float32 else torch.empty(d.shape, dtype=torch.float32, device=d.device)
        elif d.dtype == torch.float32 and d.device.type == "cpu":
            codes, work = _view(self.codes), d
        else:  # bfloat16/float16 arithmetic is slow on CPU; other devices: decode on the host, copy once
            codes, work = _view(self.codes), _scratch("f32", d.numel(), torch.float32).view(d.shape)
        if self.q.bits == 8:
            work.copy_(codes)
        else:
            half = codes.shape[-1]
            nib = (
                _scratch("u8", codes.numel(), torch.uint8).view(codes.shape)
                if stage is None
                else torch.empty_like(codes)
            )
            torch.bitwise_and(codes, 15, out=nib)
            work[..., :half].copy_(nib)
            torch.bitwise_right_shift(codes, 4, out=nib)
            work[..., half:].copy_(nib)
        self._affine(work, scales, zeros)
        if work is not d:
            d.copy_(work)

    def _affine(self, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
        g = self.group
        if self.role == "values":  # scale constant along the inner group: mul_ + add_ (addcmul is slow here)
            wv = w.unflatten(2, (w.shape[2] // g, g))
            wv.mul_(s.unsqueeze(-1))
            wv.add_(z.unsqueeze(-1))
            return
        m = w.shape[1]
        full = (m // g) * g
        if full:
            wv = w[:, :full].unflatten(1, (m // g, g))
            torch.addcmul(z[:, : m // g].unsqueeze(2), wv, s[:, : m // g].unsqueeze(2), out=wv)
        if m > full:  # the partial last group has its own scale and zero
            torch.addcmul(z[:, -1:], w[:, full:], s[:, -1:], out=w[:, full:])

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out


class Fp8Quantizer:
    """``fp8``: float8 e4m3 codes of ``x / scale``, one float16 scale per head and token."""

    name = "fp8"
    spec = "fp8"
    lossless = False

    def params(self) -> dict:
        return {"name": "fp8", "args": ""}

    def stored_names(self, name: str) -> list[str]:
        return [name + ".codes", name + ".scales"]

    def bits_per_value(self, head_dim: int, dtype_bits: int, n_layers: int = 0) -> float:
        return 8.0 + 16.0 / head_dim  # one 16-bit scale per head and token

    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        x = tensor.detach().to("cpu").float()
        amax = x.abs().amax(dim=2, keepdim=True)
        pdt = _param_dtype(amax)
        scales = _round_outward(torch.clamp(amax / FP8_MAX, min=1e-8), pdt, up=True)
        codes = (x / scales.float()).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return [(".codes", codes.contiguous()), (".scales", scales)]

    def reader(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype,
        start: int = 0, positions: torch.Tensor | None = None,
    ) -> _Fp8Reader:  # fmt: skip
        codes, scales = _rec(records, name + ".codes"), _rec(records, name + ".scales")
        if codes.shape != tuple(shape) or codes.dtype != torch.float8_e4m3fn:
            raise CorruptEntryError(
                f"tensor {codes.name} is {codes.shape} {codes.dtype}, expected {shape} float8_e4m3fn"
            )
        want = (shape[0], shape[1], 1)
        if scales.shape != want or scales.dtype not in (torch.float16, torch.bfloat16):
            raise CorruptEntryError(f"tensor {scales.name} is {scales.shape} {scales.dtype}, expected {want} float16")
        s = scales.materialize().float()
        _finite_params(name, s, None)
        return _Fp8Reader(name, tuple(shape), dtype, codes, s)


class _Fp8Reader(StoredTensorBase):
    def __init__(self, name, shape, dtype, codes, scales):
        self.name, self.shape, self.dtype, self.codes, self.scales = name, shape, dtype, codes, scales

    def copy_into(self, dest: torch.Tensor) -> None:
        if tuple(dest.shape) != self.shape or dest.dtype != self.dtype:
            raise ValueError(f"{self.name}: destination {tuple(dest.shape)}/{dest.dtype} != {self.shape}/{self.dtype}")
        n = math.prod(self.shape)
        # e4m3 bits shifted into float16's layout are the same value times 2**-8 (subnormals too);
        # the exponent's top bit stays clear, so no code becomes an infinity.
        bits = _scratch("i16", n, torch.int16).view(self.shape)
        bits.copy_(_view(self.codes).view(torch.int8))
        bits.bitwise_left_shift_(7).bitwise_and_(-16385)  # 0xBFFF as int16
        half = bits.view(torch.float16)
        if dest.dtype == torch.float32 and dest.device.type == "cpu":
            dest.copy_(half)
            dest.mul_(self.scales * 256.0)
            return
        work = _scratch("f32", n, torch.float32).view(self.shape)
        work.copy_(half)
        work.mul_(self.scales * 256.0)
        dest.copy_(work)

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out


def _group_arg(text: str, name: str) -> int:
    try:
        g = int(text)
    except ValueError:
        raise CodecError(f"{name} group size must be a whole number, not {text!r}") from None
    if not 2 <= g <= 4096 or g & (g - 1):
        raise CodecError(f"{name} group size must be a power of two from 2 to 4096, not {g}")
    return g


def int_factory(cls: type[Q], name: str, bits: int, default_k: int, default_v: int) -> Callable[[str], Q]:
    """The spec factory of an integer quantizer class: ``NAME`` (the defaults), ``NAME:G`` (keys
    and values in groups of G) or ``NAME:GK/GV``."""

    def make(args: str) -> Q:
        if not args:
            return cls(bits, default_k, default_v)
        gk, sep, gv = args.partition("/")
        k = _group_arg(gk, name)
        return cls(bits, k, _group_arg(gv, name) if sep else k)

    return make


def _fp8(args: str) -> Fp8Quantizer:
    if args:
        raise CodecError("fp8 takes no arguments")
    return Fp8Quantizer()


register_quantizer("int8", int_factory(IntQuantizer, "int8", 8, 128, 64))
register_quantizer("int4", int_factory(IntQuantizer, "int4", 4, 32, 64))
register_quantizer("fp8", _fp8)

__all__ = [
    "FP8_MAX",
    "SINK_TOKENS",
    "Fp8Quantizer",
    "IntParts",
    "IntQuantizer",
    "checked_sink",
    "sink_count",
    "sink_then_rest",
    "value_group",
]
