"""``int4h``: ``int4`` with keys and values rotated by a Hadamard transform over each head's channels.

A few channels of a head carry most of its range (a large steady offset, or outliers); a per-group
4-bit step is cut from the widest channel of the group, so the quiet channels get a coarse grid.
Multiplying every token's ``head_dim`` vector by a normalized Hadamard matrix ``H`` (orthogonal and
symmetric, ``H @ H = I``) spreads each channel's energy over all of them before quantizing;
decoding multiplies by ``H`` again. The dot products attention takes are unchanged by an orthogonal
rotation, and the rounding error comes back spread evenly over the channels (the same squared
error, no channel holding it all). ik_llama.cpp's rotated Q4_0 keys (PR #1034) and QuaRot do this;
``int4h`` applies it to ``int4``'s codes on the KIVI axes:

* **keys**: rotated, then per channel in groups of ``GK`` tokens (as ``int4``: a 16-bit scale and
  zero per channel and group);
* **values**: rotated, then per token in groups of ``GV`` channels (as ``int4``).

``head_dim`` a power of two: one Hadamard over the whole head. Otherwise a block-diagonal one of the
largest power-of-two blocks that divide ``head_dim`` (e.g. 80 = 5 x 16): still orthogonal and
symmetric. An odd ``head_dim`` is refused (as ``int4`` refuses it). No rotary parameters are needed
(the keys are rotated as the model cached them, after RoPE): ``sync --codec int4h`` converts a store
without the model. The tuning runs that chose this (and measured pre-RoPE keys and kept outliers,
not taken) are in docs/lossy-codecs.md.

Portable decodes: ``H`` is applied as a fast Walsh-Hadamard butterfly (:func:`butterfly`:
element-wise sums and differences in a fixed order, then one element-wise multiply by
``1 / sqrt(block)``, exact for blocks of 16, 64, 256; the constant rounded once to the work dtype for
blocks of 2, 8, 32, 128), never a matrix product, whose rounding follows the BLAS kernel the CPU
picks: an entry decodes to the same bits on any CPU, BLAS, thread count, and on a device (the
staging ring's dequantization runs the same steps there). Encoding runs the butterfly in float64.
Entries written before (by a matrix product) keep their layout and decode to these portable values.

Error bound: an element of the rotated tensor is within half its step of its code (as for
``int4``); ``H`` is orthogonal, so a decoded token row's error has the same Euclidean norm, at most
``sqrt(sum_j (step_j / 2) ** 2)`` over the row's channel steps, plus float32 arithmetic and one
rounding to the model's dtype (float64 models are decoded in float64). A context's first
``SINK_TOKENS`` tokens are stored as the model made them (not rotated).

Stored tensors: those of ``int4`` (``NAME.codes``, ``.scales``, ``.zeros``, ``.sink``), the codes,
scales and zeros describing the rotated values. Entry format 6: a kvstore that reads up to format 5
refuses an ``int4h`` chunk instead of taking it for corrupt.

Specs: ``int4h[:G]`` or ``int4h:GK/GV`` (default ``32/64``: 4.75 bits per element with the 16-bit
scales and zeros, the bytes of ``int4``; the packing ``zstd:1`` unless the spec names another).

Mixed precision: ``int4h[:GK/GV]:k8=L.L...`` and/or ``:v8=L.L...`` give the keys (values) of the
listed layers 8-bit codes on the same axes and groups (rotated as the rest), every other layer 4-bit:
``int4h:k8=21.23`` (layers by index, ``.``-separated; ``,`` separates codecs in lists). The layer is
read from the stored tensor's name (``layers.L.keys``, a pressed cache's ``layers.L.heads.H.keys``),
at encoding and at decoding alike, so the spec in the entry's header is all decoding needs. The set
is part of the spec, hence of the codec's identity: ``int4h`` alone is unchanged (same identity,
same bytes). Which layers is a per-model choice measured on tuning text (docs/lossy-codecs.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from functools import lru_cache

import torch

from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs.base import Codec, register_quantizer
from kvstore.store.codecs.quant import (
    PARTS,
    IntParts,
    IntQuantizer,
    Stage,
    _IntReader,
    _scratch,
    int_factory,
    sink_count,
    sink_then_rest,
)
from kvstore.store.codecs.records import TensorRecord

DEFAULT_PACKING = "zstd:1"


def hadamard_block(head_dim: int) -> int:
    """The Hadamard block size for ``head_dim``: the largest power of two dividing it. Raises
    CodecError for an odd ``head_dim`` (a block of 1 rotates nothing)."""
    block = head_dim & -head_dim
    if block < 2:
        raise CodecError(f"int4h needs an even head_dim (it rotates blocks of a power of two), not {head_dim}")
    return block


@lru_cache(maxsize=16)
def _hadamard_cpu(head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    block = hadamard_block(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester's construction: symmetric, entries +-1
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = torch.block_diag(*[h / math.sqrt(block)] * (head_dim // block))
    return h.to(dtype)


def hadamard(head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized (block) Hadamard matrix ``[head_dim, head_dim]`` ``int4h`` rotates by, on the
    CPU (cached: do not write to it): orthogonal and symmetric (its own inverse). Raises CodecError
    for an odd ``head_dim``."""
    return _hadamard_cpu(head_dim, dtype)


