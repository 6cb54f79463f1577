"""``kvh``: keys and values with bit widths of their own, exact sinks, an 8-bit tail.

The quality gate showed where ``int4h``'s damage comes from on the bundled model: keys at 4 bits
carry most of it, and once keys get 8 bits the 4-bit values are what is left (docs/lossy-codecs.md).
``kvh`` gives each its own width and grouping in one short spec:

* **keys**: ``KB``-bit codes per channel in groups of ``GK`` tokens (the KIVI axes, as ``int8``);
* **values**: ``VB``-bit codes per token in groups of ``GV`` channels;
* a role below 8 bits is Hadamard-rotated first (``int4h``'s butterfly, :mod:`.hadamard`), which
  spreads a loud channel's range over the head; at 8 bits the codes are ``int8``'s, not rotated
  (the rotation buys nothing measurable there and would cost a decode pass);
* **sinks**: a context's first ``S`` tokens stored as the model made them (``int4h``'s fixed 4,
  generalised);
* **tail**: each stored chunk's last ``T`` tokens (after its sinks) in ``int8``'s codes (keys per
  channel in groups of 128 tokens, values per token in groups of 64 channels), not rotated. A
  chunk's encoder sees that chunk only, not whether the context goes on, so the rule is per chunk:
  every stored chunk keeps its own last ``T`` tokens at 8 bits, including a chunk that a longer
  context later extends (its tail stays 8-bit, and the extension's chunk has a tail of its own).
  With the store's 512-token chunks, ``t=64`` is an eighth of each chunk at 8 bits, which the
  byte counts (``kvstore quality``) include.

Codes of ``B`` bits (2 to 8) are stored as bit planes of 4, 2 and 1 bits (``B`` written in binary:
6 = 4 + 2, 5 = 4 + 1, 3 = 2 + 1; 8 one byte per code): a plane of ``w`` bits packs ``8 / w``
channels per byte, byte ``j`` holding channels ``j, j + D/p, j + 2D/p ...`` (``p = 8 / w``) from the
low bits up (the 4-bit plane is ``int4``'s nibble layout); the planes hold the code's bits from the
low end and lie one after another along the last axis: ``NAME.codes`` ``[H, m, B * D / 8]``.
``head_dim`` must be a multiple of ``8 / w`` for every plane (8 when a 1-bit plane is needed).

Decodes are portable: integer shifts and masks, one cast, the affine step of ``int4``/``int8``
(element-wise, in float32; float64 for float64 models), and for rotated roles the fixed-order
butterfly: the same bits on any CPU, BLAS, thread count, and on a device (the staging ring's
dequantization runs the same steps where the destination is).

Stored tensors for a key or value tensor ``NAME`` ``[H, n, D]`` (``k`` sink tokens, ``t`` tail
tokens, ``m = n - k - t``): ``NAME.codes``/``.scales``/``.zeros`` (the body, as above; scales and
zeros as ``int4``'s: float16, bfloat16 for a range float16 cannot hold), ``NAME.sink`` ``[H, k, D]``
in the model's dtype, and when ``T > 0`` ``NAME.tail.codes``/``.tail.scales``/``.tail.zeros``
(``int8``'s). Entry format 7: a kvstore that reads up to format 6 refuses a ``kvh`` chunk instead of
taking it for corrupt.

Specs: ``kvh[:KB/VB][:GK/GV][:s=S][:t=T]``, e.g. ``kvh:8/4`` (the default), ``kvh:8/5``,
``kvh:5/3:64/32``, ``kvh:8/4:s=16:t=64``. Default groups: keys 128 tokens at 8 bits (``int8``'s),
32 below (``int4h``'s); values 32 channels at 4 bits and below (half ``int4h``'s 64: finer steps for
the values, which are what is left once keys have 8 bits), 64 above. ``S`` defaults to 4 (as every
other lossy codec), ``T`` to 0; at most 4096 each. Packing ``zstd:1`` unless the spec names one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import register_quantizer
from kvstore.store.codecs.hadamard import _norm, butterfly, hadamard_block, rotate
from kvstore.store.codecs.quant import (
    IntQuantizer,
    Stage,
    _finite_params,
    _param_dtype,
    _rec,
    _round_outward,
    _scratch,
    _view,
)
from kvstore.store.codecs.records import TensorRecord

DEFAULT_PACKING = "zstd:1"
DEFAULT_SINKS = 4
TAIL_GROUPS = (128, 64)  # the tail's int8 groups: keys' tokens, values' channels (int8's defaults)
BODY = (".codes", ".scales", ".zeros")
TAIL = (".tail.codes", ".tail.scales", ".tail.zeros")
_MAX_EDGE = 4096
CHUNK = 512  # the chunk bits_per_value assumes: the store's default (kvstore.store.keys.DEFAULT_CHUNK_TOKENS)


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


def _affine(role: str, group: int, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
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


@dataclass(frozen=True)
class Width:
    """One role's codes: ``bits`` wide, in groups of ``group`` (tokens for keys, channels for
    values), Hadamard-rotated when ``rotated``."""

    bits: int
    group: int
    rotated: bool

    def group_for(self, role: str, dim: int) -> int:
        if role == "keys":
            return self.group
        g = min(self.group, dim)
        if dim % g:
            raise CodecError(f"a value group of {g} channels does not divide head_dim {dim}")
        return g

    def encode(self, role: str, x: torch.Tensor) -> list[torch.Tensor]:
        """``[codes, scales, zeros]`` of ``x`` (float32 ``[H, m, D]``, no sink)."""
        check_dim(self.bits, x.shape[-1])
        if self.rotated:
            hadamard_block(x.shape[-1])
            x = rotate(x.double()).float()  # float64 butterfly, rounded once to float32
        codes, scales, zeros = _levels(role, x, self.group_for(role, x.shape[-1]), (1 << self.bits) - 1)
        return [pack(codes, self.bits), scales, zeros]

    def check(self, role: str, name: str, recs: list[TensorRecord], heads: int, m: int, dim: int):
        """``(codes, scales, zeros)`` of ``recs`` checked against ``[heads, m, dim]`` (CorruptEntryError)."""
        codes, scales, zeros = recs
        try:
            g = self.group_for(role, dim)
            check_dim(self.bits, dim)
            if self.rotated:
                hadamard_block(dim)
        except CodecError as exc:
            raise CorruptEntryError(f"tensor {name}: {exc}") from None
        width = self.bits * dim // 8
        if codes.shape != (heads, m, width) or codes.dtype != torch.uint8:
            raise CorruptEntryError(
                f"tensor {codes.name} is {codes.shape} {codes.dtype}, expected ({heads}, {m}, {width}) uint8"
            )
        want = (heads, -(-m // g), dim) if role == "keys" else (heads, m, dim // g)
        for rec in (scales, zeros):
            if rec.shape != want or rec.dtype not in (torch.float16, torch.bfloat16):
                raise CorruptEntryError(f"tensor {rec.name} is {rec.shape} {rec.dtype}, expected {want} float16")
        s, z = scales.materialize().float(), zeros.materialize().float()
        _finite_params(name, s, z)
        return _Section(self, role, codes, s, z, g)


def _levels(role: str, x: torch.Tensor, g: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


class _Section:
    """The checked codes, scales and zeros of one run of tokens (the body or the tail) of a stored
    tensor, decoded by :meth:`decode`."""

    def __init__(self, width: Width, role: str, codes: TensorRecord, scales, zeros, group: int):
        self.width, self.role, self.codes, self.group = width, role, codes, group
        self.scales, self.zeros = scales, zeros

    def decode(self, d: torch.Tensor, stage: Stage | None) -> None:
        """Dequantize into ``d`` ``[H, m, D]``: codes into a float32 (float64 for float64 ``d``) work
        tensor, the affine step, the butterfly when rotated, one rounding to ``d``'s dtype."""
        if d.shape[1] == 0:
            return
        wdt = torch.float64 if d.dtype == torch.float64 else torch.float32
        scales, zeros, dev = self.scales, self.zeros, None
        if stage is not None:  # only codes, scales and zeros go to the device; every step runs there
            dev = d.device
            codes, scales, zeros = (stage(t, dev) for t in (self.codes, scales, zeros))
            work = d if d.dtype == wdt and not self.width.rotated else torch.empty(d.shape, dtype=wdt, device=dev)
        else:
            codes = _view(self.codes)
            direct = d.dtype == wdt and d.device.type == "cpu" and not self.width.rotated
            work = d if direct else _scratch("kvh_" + str(wdt), d.numel(), wdt).view(d.shape)
        unpack_into(codes, self.width.bits, work, dev)
        _affine(self.role, self.group, work, scales.to(wdt), zeros.to(wdt))
        if self.width.rotated:
            tag = "kvh_b" + str(wdt)
            other = torch.empty_like(work) if dev is not None else _scratch(tag, d.numel(), wdt).view(d.shape)
            rotated = butterfly(work, other)
            if d.dtype == wdt and d.device == rotated.device:
                torch.mul(rotated, _norm(d.shape[-1], wdt), out=d)
            else:
                d.copy_(rotated.mul_(_norm(d.shape[-1], wdt)))
        elif work is not d:
            d.copy_(work)


