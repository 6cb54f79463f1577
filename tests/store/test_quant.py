"""Lossy codecs (int8, int4, fp8): error bounds, decoding into batch buffers, the stored layout,
golden bytes, hostile entries, and that a lossy codec is part of an entry's identity."""

from __future__ import annotations

import math
import os

import pytest
import torch
import zstandard

from helpers.entries import bits, check_lossy_golden, golden_quant_entry, split, with_frame
from helpers.paths import GOLDEN
from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs import Codec, get_codec
from kvstore.store.codecs.plain import RawPacking
from kvstore.store.codecs.quant import FP8_MAX, SINK_TOKENS, IntQuantizer
from kvstore.store.codecs.records import TensorRecord
from kvstore.store.entry import Entry, decode_entry, encode_entry
from kvstore.store.keys import chain_keys, chain_seed

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"
INT_SPECS = ["int8", "int8:32", "int8:128/64", "int4", "int4:64", "int4:16/8"]


def kv(heads=3, n=150, dim=16, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Channels of different scales and offsets (what per-channel key quantization is for), plus
    one outlier channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, n, dim, generator=g) * (torch.rand(1, 1, dim, generator=g) * 4 + 0.1)
    x += torch.randn(1, 1, dim, generator=g) * 3
    x[:, :, 3] *= 20
    return x.to(dtype)


def records(parts) -> dict[str, TensorRecord]:
    out = {}
    for suffix, t in parts:
        t = t.contiguous()
        out["t" + suffix] = TensorRecord("t" + suffix, t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8))
    return out


def roundtrip(spec: str, role: str, x: torch.Tensor, start: int = 0):
    q = get_codec(spec).quantizer
    parts = q.encode(role, x, start)
    return parts, q.reader(role, "t", records(parts), tuple(x.shape), x.dtype).materialize()