def hadamard_rotate(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ hadamard(D)`` for ``x`` ``[..., D]`` (float32 or float64, any device) as a fast
    Walsh-Hadamard butterfly (see :func:`butterfly`), into ``out`` (same shape and dtype; may be
    ``x``) or a new tensor. ``x`` is left as it was."""
    a = butterfly(x.clone(), torch.empty_like(x))
    return a.mul_(_norm(x.shape[-1], x.dtype)) if out is None else torch.mul(a, _norm(x.shape[-1], x.dtype), out=out)


def butterfly(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform of ``a`` ``[..., D]`` over each block of
    :func:`hadamard_block` channels: ``log2(block)`` stages of element-wise sums and differences of
    channel pairs ``(j, j + h)``, ``h = 1, 2, 4...`` in that order, ping-ponging between ``a`` and
    ``b`` (same shape and dtype, contiguous; both are overwritten). Returns the one holding the
    result. Each step is one correctly rounded IEEE operation per element in a fixed order, so the
    bits depend on no instruction set, BLAS or thread count (a matrix product's do). Multiplying by
    ``_norm(D, dtype)`` then gives ``a @ hadamard(D)``."""
    dim = a.shape[-1]
    block, h = hadamard_block(dim), 1
    while h < block:  # channels as (blocks of 2h, the pair's side, h): sums to side 0, differences to side 1
        src, dst = a.unflatten(-1, (dim // (2 * h), 2, h)), b.unflatten(-1, (dim // (2 * h), 2, h))
        torch.add(src[..., 0, :], src[..., 1, :], out=dst[..., 0, :])
        torch.sub(src[..., 0, :], src[..., 1, :], out=dst[..., 1, :])
        a, b, h = b, a, h * 2
    return a


def _norm(head_dim: int, dtype: torch.dtype) -> float:
    """The butterfly's normalization ``1 / sqrt(block)`` rounded once to ``dtype``: a power of two,
    hence exact, when ``block`` is a power of 4 (16, 64, 256); else (2, 8, 32, 128) the nearest
    ``dtype`` value, applied in one element-wise multiply after the sums."""
    return float(torch.tensor(1.0 / math.sqrt(hadamard_block(head_dim)), dtype=torch.float64).to(dtype))


class HadamardQuantizer(IntQuantizer):
    """``int4h``: ``int4`` codes of Hadamard-rotated keys and values (see the module docstring)."""

    default_packing = DEFAULT_PACKING

    def __init__(
        self, bits: int, group_k: int, group_v: int, keys8: tuple[int, ...] = (), values8: tuple[int, ...] = ()
    ):
        super().__init__(bits, group_k, group_v)
        self.name = "int4h"
        self.keys8, self.values8 = tuple(sorted(set(keys8))), tuple(sorted(set(values8)))
        self._wide = IntQuantizer(8, group_k, group_v)  # the 8-bit codes of the layers listed

    @property
    def spec(self) -> str:
        extra = "".join(
            f":{tag}=" + ".".join(map(str, ls)) for tag, ls in (("k8", self.keys8), ("v8", self.values8)) if ls
        )
        return super().spec + extra

    def bits_per_value(self, head_dim: int, dtype_bits: int, n_layers: int = 0) -> float:
        """:meth:`IntQuantizer.bits_per_value` with the listed layers' keys (values) at 8 bits: each
        adds ``(8 - 4) / 2 / n_layers`` (keys and values averaged). CodecError without ``n_layers``
        for a mixed spec (the share depends on it)."""
        four = super().bits_per_value(head_dim, dtype_bits)
        if not (self.keys8 or self.values8):
            return four
        if n_layers < 1:
            raise CodecError(f"{self.spec}: bits per value depend on the model's layer count; give n_layers")
        wide = sum(1 for i in self.keys8 if i < n_layers) + sum(1 for i in self.values8 if i < n_layers)
        return four + (self._wide.bits - self.bits) * wide / (2 * n_layers)

    def codes_of(self, role: str, name: str) -> IntQuantizer:
        """The integer codes tensor ``name`` is stored in: 8-bit for a layer of ``keys8``/``values8``
        (read from the name, ``layers.L....``), else this quantizer's 4-bit ones."""
        m = _LAYER.match(name)
        chosen = self.keys8 if role == "keys" else self.values8
        return self._wide if m and int(m.group(1)) in chosen else self

    def encode_named(
        self, name: str, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """:meth:`encode` of the tensor stored as ``name`` (its layer picks 4- or 8-bit codes)."""
        return self._encode(self.codes_of(role, name), role, tensor, start, positions)

    def encode(
        self, role: str, tensor: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        return self._encode(self, role, tensor, start, positions)

    def _encode(
        self, q: IntQuantizer, role: str, tensor: torch.Tensor, start: int, positions: torch.Tensor | None
    ) -> list[tuple[str, torch.Tensor]]:
        x = tensor.detach().to("cpu")
        heads, n, dim = x.shape
        k = sink_count(n, start, positions)
        body = hadamard_rotate(x[:, k:].double()).float()  # float64 butterfly, rounded once to float32
        # int4's (int8's) codes of the rotated tokens (start > 0: no sink of their own), the sink as it is
        parts = dict(IntQuantizer.encode(q, role, body, start=1))
        parts[".sink"] = x[:, :k].contiguous()
        return [(p, parts[p]) for p in PARTS]

    def reader(
        self, role: str, name: str, records: Mapping[str, TensorRecord], shape: tuple[int, ...], dtype: torch.dtype,
        start: int = 0, positions: torch.Tensor | None = None,
    ) -> _HadamardReader:  # fmt: skip
        try:
            hadamard_block(shape[2])
        except CodecError as exc:
            raise CorruptEntryError(str(exc)) from None
        q = self.codes_of(role, name)
        parts = IntQuantizer.checked_parts(q, role, name, records, shape, dtype)
        return _HadamardReader(q, role, name, shape, dtype, parts)


class _HadamardReader(_IntReader):
    """Decodes one ``int4h`` tensor: ``int4``'s dequantization into a float32 (float64) work tensor,
    then the butterfly (:func:`butterfly`) and its normalization into the destination: the same
    bits on every CPU and thread count. ``device_decode``: with a ``stage`` the codes, scales and
    zeros go to the destination's device and every step runs there, in the same order."""

    device_decode = True

    def copy_into(self, dest: torch.Tensor, stage: Stage | None = None) -> None:
        d = sink_then_rest(self, dest, stage)
        heads, m, dim = d.shape
        if m == 0:
            return
        wdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        if stage is not None:  # on the device: only codes and scales go up, the butterfly runs there
            work, other = (torch.empty(d.shape, dtype=wdt, device=d.device) for _ in range(2))
        else:
            tag = "h_f64" if wdt == torch.float64 else "h_f32"
            work, other = (_scratch(tag + side, d.numel(), wdt).view(d.shape) for side in ("a", "b"))
        # int4's dequantization of the codes alone (no sink: it went straight to dest above)
        parts = IntParts(self.codes, self.scales, self.zeros, _no_sink(self.name, heads, dim, wdt), self.group)
        body = _IntReader(self.q, self.role, self.name, (heads, m, dim), wdt, parts)
        body.copy_into(work, stage)
        rotated = butterfly(work, other)
        if d.dtype == wdt and d.device == rotated.device:
            torch.mul(rotated, _norm(dim, wdt), out=d)
        else:  # normalized in the work dtype, then rounded once to the destination's
            d.copy_(rotated.mul_(_norm(dim, wdt)))


def layer_refusal(codec: Codec, n_layers: int) -> str | None:
    """Why ``codec`` does not fit a model of ``n_layers`` layers: its 8-bit layers (``int4h:k8=L``,
    ``v8=L``) name one the model lacks (the spec would then mean plain ``int4h`` under another
    identity, and a typo look like a mixed-precision result); None when they fit or it names none."""
    q = codec.quantizer
    for tag, chosen in (("k8", getattr(q, "keys8", ())), ("v8", getattr(q, "values8", ()))):
        missing = [i for i in chosen if i >= n_layers]
        if missing:
            return (f"{codec.spec}: {tag}= names layer {missing[0]}, but the model has {n_layers} layers "
                    f"(0 to {n_layers - 1})")  # fmt: skip
    return None


def _no_sink(name: str, heads: int, dim: int, dtype: torch.dtype) -> TensorRecord:
    return TensorRecord(name + ".sink", dtype, (heads, 0, dim), torch.empty(0, dtype=torch.uint8))


_LAYER = re.compile(r"layers\.(\d+)\.")


def _layers(tag: str, text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in text.split("."))
    except ValueError:
        out = ()
    if not out or any(i < 0 for i in out) or len(set(out)) != len(out):
        raise CodecError(f"int4h {tag}= takes distinct layer indices separated by '.', e.g. {tag}=21.23, not {text!r}")
    return out


def _factory(args: str) -> HadamardQuantizer:
    groups, *rest = args.split(":")
    if groups.startswith(("k8=", "v8=")):
        groups, rest = "", [groups, *rest]
    q = int_factory(HadamardQuantizer, "int4h", 4, 32, 64)(groups)
    wide: dict[str, tuple[int, ...]] = {}
    for part in rest:
        tag, eq, text = part.partition("=")
        if tag not in ("k8", "v8") or not eq or tag in wide:
            raise CodecError(f"int4h takes [GK/GV][:k8=L.L...][:v8=L.L...] (each once), not {args!r}")
        wide[tag] = _layers(tag, text)
    if not wide:
        return q
    return HadamardQuantizer(4, q.group_k, q.group_v, keys8=wide.get("k8", ()), values8=wide.get("v8", ()))


register_quantizer("int4h", _factory, since=6)

__all__ = ["HadamardQuantizer", "butterfly", "hadamard", "hadamard_block", "hadamard_rotate", "layer_refusal"]
