"""``ecq``: entropy-coded quantization, the int4-class codec that keeps the answers.

The fixed-width integer codes of ``int4``/``int4r`` spend the same 4 bits on every element and one
scale and zero per small group; a channel with a narrow spread gets as fine a grid as a wide one.
``ecq`` instead rounds every element of a head to **one step shared by the whole head** (per chunk):
keys before their rotary embedding (as ``int4r`` does, :mod:`kvstore.store.codecs.prerope`), values
as they are, each channel centred on its own mean. With one step, every channel of a head is off by
at most the same half step, which is what minimizes the squared error for the bytes spent once the
codes are entropy coded: a wide channel takes more distinct codes (more bits), a quiet one few or
one. The codes are stored as int8 and compressed by the packing (``zstd:1`` unless the spec names
another one), whose Huffman stage is the entropy coder (CacheGen's idea, with zstd's coder).

The step is ``S`` times the head's spread: the root mean square over its channels of each channel's
standard deviation over the chunk's tokens (``S`` from the spec; the codes then take about
``log2(4.13 / S)`` bits each, 4.5 for the default ``0.18``), raised where needed so that no code
leaves -127..127 (no element is ever clipped). Measured on SmolLM2's long contexts
(``experiments/results/quant_ecq.json``): docs/lossy-codecs.md.

Error bound: before the rotation every element is within half a step of its decoded value; after
it (keys) a rotated channel is within ``sqrt(2) * step / 2`` (both channels of a pair share the
head's step); plus the float32 arithmetic and one rounding to the model's dtype. A context's first
``SINK_TOKENS`` tokens are kept as the model made them (the attention sink), as every integer codec
keeps them.

Stored tensors, for a key or value tensor ``NAME`` ``[kv_heads, n, head_dim]`` (``k`` sink tokens,
``m = n - k``): ``NAME.codes`` I8 ``[H, m, D]``; ``NAME.offsets`` F16 (BF16 where float16 cannot hold
them) ``[H, 1, D]``, each channel's centre; ``NAME.steps`` F32 ``[H, 1, 1]``; ``NAME.sink`` ``[H, k, D]``
in the model's dtype. Keys need the model's rotary parameters, recorded in the header as for
``int4r`` (models without a rotation kvstore undoes are refused).

Specs: ``ecq`` (``0.18`` for keys and values), ``ecq:S`` or ``ecq:SK/SV`` (a step from 0.001 to 8
times the spread), optionally ``+PACKING``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import register_quantizer
from kvstore.store.codecs.portable import fixed_mean
from kvstore.store.codecs.prerope import Rotary, need_rotary, rotate
from kvstore.store.codecs.quant import (
    Stage,
    _param_dtype,
    _rec,
    _scratch,
    _view,
    checked_sink,
    sink_count,
    sink_then_rest,
)
from kvstore.store.codecs.records import StoredTensorBase, TensorRecord

PARTS = (".codes", ".offsets", ".steps", ".sink")
CODE_MAX = 127
DEFAULT_STEP = 0.18
DEFAULT_PACKING = "zstd:1"
_TINY = 1e-30


@dataclasses.dataclass(frozen=True)
class EntropyQuantizer:
    """``ecq``: one step per head and chunk, codes entropy coded by the packing (module docstring)."""

    step_k: float = DEFAULT_STEP
    step_v: float = DEFAULT_STEP
    rotary: Rotary | None = None

    name = "ecq"
    lossless = False
    default_packing = DEFAULT_PACKING

    @property
    def spec(self) -> str:
        k, v = f"{self.step_k:g}", f"{self.step_v:g}"
        return f"ecq:{k}" if k == v else f"ecq:{k}/{v}"

    def with_rotary(self, rotary: Rotary | None) -> EntropyQuantizer:
        return dataclasses.replace(self, rotary=rotary)

    def params(self) -> dict:
        out: dict = {"name": self.name, "args": self.spec.partition(":")[2]}
        if self.rotary is not None:
            out["rotary"] = self.rotary.record()
        return out

    def stored_names(self, name: str) -> list[str]:
        return [name + p for p in PARTS]

    def bits_per_value(self, head_dim: int, dtype_bits: int, n_layers: int = 0) -> float:
        # a Gaussian channel rounded to steps of S sigma takes about log2(sqrt(2 pi e) / S) bits once
        # entropy coded (the default packing); int8 codes never take more than 8
        s = math.sqrt(self.step_k * self.step_v)
        return min(8.0, max(1.0, math.log2(math.sqrt(2 * math.pi * math.e) / s)))

    # -- encoding -------------------------------------------------------------------------------
    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        x = tensor.detach().to("cpu")
        heads, n, dim = x.shape
        k = sink_count(n, start, positions)
        sink = x[:, :k].contiguous()
        wdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # as the reader decodes
        if role == "keys":
            rotary = need_rotary(self.rotary, self.spec, CodecError, dim)
            rest = None if positions is None else positions[k:]
            body = rotate(x[:, k:].double(), rotary, start + k, inverse=True, positions=rest).to(wdt)
        else:
            body = x[:, k:].to(wdt)
        m = body.shape[1]
        if m == 0:
            offsets = torch.zeros(heads, 1, dim, dtype=torch.float16)
            steps = torch.ones(heads, 1, 1, dtype=torch.float32)
            return self._parts(torch.zeros(heads, 0, dim, dtype=torch.int8), offsets, steps, sink)
        # fixed-order means (not torch.mean, whose order follows the vector width and the threads):
        # the same codes on every CPU
        centre = fixed_mean(body, (1,))
        offsets = centre.to(_param_dtype(centre))
        dev = body - offsets.to(wdt)
        widest = dev.abs().amax(dim=(1, 2), keepdim=True)
        spread = fixed_mean(dev.square(), (1, 2)).sqrt()
        if not bool(torch.isfinite(spread).all()):  # squares past the float range: scale by the widest first
            unit = widest.clamp(min=_TINY)
            spread = fixed_mean((dev / unit).square(), (1, 2)).sqrt() * unit
        s = self.step_k if role == "keys" else self.step_v
        steps = torch.maximum(spread * s, widest / CODE_MAX).clamp(min=_TINY).float()  # stored as float32
        codes = dev.div_(steps.to(wdt)).round_().clamp_(-CODE_MAX, CODE_MAX).to(torch.int8)
        return self._parts(codes, offsets, steps, sink)

    @staticmethod
    def _parts(codes, offsets, steps, sink) -> list[tuple[str, torch.Tensor]]:
        return [(".codes", codes.contiguous()), (".offsets", offsets.contiguous()),
                (".steps", steps.contiguous()), (".sink", sink)]  # fmt: skip

    # -- decoding -------------------------------------------------------------------------------
    def reader(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype,
        start: int = 0, positions: torch.Tensor | None = None,
    ) -> _EntropyReader:  # fmt: skip
        heads, n, dim = shape
        codes, offsets, steps, sink = (_rec(records, name + p) for p in PARTS)
        k = checked_sink(sink, shape, dtype)
        if codes.shape != (heads, n - k, dim) or codes.dtype != torch.int8:
            raise CorruptEntryError(f"tensor {codes.name} is {codes.shape} {codes.dtype}, expected int8")
        if offsets.shape != (heads, 1, dim) or offsets.dtype not in (torch.float16, torch.bfloat16):
            raise CorruptEntryError(f"tensor {offsets.name} is {offsets.shape} {offsets.dtype}, expected float16")
        if steps.shape != (heads, 1, 1) or steps.dtype != torch.float32:
            raise CorruptEntryError(f"tensor {steps.name} is {steps.shape} {steps.dtype}, expected float32")
        o, s = offsets.materialize().float(), steps.materialize()
        if not bool(torch.isfinite(o).all()) or not bool((torch.isfinite(s) & (s > 0)).all()):
            raise CorruptEntryError(f"tensor {name} has offsets or steps that are not finite and positive")
        rotary = None
        if role == "keys":
            rotary = need_rotary(self.rotary, self.spec, CorruptEntryError, dim)
        parts = EcqParts(codes, o, s, sink)
        return _EntropyReader(name, tuple(shape), dtype, parts, rotary=rotary, where=(start, positions))


@dataclass(frozen=True)
class EcqParts:
    """The checked stored parts of one ``ecq`` tensor: its int8 ``codes``, float32 ``offsets`` and
    ``steps``, and ``sink``."""

    codes: TensorRecord
    offsets: torch.Tensor
    steps: torch.Tensor
    sink: TensorRecord


class _EntropyReader(StoredTensorBase):
    """Decodes one ``ecq`` tensor into a destination buffer: codes * step + offset (float32, float64
    for a float64 model), rotated back for keys, cast once into the destination. ``device_decode``:
    with a ``stage`` the int8 codes go to the destination's device and the arithmetic runs there."""

    device_decode = True

    def __init__(self, name, shape, dtype, parts: EcqParts, rotary, where):
        self.name, self.shape, self.dtype = name, shape, dtype
        self.codes, self.offsets, self.steps, self.sink = parts.codes, parts.offsets, parts.steps, parts.sink
        self.rotary = rotary
        self.start, self.positions = where  # the first token's position, or every token's

    def copy_into(self, dest: torch.Tensor, stage: Stage | None = None) -> None:
        """Decode into ``dest``: on the host, or with ``stage`` (``stage(source, device)``, see
        :meth:`kvstore.model.io.staging.Staging.upload`) on ``dest``'s device, in fresh tensors there."""
        d = sink_then_rest(self, dest, stage)
        k = self.sink.shape[1]
        if d.numel() == 0:
            return
        wdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        offsets, steps = self.offsets.to(wdt), self.steps.to(wdt)
        if stage is not None:
            codes = stage(self.codes, d.device)
            offsets, steps = stage(offsets, d.device), stage(steps, d.device)
            work = torch.empty(d.shape, dtype=wdt, device=d.device)
        else:
            codes = _view(self.codes)
            if self.rotary is None and d.dtype == wdt and d.device.type == "cpu":
                work = d
            else:
                work = _scratch("ecq_f64" if wdt == torch.float64 else "ecq_f32", d.numel(), wdt).view(d.shape)
        if wdt == torch.float32:
            # code * step (int8 by float32: up to 31 significant bits) is exact in float64, and so is
            # the sum with the float16 offset but in contrived cases: then one rounding to float32,
            # the value a fused multiply-add gives. A float32 addcmul would be fused by the AVX2 and
            # AVX-512 kernels and not by the baseline one: different bits on different CPUs.
            wide = torch.empty(d.shape, dtype=torch.float64, device=work.device) if stage is not None else None
            wide = _scratch("ecq_wide", d.numel(), torch.float64).view(d.shape) if wide is None else wide
            wide.copy_(codes)
            torch.addcmul(offsets.double(), wide, steps.double(), out=wide)
            work.copy_(wide)
        else:  # float64: the product is exact, fused or not
            work.copy_(codes)
            torch.addcmul(offsets, work, steps, out=work)
        if self.rotary is not None:
            rest = None if self.positions is None else self.positions[k:]
            rotate(work, self.rotary, self.start + k, out=work, positions=rest)
        if work is not d:
            d.copy_(work)

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out


def _step_arg(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise CodecError(f"ecq step must be a number (a fraction of each head's spread), not {text!r}") from None
    if not 0.001 <= s <= 8:
        raise CodecError(f"ecq step must be from 0.001 to 8 times each head's spread, not {text}")
    return float(f"{s:g}")  # the step the spec (and so the keys) names, not more digits of it


def _factory(args: str) -> EntropyQuantizer:
    if not args:
        return EntropyQuantizer()
    sk, sep, sv = args.partition("/")
    k = _step_arg(sk)
    return EntropyQuantizer(k, _step_arg(sv) if sep else k)


def _from_params(params: Mapping) -> EntropyQuantizer:
    try:
        q = _factory(str(params.get("args", "")))
    except CodecError as exc:
        raise CorruptEntryError(f"entry header has a bad ecq step ({exc})") from None
    return q.with_rotary(Rotary.from_record(params.get("rotary")))


register_quantizer("ecq", _factory, from_params=_from_params, since=4)

__all__ = ["EcqParts", "EntropyQuantizer"]