def step_per_element(spec: str, role: str, parts: dict, shape) -> torch.Tensor:
    """The quantization step (scale) that applies to each quantized element."""
    q = get_codec(spec).quantizer
    heads, m, dim = shape
    s = parts[".scales"].float()
    if role == "keys":
        return s.repeat_interleave(q.group_k, 1)[:, :m]
    return s.repeat_interleave(dim // s.shape[-1], 2)


# -- error bounds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", INT_SPECS)
@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("start", [0, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int_error_within_half_a_step(spec, role, start, dtype):
    x = kv(dtype=dtype)
    parts, y = roundtrip(spec, role, x, start)
    d = dict(parts)
    k = d[".sink"].shape[1]
    assert k == (SINK_TOKENS if start == 0 else 0)
    assert torch.equal(y[:, :k], x[:, :k]), "the sink tokens are stored exactly"
    step = step_per_element(spec, role, d, x[:, k:].shape)
    err = (y[:, k:].double() - x[:, k:].double()).abs()
    assert y.dtype == dtype and y.shape == x.shape
    assert bool((err <= step.double() * (0.5 + 1e-3) + 1e-6).all()), float((err / step).max())


@pytest.mark.parametrize("spec", INT_SPECS)
@pytest.mark.parametrize("role", ["keys", "values"])
def test_int_bfloat16_is_the_float32_result_rounded_once(spec, role):
    """A bfloat16 model's codes decode in float32 and are rounded once into the buffer."""
    x = kv(dtype=torch.bfloat16)
    parts, y = roundtrip(spec, role, x)
    d = dict(parts)
    k = d[".sink"].shape[1]
    assert d[".sink"].dtype == torch.bfloat16 and torch.equal(y[:, :k], x[:, :k])
    # the same codes read as a float32 entry (sink cast up: exact)
    parts32 = [(s, t.float() if s == ".sink" else t) for s, t in parts]
    y32 = get_codec(spec).quantizer.reader(role, "t", records(parts32), tuple(x.shape), torch.float32).materialize()
    assert torch.equal(y, y32.bfloat16())


@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_error_within_half_an_e4m3_step(role, dtype):
    x = kv(dtype=dtype)
    parts, y = roundtrip("fp8", role, x)
    scale = dict(parts)[".scales"].float()
    xs = x.float() / scale  # what was rounded to e4m3: 3 mantissa bits, subnormal step 2**-9
    err = (y.float() - x.float()).abs() / scale
    bound = torch.maximum(xs.abs() * 2.0**-4, torch.full_like(xs, 2.0**-10))
    tol = y.float().abs() / scale * (2.0**-8 if dtype == torch.bfloat16 else 1e-6)
    assert bool((err <= bound + tol + 1e-6).all())
    assert bool((xs.abs() <= FP8_MAX).all())


def test_fp8_decodes_every_code_exactly():
    """The float16 bit trick gives torch's own e4m3 value for all finite codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = torch.isfinite(codes.float())
    codes = codes[finite].reshape(1, -1, 1)
    scales = torch.ones(1, codes.shape[1], 1, dtype=torch.float16)
    recs = records([(".codes", codes), (".scales", scales)])
    y = get_codec("fp8").quantizer.reader("keys", "t", recs, tuple(codes.shape), torch.float32).materialize()
    assert torch.equal(bits(y), bits(codes.float()))


@pytest.mark.parametrize("spec", INT_SPECS + ["fp8"])
def test_decodes_into_a_strided_row_of_the_batch_buffers(spec):
    """Straight into one row and slot range of a padded batch buffer; nothing else is touched."""
    x = kv(n=70)
    q = get_codec(spec).quantizer
    reader = q.reader("keys", "t", records(q.encode("keys", x)), tuple(x.shape), torch.float32)
    buf = torch.full((3, 3, 90, 16), 7.0)
    reader.copy_into(buf[1, :, 12:82])
    assert torch.equal(buf[1, :, 12:82], reader.materialize())
    assert bool((buf[0] == 7).all() & (buf[2] == 7).all() & (buf[1, :, :12] == 7).all() & (buf[1, :, 82:] == 7).all())


def test_constant_and_empty_tensors():
    for spec in INT_SPECS + ["fp8"]:
        for x in (torch.zeros(2, 9, 8), torch.full((2, 9, 8), -3.5), torch.zeros(2, 0, 8)):
            _, y = roundtrip(spec, "keys", x)
            assert torch.equal(y, x), spec


def test_large_magnitudes_use_bfloat16_parameters():
    """float16 cannot hold zeros beyond 65504: such a tensor gets bfloat16 scales and zeros."""
    x = kv() * 1e4
    parts, y = roundtrip("int8", "values", x)
    assert dict(parts)[".zeros"].dtype == torch.bfloat16
    assert bool(torch.isfinite(y).all()) and float((y - x).abs().max()) < float(x.abs().max()) / 100


# -- sizes -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "most"),
    [("int8", 0.264), ("int8:64", 0.267), ("int4", 0.150), ("int4:64", 0.142), ("fp8", 0.258)],
)
def test_stored_size_of_a_chunk(spec, most):
    """Codes + scales + zeros of a 256-token chunk past the first (no sink), relative to float32."""
    x = kv(heads=3, n=256, dim=64)
    total = 0
    for role in ("keys", "values"):
        parts = get_codec(spec).quantizer.encode(role, x, 256)
        total += sum(t.numel() * t.element_size() for _, t in parts)
    assert total / (2 * x.numel() * 4) <= most


# -- specs and identity ----------------------------------------------------------------------------
def test_specs():
    assert get_codec("int8").spec == "int8:128/64" and get_codec("int4").spec == "int4:32/64"
    assert get_codec("int4:64").spec == "int4:64" and get_codec("int8:32/32").spec == "int8:32"
    assert get_codec("int8+zstd").spec == "int8:128/64+zstd:3" and get_codec("fp8").spec == "fp8"
    for spec, identity in (("int8", "int8:128/64"), ("int4:64+zstd", "int4:64"), ("fp8+zstd-shuffle:1", "fp8")):
        c = get_codec(spec)
        assert not c.lossless and c.identity == identity
    for spec in ("raw", "zstd:3", "zstd-shuffle:1"):
        assert get_codec(spec).lossless and get_codec(spec).identity == ""
    for bad in ("int8:48", "int8:1", "int8:x", "int4:64/abc", "fp8:2", "int3", "zstd+int8", "int8+int4"):
        with pytest.raises(CodecError):
            get_codec(bad)


def test_lossy_codecs_seed_other_chains():
    ids = list(range(40))
    spans = [(0, 16), (16, 32), (32, 40)]
    keys = {
        spec: chain_keys(
            chain_seed("f" * 64, "float32", device="cpu", attn="sdpa", lossy=get_codec(spec).identity), ids, spans
        )
        for spec in ("raw", "zstd-shuffle:1", "int8", "int8:128", "int4", "fp8")
    }
    assert keys["raw"] == keys["zstd-shuffle:1"], "lossless codecs are interchangeable"
    lossy = [tuple(keys[s]) for s in ("int8", "int8:128", "int4", "fp8")]
    assert len(set(lossy) | {tuple(keys["raw"])}) == 5 and not set(sum(lossy, ())) & set(keys["raw"])


# -- entries ------------------------------------------------------------------------------------------
def entry(dtype=torch.float32, n=40, start=0) -> Entry:
    layers = tuple((kv(2, n, 8, dtype, seed=i), kv(2, n, 8, dtype, seed=10 + i)) for i in range(2))
    return Entry(
        "e" * 64,
        "f" * 64,
        "tiny",
        torch.arange(n),
        layers,
        1700000000.0,
        parent="" if start == 0 else "p" * 64,
        start=start,
    )


@pytest.mark.parametrize("spec", ["int8", "int4", "fp8", "int8+zstd:1", "int4+zstd-shuffle:1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entry_roundtrip(spec, dtype):
    e = entry(dtype)
    view = decode_entry(encode_entry(e, spec))
    assert view.header.codec["quant"]["name"] == spec.split(":")[0].split("+")[0]
    assert view.header.dtype == str(dtype).removeprefix("torch.")
    for (k, v), (rk, rv) in zip(e.layers, view.layers):
        for want, rec in ((k, rk), (v, rv)):
            got = rec.materialize()
            assert got.shape == want.shape and got.dtype == want.dtype
            assert float((got.float() - want.float()).abs().max()) < float(want.float().abs().max()) / 4
    assert view.token_ids() == list(range(40))


def _tampered(change) -> Codec:
    class Tampered(IntQuantizer):
        def encode(self, role, tensor, start=0):
            return change(super().encode(role, tensor, start))

    return Codec(Tampered(8, 64, 64), RawPacking())


def _set(parts, suffix, value):
    return [(s, value(t) if s == suffix else t) for s, t in parts]


HOSTILE = {
    "scales of the wrong shape": lambda p: _set(p, ".scales", lambda t: t[:, :-1]),
    "NaN scales": lambda p: _set(p, ".scales", lambda t: t.clone().fill_(float("nan"))),
    "zero scales": lambda p: _set(p, ".scales", torch.zeros_like),
    "negative scales": lambda p: _set(p, ".scales", lambda t: -t),
    "infinite zeros": lambda p: _set(p, ".zeros", lambda t: t.clone().fill_(float("inf"))),
    "float32 scales": lambda p: _set(p, ".scales", lambda t: t.float()),
    "codes too short": lambda p: _set(p, ".codes", lambda t: t[:, :-1]),
    "int8 codes": lambda p: _set(p, ".codes", lambda t: t.view(torch.int8)),
    "a long sink": lambda p: _set(p, ".sink", lambda t: torch.zeros(t.shape[0], 9, t.shape[2], dtype=t.dtype)),
    "no zeros": lambda p: [(s, t) for s, t in p if s != ".zeros"],
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_lossy_entries_are_rejected(name):
    blob = encode_entry(entry(), _tampered(HOSTILE[name]))
    with pytest.raises(CorruptEntryError) as err:
        decode_entry(blob)
    assert "\n" not in str(err.value)


def test_truncated_plane_is_rejected():
    blob = encode_entry(entry(), "int8+zstd-shuffle:1")
    header, payload = split(blob)
    frames = header["codec"]["frames"]
    index = next(i for i, (_, raw) in enumerate(frames) if raw == 2 * 36)  # a byte plane of values' scales
    short = zstandard.ZstdCompressor().compress(b"\0" * (frames[index][1] - 2))
    with pytest.raises(CorruptEntryError):
        decode_entry(with_frame(header, payload, index, short))


def test_quantized_entry_header_never_passes_for_lossless():
    """The header says the codec is lossy, so a lossless reader can tell (chains.fits checks it)."""
    view = decode_entry(encode_entry(entry(), "int8"))
    assert not get_codec(view.header.codec["quant"]["name"] + ":" + view.header.codec["quant"]["args"]).lossless


# -- golden: the lossy layouts are pinned ----------------------------------------------------------
GOLDEN_LOSSY = ("int8:64", "int4:32/64", "fp8")


golden_lossy = golden_quant_entry


@pytest.mark.parametrize("spec", GOLDEN_LOSSY)
def test_golden_lossy_entries(spec):
    file = GOLDEN / f"entry_v2_{spec.replace(':', '-').replace('/', '-')}.kvs"
    view = check_lossy_golden(GOLDEN / "format_v2_lossy.json", file, spec, golden_lossy, REGEN, "lossy layout")
    assert math.isclose(view.header.created, 1700000000.75)


@pytest.mark.parametrize("spec", ["int4", "fp8", "int8"])
def test_decodes_inside_and_outside_inference_mode(spec):
    """The per-thread scratch buffers, first allocated under inference mode, still serve a decode
    outside it (and the other way round). Run in a fresh thread: fresh scratch buffers."""
    import threading

    failures: list[BaseException] = []

    def work():
        try:
            x = kv(dtype=torch.bfloat16)
            q = get_codec(spec).quantizer
            reader = q.reader("keys", "t", records(q.encode("keys", x)), tuple(x.shape), x.dtype)
            with torch.inference_mode():
                a = reader.materialize()
            b = reader.materialize()
            with torch.inference_mode():
                c = reader.materialize()
            assert torch.equal(a, b) and torch.equal(b, c)
        except BaseException as exc:  # noqa: BLE001 - reported on the test's thread
            failures.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not failures, failures