class AsymQuantizer:
    """``kvh``: keys and values at widths of their own, exact sinks, an 8-bit tail (module docstring)."""

    name = "kvh"
    lossless = False
    default_packing = DEFAULT_PACKING

    def __init__(self, key_bits: int, value_bits: int, group_k: int, group_v: int, sinks: int = DEFAULT_SINKS,
                 tail: int = 0):  # fmt: skip
        self.key_bits, self.value_bits, self.group_k, self.group_v = key_bits, value_bits, group_k, group_v
        self.sinks, self.tail = sinks, tail
        self.widths = {
            "keys": Width(key_bits, group_k, key_bits < 8),
            "values": Width(value_bits, group_v, value_bits < 8),
        }
        self.tail_widths = {"keys": Width(8, TAIL_GROUPS[0], False), "values": Width(8, TAIL_GROUPS[1], False)}

    @property
    def spec(self) -> str:
        extra = (f":s={self.sinks}" if self.sinks != DEFAULT_SINKS else "") + (f":t={self.tail}" if self.tail else "")
        return f"kvh:{self.key_bits}/{self.value_bits}:{self.group_k}/{self.group_v}{extra}"

    def params(self) -> dict:
        return {"name": self.name, "args": self.spec.partition(":")[2]}

    def stored_names(self, name: str) -> list[str]:
        return [name + p for p in (*BODY, ".sink", *(TAIL if self.tail else ()))]

    def bits_per_value(self, head_dim: int, dtype_bits: int, n_layers: int = 0) -> float:
        """Stored bits per element of a :data:`CHUNK`-token chunk past the sinks (the store's default
        chunk): codes, a 16-bit scale and zero per group (a partial group pays a whole one), the
        last ``T`` tokens at the tail's 8 bits; keys and values averaged."""
        t = min(self.tail, CHUNK)
        m = CHUNK - t
        gv = min(self.group_v, head_dim)
        keys = self.key_bits * m + 32 * -(-m // self.group_k) + 8 * t + 32 * -(-t // TAIL_GROUPS[0])
        values = (self.value_bits + 32 / gv) * m + (8 + 32 / min(TAIL_GROUPS[1], head_dim)) * t
        return (keys + values) / (2 * CHUNK)

    def _split(self, n: int, start: int, positions: torch.Tensor | None) -> tuple[int, int]:
        """``(sink tokens, tail tokens)`` of an ``n``-token tensor (see :func:`sink_tokens`)."""
        k = sink_tokens(self.sinks, n, start, positions)
        return k, min(self.tail, n - k)

    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        x = tensor.detach().to("cpu")
        heads, n, dim = x.shape
        k, t = self._split(n, start, positions)
        body = x[:, k : n - t].float()
        out = list(zip(BODY, self.widths[role].encode(role, body)))
        out.append((".sink", x[:, :k].contiguous()))
        if self.tail:
            out += zip(TAIL, self.tail_widths[role].encode(role, x[:, n - t :].float()))
        return out

    def reader(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype,
        start: int = 0, positions: torch.Tensor | None = None,
    ) -> _AsymReader:  # fmt: skip
        heads, n, dim = shape
        sink = _rec(records, name + ".sink")
        k = sink.shape[1] if len(sink.shape) == 3 else -1
        if sink.shape != (heads, k, dim) or sink.dtype != dtype or not 0 <= k <= min(self.sinks, n):
            raise CorruptEntryError(
                f"tensor {sink.name} is {sink.shape} {sink.dtype}, expected [{heads}, <={self.sinks}, {dim}] {dtype}"
            )
        t = 0
        tail = None
        if self.tail:
            recs = [_rec(records, name + p) for p in TAIL]
            t = recs[0].shape[1] if len(recs[0].shape) == 3 else -1
            if not 0 <= t <= min(self.tail, n - k):
                raise CorruptEntryError(f"tensor {recs[0].name} has {t} tokens, expected at most {self.tail}")
            tail = self.tail_widths[role].check(role, name, recs, heads, t, dim)
        body = self.widths[role].check(role, name, [_rec(records, name + p) for p in BODY], heads, n - k - t, dim)
        return _AsymReader(name, tuple(shape), dtype, sink, body, tail)


def sink_tokens(sinks: int, n: int, start: int = 0, positions: torch.Tensor | None = None) -> int:
    """How many leading tokens of an ``n``-token tensor are among a context's first ``sinks``: without
    ``positions`` the tensor covers ``start..start+n``; with them (ascending context positions), its
    tokens at positions below ``sinks`` (a pressed cache's kept tokens)."""
    if positions is None:
        return max(0, min(sinks - start, n))
    return int((positions[:sinks] < sinks).sum())


class _AsymReader:
    """Decodes one ``kvh`` tensor: the sink copied, the body and the tail dequantized in place.
    ``device_decode``: with a ``stage`` every part goes to the destination's device as it is stored
    (codes as uint8) and the same steps run there."""

    device_decode = True

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, sink: TensorRecord, body: _Section,
                 tail: _Section | None):  # fmt: skip
        self.name, self.shape, self.dtype, self.sink, self.body, self.tail = name, shape, dtype, sink, body, tail

    def copy_into(self, dest: torch.Tensor, stage: Stage | None = None) -> None:
        if tuple(dest.shape) != self.shape or dest.dtype != self.dtype:
            got, want = f"{tuple(dest.shape)}/{dest.dtype}", f"{self.shape}/{self.dtype}"
            raise ValueError(f"{self.name}: destination {got} != {want}")
        k = self.sink.shape[1]
        if k and stage is not None:
            dest[:, :k].copy_(stage(self.sink, dest.device))
        elif k:
            self.sink.copy_into(dest[:, :k])
        t = self.tail.codes.shape[1] if self.tail is not None else 0
        n = self.shape[1]
        self.body.decode(dest[:, k : n - t], stage)
        if self.tail is not None:
            self.tail.decode(dest[:, n - t :], stage)

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out


