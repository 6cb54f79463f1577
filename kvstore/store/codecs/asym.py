"""``kvh``: keys and values with bit widths of their own, exact sinks, an 8-bit tail.

The quality gate showed where ``int4h``'s damage comes from on the bundled model: keys at 4 bits
carry most of it, and once keys get 8 bits the 4-bit values are what is left (docs/lossy-codecs.md).
``kvh`` gives each its own width and grouping in one short spec:

* **keys**: ``KB``-bit codes per channel in groups of ``GK`` tokens (the KIVI axes, as ``int8``);
* **values**: ``VB``-bit codes per token in groups of ``GV`` channels;
* a role below 8 bits is Hadamard-rotated first (``int4h``'s butterfly, :mod:`.hadamard`), which
  spreads a loud channel's range over the head; at 8 bits the codes are ``int8``'s, not rotated
  (keys-only KL is already ~int8's there, and the butterfly is the slow part of a decode: 6 strided
  passes, ~10x ``int4``'s whole dequantization on this CPU). ``:h=0`` turns the rotation off for
  every width (``int4``'s speed, the outlier channels' coarser steps back);
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

Specs: ``kvh[:KB/VB][:GK/GV][:s=S][:t=T][:h=0]``, e.g. ``kvh:8/4`` (the default), ``kvh:8/5``,
``kvh:5/3:64/32``, ``kvh:8/4:s=16:t=64``. Default groups: keys 128 tokens at 8 bits (``int8``'s),
32 below (``int4h``'s); values 32 channels at 4 bits and below (half ``int4h``'s 64: finer steps for
the values, which are what is left once keys have 8 bits), 64 above. ``S`` defaults to 4 (as every
other lossy codec), ``T`` to 0; at most 4096 each. Packing ``zstd:1`` unless the spec names one.

Per-layer widths: ``:kW=L.L...`` / ``:vW=L.L...`` (``W`` 2 to 8) give the listed layers' keys (values)
``W``-bit codes in ``W``'s default groups (rotated below 8 bits), e.g. ``kvh:6/4:k8=0.1:v8=0.29``:
what ``kvstore quality --sweep`` recommends for a byte budget (:mod:`kvstore.codec_sweep`). The
layer is read from the stored tensor's name (``layers.L.keys``, a pressed cache's ``layers.L.heads.H.keys``),
at encoding and decoding alike (as ``int4h:k8=``), so the spec in the entry's header is all
decoding needs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import register_quantizer
from kvstore.store.codecs.hadamard import _norm, butterfly, hadamard_block, hadamard_rotate
from kvstore.store.codecs.planes import affine, check_dim, levels, pack, unpack_into
from kvstore.store.codecs.quant import Stage, _finite_params, _rec, _scratch, _view, sink_then_rest, value_group
from kvstore.store.codecs.records import StoredTensorBase, TensorRecord

DEFAULT_PACKING = "zstd:1"
DEFAULT_SINKS = 4
TAIL_GROUPS = (128, 64)  # the tail's int8 groups: keys' tokens, values' channels (int8's defaults)
BODY = (".codes", ".scales", ".zeros")
TAIL = (".tail.codes", ".tail.scales", ".tail.zeros")
_MAX_EDGE = 4096
_LAYER = re.compile(r"layers\.(\d+)\.")
CHUNK = 512  # the chunk bits_per_value assumes: the store's default (kvstore.store.keys.DEFAULT_CHUNK_TOKENS)


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
        return value_group(self.group, dim)

    def encode(self, role: str, x: torch.Tensor) -> list[torch.Tensor]:
        """``[codes, scales, zeros]`` of ``x`` (float32 ``[H, m, D]``, no sink)."""
        check_dim(self.bits, x.shape[-1])
        if self.rotated:
            hadamard_block(x.shape[-1])
            x = hadamard_rotate(x.double()).float()  # float64 butterfly, rounded once to float32
        codes, scales, zeros = levels(role, x, self.group_for(role, x.shape[-1]), (1 << self.bits) - 1)
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
        affine(self.role, self.group, work, scales.to(wdt), zeros.to(wdt))
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
                 tail: int = 0, layers: Mapping[str, Mapping[int, int]] | None = None,
                 rotate: bool = True):  # fmt: skip
        self.key_bits, self.value_bits, self.group_k, self.group_v = key_bits, value_bits, group_k, group_v
        self.sinks, self.tail, self.rotate = sinks, tail, rotate
        self.widths = {
            "keys": Width(key_bits, group_k, rotate and key_bits < 8),
            "values": Width(value_bits, group_v, rotate and value_bits < 8),
        }
        self.tail_widths = {"keys": Width(8, TAIL_GROUPS[0], False), "values": Width(8, TAIL_GROUPS[1], False)}
        # per role, the layers given other widths (``kW=``/``vW=``), each in its width's default groups
        self.layers = {role: dict(sorted((layers or {}).get(role, {}).items())) for role in ("keys", "values")}

    def width_of(self, role: str, name: str) -> Width:
        """The codes of tensor ``name``: its layer's own width (read from the name, ``layers.L....``)
        when the spec lists that layer, else the role's."""
        m = _LAYER.match(name)
        bits = self.layers[role].get(int(m.group(1))) if m else None
        if bits is None:
            return self.widths[role]
        return Width(bits, default_group(role, bits), self.rotate and bits < 8)

    @property
    def spec(self) -> str:
        extra = (f":s={self.sinks}" if self.sinks != DEFAULT_SINKS else "") + (f":t={self.tail}" if self.tail else "")
        extra += "" if self.rotate else ":h=0"
        for role, tag in (("keys", "k"), ("values", "v")):
            for bits in sorted(set(self.layers[role].values()), reverse=True):
                extra += f":{tag}{bits}=" + ".".join(str(i) for i, b in self.layers[role].items() if b == bits)
        return f"kvh:{self.key_bits}/{self.value_bits}:{self.group_k}/{self.group_v}{extra}"

    def params(self) -> dict:
        return {"name": self.name, "args": self.spec.partition(":")[2]}

    def stored_names(self, name: str) -> list[str]:
        return [name + p for p in (*BODY, ".sink", *(TAIL if self.tail else ()))]

    def bits_per_value(self, head_dim: int, dtype_bits: int, n_layers: int = 0) -> float:
        """Stored bits per element of a :data:`CHUNK`-token chunk past the sinks (the store's default
        chunk): codes, a 16-bit scale and zero per group (a partial group pays a whole one), the
        last ``T`` tokens at the tail's 8 bits; keys and values averaged, and over ``n_layers``
        layers when the spec gives some layers other widths (CodecError without it then)."""
        listed = any(self.layers.values())
        if listed and n_layers < 1:
            raise CodecError(f"{self.spec}: bits per value depend on the model's layer count; give n_layers")
        total = 0.0
        for i in range(n_layers if listed else 1):
            for role in ("keys", "values"):
                bits = self.layers[role].get(i)
                w = self.widths[role] if bits is None else self.width_of(role, f"layers.{i}.")
                total += _chunk_bits(w, self.tail_widths[role], role, min(self.tail, CHUNK), head_dim)
        return total / (2 * CHUNK * (n_layers if listed else 1))

    def _split(self, n: int, start: int, positions: torch.Tensor | None) -> tuple[int, int]:
        """``(sink tokens, tail tokens)`` of an ``n``-token tensor (see :func:`sink_tokens`)."""
        k = sink_tokens(self.sinks, n, start, positions)
        return k, min(self.tail, n - k)

    def encode_named(
        self, name: str, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """:meth:`encode` of the tensor stored as ``name`` (its layer may have a width of its own)."""
        return self._encode(self.width_of(role, name), role, tensor, start, positions)

    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        return self._encode(self.widths[role], role, tensor, start, positions)

    def _encode(
        self, width: Width, role: str, tensor: torch.Tensor, start: int, positions: torch.Tensor | None
    ) -> list[tuple[str, torch.Tensor]]:
        x = tensor.detach().to("cpu")
        heads, n, dim = x.shape
        k, t = self._split(n, start, positions)
        body = x[:, k : n - t].float()
        out = list(zip(BODY, width.encode(role, body)))
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
        parts = [_rec(records, name + p) for p in BODY]
        body = self.width_of(role, name).check(role, name, parts, heads, n - k - t, dim)
        return _AsymReader(name, tuple(shape), dtype, sink, body, tail)


def default_group(role: str, bits: int) -> int:
    """A width's default group: keys 128 tokens at 8 bits (``int8``'s), 32 below (``int4h``'s);
    values 32 channels at 4 bits and below, 64 above."""
    if role == "keys":
        return 128 if bits == 8 else 32
    return 32 if bits <= 4 else 64


def _chunk_bits(w: Width, tail: Width, role: str, t: int, head_dim: int) -> float:
    """Bits one channel (keys) or one token's channels per channel (values) of a CHUNK-token chunk
    takes: body codes and groups, then the tail's."""
    m = CHUNK - t
    if role == "keys":
        return w.bits * m + 32 * -(-m // w.group) + tail.bits * t + 32 * -(-t // tail.group)
    return (w.bits + 32 / min(w.group, head_dim)) * m + (tail.bits + 32 / min(tail.group, head_dim)) * t


def sink_tokens(sinks: int, n: int, start: int = 0, positions: torch.Tensor | None = None) -> int:
    """How many leading tokens of an ``n``-token tensor are among a context's first ``sinks``: without
    ``positions`` the tensor covers ``start..start+n``; with them (ascending context positions), its
    tokens at positions below ``sinks`` (a pressed cache's kept tokens)."""
    if positions is None:
        return max(0, min(sinks - start, n))
    return int((positions[:sinks] < sinks).sum())


class _AsymReader(StoredTensorBase):
    """Decodes one ``kvh`` tensor: the sink copied, the body and the tail dequantized in place.
    ``device_decode``: with a ``stage`` every part goes to the destination's device as it is stored
    (codes as uint8) and the same steps run there."""

    device_decode = True

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, sink: TensorRecord, body: _Section,
                 tail: _Section | None):  # fmt: skip
        self.name, self.shape, self.dtype, self.sink, self.body, self.tail = name, shape, dtype, sink, body, tail

    def copy_into(self, dest: torch.Tensor, stage: Stage | None = None) -> None:
        rest = sink_then_rest(self, dest, stage)
        m = rest.shape[1] - (self.tail.codes.shape[1] if self.tail is not None else 0)
        self.body.decode(rest[:, :m], stage)
        if self.tail is not None:
            self.tail.decode(rest[:, m:], stage)

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
    """``kvh[:KB/VB][:GK/GV][:s=S][:t=T][:h=0][:kW=L.L...][:vW=L.L...]`` (module docstring)."""
    fields = args.split(":") if args else []
    plain = [f for f in fields if "=" not in f]
    if len(plain) > 2 or fields[: len(plain)] != plain:
        raise CodecError(f"kvh takes [KB/VB][:GK/GV][:s=S][:t=T][:h=0][:kW=L.L...][:vW=L.L...], not {args!r}")
    kb, vb = 8, 4
    if plain:
        a, sep, b = plain[0].partition("/")
        if not sep:
            raise CodecError(f"kvh's first field is the key and value bits KB/VB (e.g. 8/4), not {plain[0]!r}")
        kb, vb = _whole(a, "key bits", 2, 8), _whole(b, "value bits", 2, 8)
    gk, gv = default_group("keys", kb), default_group("values", vb)
    if len(plain) == 2:
        a, sep, b = plain[1].partition("/")
        gk = _group(a)
        gv = _group(b) if sep else gk
    edges: dict[str, int] = {}
    layers: dict[str, dict[int, int]] = {"keys": {}, "values": {}}
    for f in fields[len(plain) :]:
        tag, _, text = f.partition("=")
        if tag in ("s", "t", "h") and tag not in edges:
            edges[tag] = _whole(text, tag + "=", 0, _MAX_EDGE if tag != "h" else 1)
        elif re.fullmatch(r"[kv][2-8]", tag):
            _add_layers(layers["keys" if tag[0] == "k" else "values"], int(tag[1]), tag, text)
        else:
            raise CodecError(f"kvh takes s=S, t=T and h=0|1 once each, and kW=/vW= layer lists (W 2-8), not {f!r}")
    return AsymQuantizer(
        kb, vb, gk, gv, edges.get("s", DEFAULT_SINKS), edges.get("t", 0), layers, edges.get("h", 1) == 1
    )


def _add_layers(into: dict[int, int], bits: int, tag: str, text: str) -> None:
    if not re.fullmatch(r"\d+(\.\d+)*", text):
        raise CodecError(f"kvh {tag}= takes layer indices separated by '.', e.g. {tag}=0.1.29, not {text!r}")
    for layer in map(int, text.split(".")):
        if layer in into:
            raise CodecError(f"kvh lists layer {layer} twice for the {'keys' if tag[0] == 'k' else 'values'}")
        into[layer] = bits


register_quantizer("kvh", _factory, since=7)

__all__ = ["AsymQuantizer", "Width", "sink_tokens"]
