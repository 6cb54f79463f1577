"""``ecq`` (entropy-coded quantization): every element within the stated bound (half a step before the
rotation, ``sqrt(2)/2`` of a step after it), keys re-rotated at their chunk's positions (past a
chunk boundary, after a partial hit: tests/store/test_prerope.py), codes that never clip, entropy
coding that makes it smaller than int4r for the same data, specs, header checks, format 4 (an older
reader refuses it) and a golden file."""

from __future__ import annotations

import os

import pytest
import torch
from test_prerope import ROTARIES, _context, entry, keys_like, llama64, records  # noqa: F401 (fixture)
from test_prerope import ecq_bound as bound

from helpers.entries import assemble, check_lossy_golden, golden_rotary_entry, lossy_facts, split
from helpers.paths import GOLDEN
from kvstore.errors import CodecError, CorruptEntryError, FormatVersionError
from kvstore.store.codecs import get_codec
from kvstore.store.codecs.entropy import CODE_MAX, EntropyQuantizer
from kvstore.store.codecs.prerope import Rotary, needs_rotary
from kvstore.store.codecs.quant import SINK_TOKENS
from kvstore.store.entry import Entry, decode_entry, encode_entry
from kvstore.store.kvstore import KVStore

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"


def quantizer(spec: str = "ecq", rotary: Rotary = ROTARIES["full"]) -> EntropyQuantizer:
    q = get_codec(spec).quantizer
    assert isinstance(q, EntropyQuantizer)
    return q.with_rotary(rotary)


def roundtrip(q, role, x, start):
    parts = q.encode(role, x, start)
    return dict(parts), q.reader(role, "t", records(parts), tuple(x.shape), x.dtype, start=start).materialize()