def _whole(text: str, what: str, lo: int, hi: int) -> int:
    if not re.fullmatch(r"\d+", text) or not lo <= int(text) <= hi:
        raise CodecError(f"kvh {what} must be a whole number from {lo} to {hi}, not {text!r}")
    return int(text)


def _group(text: str) -> int:
    g = _whole(text, "group size", 2, 4096)
    if g & (g - 1):
        raise CodecError(f"kvh group size must be a power of two from 2 to 4096, not {g}")
    return g


def _factory(args: str) -> AsymQuantizer:
    """``kvh[:KB/VB][:GK/GV][:s=S][:t=T]`` (module docstring)."""
    fields = args.split(":") if args else []
    plain = [f for f in fields if "=" not in f]
    named = [f for f in fields if "=" in f]
    if len(plain) > 2 or fields[: len(plain)] != plain:
        raise CodecError(f"kvh takes [KB/VB][:GK/GV][:s=S][:t=T], not {args!r}")
    kb, vb = 8, 4
    if plain:
        a, sep, b = plain[0].partition("/")
        if not sep:
            raise CodecError(f"kvh's first field is the key and value bits KB/VB (e.g. 8/4), not {plain[0]!r}")
        kb, vb = _whole(a, "key bits", 2, 8), _whole(b, "value bits", 2, 8)
    gk, gv = (128 if kb == 8 else 32), (32 if vb <= 4 else 64)
    if len(plain) == 2:
        a, sep, b = plain[1].partition("/")
        gk = _group(a)
        gv = _group(b) if sep else gk
    edges: dict[str, int] = {}
    for f in named:
        tag, _, text = f.partition("=")
        if tag not in ("s", "t") or tag in edges:
            raise CodecError(f"kvh takes s=S and t=T once each, not {args!r}")
        edges[tag] = _whole(text, tag + "=", 0, _MAX_EDGE)
    return AsymQuantizer(kb, vb, gk, gv, sinks=edges.get("s", DEFAULT_SINKS), tail=edges.get("t", 0))


register_quantizer("kvh", _factory, since=7)

__all__ = ["AsymQuantizer", "Width", "pack", "planes", "sink_tokens", "unpack_into"]