@pytest.mark.parametrize("spec", ["ecq", "ecq:0.05", "ecq:0.5/0.1"])
@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("which", list(ROTARIES))
@pytest.mark.parametrize("start", [0, 512, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_element_within_the_stated_bound(spec, role, which, start, dtype):
    rotary = ROTARIES[which]
    q = quantizer(spec, rotary)
    x = keys_like(dtype=dtype, start=start, rotary=rotary)
    parts, y = roundtrip(q, role, x, start)
    k = parts[".sink"].shape[1]
    assert k == (SINK_TOKENS if start == 0 else 0)
    assert y.dtype == dtype and torch.equal(y[:, :k], x[:, :k]), "the sink keeps the model's tensors"
    err = (y[:, k:].double() - x[:, k:].double()).abs()
    b = bound(parts, err.shape, rotary if role == "keys" else None)
    slack = (1e-6 if dtype == torch.float32 else 1e-12) * float(x.abs().max())
    assert bool((err <= b * (1 + 1e-6) + slack).all()), float((err / b).max())
    codes = parts[".codes"]
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= CODE_MAX
    # one step per head: the spec's fraction of the head's spread, unless the widest element needs more
    s = q.step_k if role == "keys" else q.step_v
    assert bool((parts[".steps"] >= 0).all()) and parts[".steps"].shape == (x.shape[0], 1, 1)
    dev = x[:, k:].double() if role == "values" else None
    if dev is not None:
        spread = (dev - parts[".offsets"].double()).square().mean(dim=(1, 2)).sqrt()
        widest = (dev - parts[".offsets"].double()).abs().amax(dim=(1, 2))
        want = torch.maximum(spread * s, widest / CODE_MAX)
        assert torch.allclose(parts[".steps"].double().flatten(), want, rtol=1e-5)


def test_keys_at_the_wrong_positions_are_far_off():
    """Decoding at another start (a position bookkeeping bug) breaks the bound: the test above can fail."""
    q = quantizer()
    x = keys_like(start=512)
    parts = q.encode("keys", x, 512)
    y = q.reader("keys", "t", records(parts), tuple(x.shape), x.dtype, start=0).materialize()
    assert bool(((y - x).abs() > bound(dict(parts), x.shape, ROTARIES["full"]) * 2).any())


def test_an_outlier_raises_the_step_instead_of_clipping():
    q = quantizer("ecq:0.01")
    x = keys_like(dtype=torch.float32, start=64)
    x[1, 40, 5] = 1e4
    parts, y = roundtrip(q, "values", x, 64)
    assert int(parts[".codes"].abs().max()) == CODE_MAX
    assert float((y - x).abs().max()) <= float(parts[".steps"].max()) / 2 * (1 + 1e-6) + 1e-3


def test_float64_models_keep_float64_precision():
    """A head whose spread float32 cannot resolve (1000 + 1e-7 noise) still decodes within half its step."""
    g = torch.Generator().manual_seed(3)
    x = 1000 + 1e-7 * torch.randn(2, 50, 16, generator=g, dtype=torch.float64)
    parts, y = roundtrip(quantizer(), "values", x, 8)
    assert float(parts[".steps"].min()) > 1e-10
    assert bool(((y - x).abs() <= parts[".steps"].double() / 2 * (1 + 1e-6)).all())


def test_huge_values_give_a_finite_step():
    x = keys_like(dtype=torch.float32, start=8) * 1e20
    parts, y = roundtrip(quantizer(), "values", x, 8)
    assert bool(torch.isfinite(parts[".steps"]).all()) and bool(torch.isfinite(y).all())
    assert bool(((y - x).abs() <= parts[".steps"] / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("start", [0, 48])
def test_device_decoding_equals_the_hosts_bit_for_bit(monkeypatch, role, dtype, start):
    """The device branch (``stage=``, run on CPU through the staging bookkeeping) sends the int8
    codes, offsets and steps, never float values, and gives the host's result bit for bit."""
    from helpers.entries import bits, decode_host_and_staged

    q = quantizer()
    x = keys_like(n=70, dtype=dtype, start=start)
    parts = q.encode(role, x, start)
    reader = q.reader(role, "t", records(parts), tuple(x.shape), dtype, start=start)
    assert reader.device_decode
    host, dev, st, uploaded = decode_host_and_staged(reader, dtype)
    assert torch.equal(bits(dev), bits(host)), "device branch differs from the host's decoding"
    assert st.counts["device_decoded"] == 1 and st.counts["records"] == 0
    k = SINK_TOKENS if start == 0 else 0
    assert (x.shape[0], 70 - k, 16) in [s for s, d in uploaded if d == torch.int8], "codes go up as int8"
    assert not any(s[1] == 70 - k and s[2] == 16 and d.is_floating_point for s, d in uploaded), "no float values"
    assert torch.isnan(dev[1, :, :7]).all() and torch.isnan(dev[1, :, 77:]).all() and torch.isnan(dev[0]).all()


def test_a_chunk_of_sink_tokens_only():
    q = quantizer()
    x = keys_like(n=3, dtype=torch.float32)
    parts, y = roundtrip(q, "keys", x, 0)
    assert parts[".codes"].shape == (3, 0, 16) and torch.equal(y, x)


# -- entries ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["ecq", "ecq:0.1/0.3", "ecq+zstd-shuffle:1", "ecq+raw"])
@pytest.mark.parametrize("start", [0, 700])
def test_entry_roundtrip_needs_no_model(spec, start):
    e = entry(start=start)
    view = decode_entry(encode_entry(e, spec))
    quant = view.header.codec["quant"]
    assert quant["name"] == "ecq" and view.header.format == 4 and not view.header.lossless
    assert quant["rotary"] == {"inv_freq": list(ROTARIES["full"].inv_freq), "layout": "half"}
    for (k, v), (rk, rv) in zip(e.layers, view.layers):
        assert float((rk.materialize() - k).abs().max()) < float(k.abs().max()) / 8
        assert float((rv.materialize() - v).abs().max()) < float(v.abs().max()) / 8


def test_entropy_coding_makes_it_smaller_than_int4r_and_closer():
    """On keys and values with steady channels of different widths, ``ecq`` (default step, codes
    compressed by zstd) stores fewer bytes than ``int4r`` and decodes closer to the exact tensors."""
    layers = tuple(
        (keys_like(n=256, dtype=torch.float32, seed=i, start=0), keys_like(n=256, dtype=torch.float32, seed=7 + i))
        for i in range(2)
    )  # fmt: skip
    e = Entry("a" * 64, "b" * 64, "m", torch.arange(256), layers, 1700000000.0, rotary=ROTARIES["full"])
    raw = sum(2 * k.numel() * 4 for k, _ in layers)
    sizes, errors = {}, {}
    for spec in ("ecq", "int4r+zstd:1", "ecq+raw"):
        blob = encode_entry(e, spec)
        sizes[spec] = len(blob) / raw
        got = decode_entry(blob).layers
        errors[spec] = sum(float((g[j].materialize() - x[j]).square().mean()) for g, x in zip(got, layers)
                           for j in (0, 1))  # fmt: skip
    assert sizes["ecq"] < sizes["int4r+zstd:1"] and errors["ecq"] < errors["int4r+zstd:1"], (sizes, errors)
    assert sizes["ecq+raw"] > 0.25, "int8 codes take a byte each until the packing entropy codes them"


def test_specs_keys_and_the_default_packing():
    assert get_codec("ecq").spec == "ecq:0.18+zstd:1" and get_codec("ecq").identity == "ecq:0.18"
    assert get_codec("ecq:0.2/0.1").spec == "ecq:0.2/0.1+zstd:1"
    assert get_codec("ecq:0.25+zstd-shuffle:1").spec == "ecq:0.25+zstd-shuffle:1"
    assert get_codec("ecq+raw").spec == "ecq:0.18+raw" and get_codec(get_codec("ecq+raw").spec).packing.name == "raw"
    # the step the keys name is the step encoded: no digits beyond the spec's
    assert (
        get_codec("ecq:0.1234567").quantizer.step_k == 0.123457 and get_codec("ecq:0.18000004").identity == "ecq:0.18"
    )
    assert get_codec("ecq:0.18").identity == get_codec("ecq+raw").identity != get_codec("ecq:0.2").identity
    assert needs_rotary(get_codec("ecq")) and not get_codec("ecq").lossless
    for bad in ("ecq:0", "ecq:x", "ecq:9", "ecq:0.1/", "ecq:nan"):
        with pytest.raises(CodecError):
            get_codec(bad)


def test_ecq_writes_format_4_which_a_format_3_reader_refuses(monkeypatch):
    """The previous release (entry format 3) does not know ecq: the entry says format 4, so it
    refuses it ("upgrade kvstore") instead of taking it for corrupt and overwriting it."""
    from kvstore.store import frame as header_mod

    assert get_codec("ecq").entry_format == 4 and get_codec("int4r").entry_format == 3
    blob = encode_entry(entry(), "ecq")
    monkeypatch.setattr(header_mod, "FORMAT_VERSION", 3)
    with pytest.raises(FormatVersionError, match="format version 4; this kvstore reads up to 3 - upgrade kvstore"):
        decode_entry(blob)


@pytest.mark.parametrize(
    "change",
    [lambda q: q.update(args="0"), lambda q: q.update(args="fast"), lambda q: q.pop("rotary")],
)
def test_a_header_with_bad_quant_params_is_corrupt(change):
    header, payload = split(encode_entry(entry(), "ecq"))
    change(header["codec"]["quant"])
    with pytest.raises(CorruptEntryError) as err:
        decode_entry(assemble(header, payload))
    assert "\n" not in str(err.value)


def test_steps_that_are_not_positive_are_corrupt():
    q = quantizer()
    x = keys_like(dtype=torch.float32)
    parts = dict(q.encode("values", x, 0))
    parts[".steps"] = parts[".steps"] * 0
    with pytest.raises(CorruptEntryError):
        q.reader("values", "t", records(parts.items()), tuple(x.shape), x.dtype)


# -- models ----------------------------------------------------------------------------------------
# (chunks past a boundary and after a partial hit, and the CLI: tests/store/test_prerope.py, with int4r/int8r)
def test_a_lossless_request_never_reads_ecq_entries(llama64, tmp_path):  # noqa: F811
    ids = _context(llama64, 40)
    with KVStore(str(tmp_path / "s"), codec="ecq", chunk_tokens=16) as store:
        llama64.generate_kv_cache([ids], store)
    with KVStore(str(tmp_path / "s"), codec="raw") as store:
        res = llama64.greedy_sample([ids], [[5, 6]], 2, store=store, return_details=True)
        assert not res.cache_hit[0] and res.cached_tokens[0] == 0


# -- golden ----------------------------------------------------------------------------------------
golden_entry = golden_rotary_entry


def test_golden_ecq_entry():
    check_lossy_golden(GOLDEN / "format_v4_ecq.json", GOLDEN / "entry_v4_ecq.kvs", "ecq", golden_entry, REGEN,
                       "ecq layout")  # fmt: skip
    assert lossy_facts(golden_entry("ecq"))["header"]["format"] == 4


@pytest.mark.parametrize("spec", ["ecq", "int4r"])
def test_a_start_past_any_context_is_corrupt(spec):
    """The rotation computes angles from positions, which float64 stops counting exactly past 2**53:
    an entry claiming to end past MAX_POSITION (a trillion tokens) is refused as corrupt, in the
    header and the payload alike (not a RuntimeError or OverflowError from the angles)."""
    from kvstore.store.header import MAX_POSITION

    blob = encode_entry(entry(start=MAX_POSITION), spec)
    with pytest.raises(CorruptEntryError, match="start"):
        decode_entry(blob)
    decode_entry(encode_entry(entry(start=MAX_POSITION - 40), spec))  # the last chunk that fits
