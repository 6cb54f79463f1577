"""``kvh`` (keys and values at bit widths of their own, exact sinks, an 8-bit tail): the bit planes,
every token row within the stated bound, sinks exact and tails 8-bit, device decoding equal to the
host's bit for bit with only codes and scales moving, the byte accounting, entries (format 7, which
a format-6 reader refuses), specs, the golden file, and the CLI (build, sync, sample)."""

from __future__ import annotations

import os

import pytest
import torch
from test_prerope import _context, keys_like, llama64, records  # noqa: F401 (fixture)

from helpers.entries import check_lossy_golden, golden_quant_entry, lossy_facts
from helpers.paths import GOLDEN
from kvstore.errors import CodecError, CorruptEntryError, FormatVersionError
from kvstore.store.codecs import get_codec
from kvstore.store.codecs.asym import AsymQuantizer, sink_tokens
from kvstore.store.codecs.planes import pack, planes, unpack_into
from kvstore.store.codecs.quant import IntQuantizer
from kvstore.store.entry import Entry, decode_entry, encode_entry
from kvstore.store.kvstore import KVStore

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"
GOLDEN_SPEC = "kvh:6/3:16/8:s=2:t=8"  # planes 4+2 and 2+1, rotated, a tail, two sinks


def quantizer(spec: str = "kvh") -> AsymQuantizer:
    q = get_codec(spec).quantizer
    assert isinstance(q, AsymQuantizer)
    return q


def roundtrip(q, role, x, start=0, positions=None):
    parts = q.encode(role, x, start, positions)
    reader = q.reader(role, "t", records(parts), tuple(x.shape), x.dtype, start=start, positions=positions)
    return dict(parts), reader.materialize()


# -- the bit planes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(2, 9))
def test_codes_of_every_width_round_trip_through_their_planes(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 11, 64), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 11, bits * 64 // 8) and packed.dtype == torch.uint8
    assert sum(planes(bits)) == bits
    work = torch.empty(codes.shape, dtype=torch.float32)
    unpack_into(packed, bits, work, None)
    assert torch.equal(work, codes.float())
    if bits == 4:  # the 4-bit plane is int4's nibble layout
        assert torch.equal(packed, codes[..., :32] | (codes[..., 32:] << 4))


def test_a_head_dim_the_planes_cannot_split_is_refused_in_one_line():
    with pytest.raises(CodecError, match="divisible by 8") as exc:
        quantizer("kvh:5/4").encode("keys", torch.randn(2, 10, 12))
    assert "\n" not in str(exc.value)
    quantizer("kvh:6/4:32/4").encode("values", torch.randn(2, 10, 12))  # 4 + 2 bits: 12 channels split


# -- the bound, the sinks, the tail ----------------------------------------------------------------------
def _steps(scales: torch.Tensor, role: str, m: int, group: int) -> torch.Tensor:
    s = scales.double()
    s, _ = IntQuantizer._expand(role, s, s, (s.shape[0], m, 64), group)
    return s


@pytest.mark.parametrize(
    "spec", ["kvh", "kvh:8/5", "kvh:5/3:64/32", "kvh:4/4:32/16:s=16:t=40", "kvh:7/2:s=0:t=8", "kvh:6/4:h=0"]
)
@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("start", [0, 10, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_token_row_within_the_stated_bound(spec, role, start, dtype):
    """The sinks (the context's first S tokens in the chunk) are exact; a body row is off by at most
    sqrt(sum_j (step_j / 2)^2) (rotated: H is orthogonal; not rotated: each element within half its
    step); the tail's rows by int8's steps, far finer."""
    q = quantizer(spec)
    g = torch.Generator().manual_seed(start)
    x = torch.randn(3, 150, 64, dtype=dtype, generator=g) * torch.linspace(0.2, 4, 64, dtype=dtype) + 1
    parts, y = roundtrip(q, role, x, start)
    k = max(0, min(q.sinks - start, 150))
    t = min(q.tail, 150 - k)
    assert parts[".sink"].shape == (3, k, 64) and torch.equal(y[:, :k], x[:, :k])
    slack = 1e-6 * float(x.abs().max())  # float32 arithmetic (the codes are made from float32, for float64 too)
    sections = [(k, 150 - t, "", q.widths[role])] + ([(150 - t, 150, ".tail", q.tail_widths[role])] if t else [])
    for lo, hi, prefix, width in sections:
        g = width.group_for(role, 64)
        step = _steps(parts[prefix + ".scales"], role, hi - lo, g)
        err = (y[:, lo:hi].double() - x[:, lo:hi].double()).square()
        bound = (step / 2).square()
        if width.rotated:
            err, bound = err.sum(-1), bound.sum(-1)
        assert bool((err.sqrt() <= bound.sqrt() * (1 + slack) + slack).all()), (prefix, float((err - bound).max()))
    assert (".tail.codes" in parts) == bool(q.tail)


def test_the_tail_is_8_bit_and_closer_than_the_body():
    x = torch.randn(3, 200, 64)
    parts, y = roundtrip(quantizer("kvh:8/3:t=50"), "values", x, 0)
    assert parts[".tail.codes"].shape == (3, 50, 64) and parts[".codes"].shape == (3, 146, 24)
    body, tail = (y - x)[:, 4:150].abs().mean(), (y - x)[:, 150:].abs().mean()
    assert float(tail) * 10 < float(body)


def test_sinks_follow_the_positions_of_a_pressed_cache():
    assert sink_tokens(16, 40, 0) == 16 and sink_tokens(16, 40, 10) == 6 and sink_tokens(16, 40, 16) == 0
    assert sink_tokens(4, 2, 0) == 2 and sink_tokens(0, 40, 0) == 0
    pos = torch.tensor([0, 3, 9, 17, 30, 31])
    assert sink_tokens(16, 6, positions=pos) == 3 and sink_tokens(4, 6, positions=pos) == 2
    x = torch.randn(2, 6, 64)
    parts, y = roundtrip(quantizer("kvh:8/4:s=16"), "keys", x, positions=pos)
    assert parts[".sink"].shape[1] == 3 and torch.equal(y[:, :3], x[:, :3]) and not torch.equal(y[:, 3:], x[:, 3:])


def test_a_chunk_of_sinks_and_tail_only():
    x = torch.randn(3, 10, 64)
    parts, y = roundtrip(quantizer("kvh:8/4:s=4:t=20"), "values", x, 0)
    assert parts[".codes"].shape == (3, 0, 32) and parts[".tail.codes"].shape == (3, 6, 64)
    assert torch.equal(y[:, :4], x[:, :4]) and float((y - x).abs().max()) < 0.05


# -- device decoding -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["kvh:6/3:16/8:s=2:t=8", "kvh:8/4:16/8:t=5", "kvh:5/4:16/8:h=0"])
@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("start", [0, 48])
def test_device_decoding_equals_the_hosts_bit_for_bit(spec, role, dtype, start):
    """The device branch (``stage=``, run on CPU through the staging bookkeeping) sends the uint8
    codes, scales, zeros and the sink, never float values of the quantized tokens, and gives the
    host's result bit for bit."""
    from helpers.entries import bits, decode_host_and_staged

    q = quantizer(spec)
    x = keys_like(n=70, dtype=dtype, start=start)
    parts = q.encode(role, x, start)
    reader = q.reader(role, "t", records(parts), tuple(x.shape), dtype, start=start)
    assert reader.device_decode
    host, dev, st, uploaded = decode_host_and_staged(reader, dtype)
    assert torch.equal(bits(dev), bits(host)), "device branch differs from the host's decoding"
    assert st.counts["device_decoded"] == 1 and st.counts["records"] == 0
    k = max(0, q.sinks - start)
    m = 70 - k - q.tail
    assert (3, m, q.widths[role].bits * 2) in [s for s, d in uploaded if d == torch.uint8], "codes go up as uint8"
    assert not any(s[1] == m and s[2] == 16 and d.is_floating_point for s, d in uploaded), "no float values"
    assert torch.isnan(dev[1, :, :7]).all() and torch.isnan(dev[1, :, 77:]).all() and torch.isnan(dev[0]).all()
    assert not torch.isnan(dev[1, :, 7:77]).any()


# -- bytes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["kvh", "kvh:8/5", "kvh:5/3:64/32", "kvh:6/4:32/16", "kvh:8/4:t=64"])
def test_bits_per_value_is_the_stored_bytes(spec):
    """Raw bytes per element over whole groups and a 512-token chunk without sinks (the accounting
    bits_per_value states) equal its figure."""
    q = quantizer(spec)
    x = torch.randn(2, 512, 64)
    stored = sum(t.numel() * t.element_size() for role in ("keys", "values") for _, t in q.encode(role, x, start=512))
    assert stored * 8 / (2 * x.numel()) == pytest.approx(q.bits_per_value(64, 32))


def test_mixed_int4h_counts_its_8_bit_layers():
    plain, mixed = get_codec("int4h").quantizer, get_codec("int4h:k8=0.1.2:v8=5").quantizer
    assert mixed.bits_per_value(64, 32, n_layers=30) == pytest.approx(plain.bits_per_value(64, 32) + 4 * 4 / 60)
    assert mixed.bits_per_value(64, 32, n_layers=3) == pytest.approx(plain.bits_per_value(64, 32) + 4 * 3 / 6)
    assert plain.bits_per_value(64, 32, n_layers=30) == plain.bits_per_value(64, 32) == 4.75
    with pytest.raises(CodecError, match="layer count"):
        mixed.bits_per_value(64, 32)


def test_size_estimates_use_the_mixed_bits():
    from kvstore.size.estimate import ModelShape, estimate_size

    shape = ModelShape(name="m", n_layers=30, kv_heads=3, head_dim=64)
    (plain,) = estimate_size([shape], codec="int4h")
    (mixed,) = estimate_size([shape], codec="int4h:k8=" + ".".join(map(str, range(30))))
    assert plain.bits_per_value == 4.75 and mixed.bits_per_value == pytest.approx(4.75 + 2)
    (kvh,) = estimate_size([shape], codec="kvh:8/4")
    assert kvh.bits_per_value == pytest.approx(6.625)


# -- specs and entries -------------------------------------------------------------------------------------
def test_specs_keys_and_the_default_packing():
    assert get_codec("kvh").spec == "kvh:8/4:128/32+zstd:1" and get_codec("kvh").identity == "kvh:8/4:128/32"
    assert get_codec("kvh:8/5").spec == "kvh:8/5:128/64+zstd:1" and get_codec("kvh:5/3").spec == "kvh:5/3:32/32+zstd:1"
    assert get_codec("kvh:8/4:t=64:s=16").spec == "kvh:8/4:128/32:s=16:t=64+zstd:1"
    assert get_codec("kvh:8/4:64").spec == "kvh:8/4:64/64+zstd:1"
    assert get_codec("kvh:8/4:s=4").spec == "kvh:8/4:128/32+zstd:1"
    assert get_codec("kvh+raw").identity == get_codec("kvh").identity != get_codec("kvh:8/4:t=1").identity
    assert get_codec("kvh").entry_format == 7 and get_codec("int4h").entry_format == 6
    assert (
        get_codec("kvh:8/4:h=0").spec == "kvh:8/4:128/32:h=0+zstd:1"
        and get_codec("kvh:8/4:h=1").spec == "kvh:8/4:128/32+zstd:1"
    )
    assert not get_codec("kvh:5/4:h=0").quantizer.widths["values"].rotated
    for spec in ("kvh:6/3:16/8:s=2:t=8", "kvh:8/4:128/32:s=0", "kvh:6/4:h=0:k8=1"):
        assert get_codec(get_codec(spec).spec).spec == get_codec(spec).spec
    for bad in ("kvh:9/4", "kvh:8", "kvh:1/4", "kvh:8/4:3", "kvh:8/4:x", "kvh:8/4:s=1:s=2", "kvh:8/4:u=1",
                "kvh:s=1:8/4", "kvh:8/4:1/2/3", "kvh:8/4:t=5000", "kvh:8/4:t=-1", "kvh:8/4:32/64:16/16",
                "kvh:8/4:h=2"):  # fmt: skip
        with pytest.raises(CodecError) as exc:
            get_codec(bad)
        assert "\n" not in str(exc.value), bad


def _entry(start: int = 0) -> Entry:
    layers = tuple((keys_like(n=40, dtype=torch.float32, seed=i, start=start), keys_like(n=40, seed=9 + i).float())
                   for i in range(2))  # fmt: skip
    return Entry("a" * 64, "b" * 64, "m", torch.arange(40), layers, 1700000000.0, parent="" if start == 0 else "7" * 64,
                 start=start)  # fmt: skip


@pytest.mark.parametrize("spec", ["kvh", "kvh:5/3:16/8:t=8", "kvh+raw"])
@pytest.mark.parametrize("start", [0, 700])
def test_entry_roundtrip(spec, start):
    e = _entry(start)
    view = decode_entry(encode_entry(e, spec))
    assert view.header.codec["quant"]["name"] == "kvh" and view.header.format == 7 and not view.header.lossless
    for (k, v), (rk, rv) in zip(e.layers, view.layers):
        assert float((rk.materialize() - k).abs().max()) < float(k.abs().max()) / 4
        assert float((rv.materialize() - v).abs().max()) < float(v.abs().max()) / 4


def test_kvh_writes_format_7_which_a_format_6_reader_refuses(monkeypatch):
    """A kvstore of entry format 6 does not know kvh: the entry says format 7, so it refuses it
    ("upgrade kvstore") instead of taking it for corrupt and overwriting it."""
    from kvstore.store import frame as header_mod

    blob = encode_entry(_entry(), "kvh")
    monkeypatch.setattr(header_mod, "FORMAT_VERSION", 6)
    with pytest.raises(FormatVersionError, match="format version 7; this kvstore reads up to 6 - upgrade kvstore"):
        decode_entry(blob)


@pytest.mark.parametrize(
    ("part", "shape"),
    [(".codes", (3, 20, 32)), (".tail.codes", (3, 9, 16)), (".sink", (3, 3, 16)), (".scales", (3, 20, 2))],
)
def test_parts_that_do_not_fit_are_corrupt(part, shape):
    q = quantizer("kvh:6/3:16/8:s=2:t=8")
    x = keys_like(n=40, dtype=torch.float32)
    parts = dict(q.encode("values", x, 0))
    parts[part] = torch.zeros(shape, dtype=parts[part].dtype)
    with pytest.raises(CorruptEntryError):
        q.reader("values", "t", records(parts.items()), tuple(x.shape), x.dtype)


# -- golden ------------------------------------------------------------------------------------------------
def test_golden_kvh_entry():
    check_lossy_golden(GOLDEN / "format_v7_kvh.json", GOLDEN / "entry_v7_kvh.kvs", GOLDEN_SPEC, golden_quant_entry,
                       REGEN, "kvh layout")  # fmt: skip
    assert lossy_facts(golden_quant_entry(GOLDEN_SPEC))["header"]["format"] == 7


# -- models and the CLI ------------------------------------------------------------------------------------
def test_a_lossless_request_never_reads_kvh_entries(llama64, tmp_path):  # noqa: F811
    ids = _context(llama64, 40)
    with KVStore(str(tmp_path / "s"), codec="kvh:8/4:t=8", chunk_tokens=16) as store:
        llama64.generate_kv_cache([ids], store)
    for other in ("raw", "int8", "kvh", "int4h"):
        with KVStore(str(tmp_path / "s"), codec=other) as store:
            res = llama64.greedy_sample([ids], [[5, 6]], 2, store=store, return_details=True)
            assert not res.cache_hit[0] and res.cached_tokens[0] == 0, other
    with KVStore(str(tmp_path / "s"), codec="kvh:8/4:t=8+raw", readonly=True) as store:
        res = llama64.greedy_sample([ids], [[5, 6]], 2, store=store, return_details=True)
        assert res.cache_hit[0]


def test_cli_build_sample_verify_and_sync_under_kvh(tiny_llama_dir, tmp_path, capsys):
    """``build --codec kvh:...`` stores entries ``sample`` answers from without computing; ``verify``
    finds them intact; ``sync --codec`` converts a lossless store without the model."""
    import json

    from helpers.cli import run_main, write_dataset

    spec = "kvh:6/4:t=4:s=2"
    data = write_dataset(tmp_path / "qa.jsonl", range(3), questions=2)
    common = ["--model", tiny_llama_dir, "--quiet", "--format", "json", "--no-chat"]
    store, plain, converted = tmp_path / "kvh", tmp_path / "plain", tmp_path / "converted"

    def ok(*args):
        code, out, err = run_main(capsys, *args)
        assert code == 0, err
        return json.loads(out) if out.lstrip().startswith("{") else out

    built = ok("build", data, *common, "--store", store, "--codec", spec)
    assert built["codec"] == "kvh:6/4:32/32:s=2:t=4+zstd:1"
    got = ok("sample", data, *common, "--store", store, "--codec", spec, "-n", "3")
    assert got["prefill_tokens_computed"] == 0 and got["cache_hit_rate"] == 1
    assert "all intact" in ok("verify", "--store", store, "--quiet")
    ok("build", data, *common, "--store", plain)
    synced = ok("sync", plain, converted, "--codec", spec, "--quiet", "--format", "json")
    assert synced["converted"] == 3 and synced["codec"] == "kvh:6/4:32/32:s=2:t=4+zstd:1"
    again = ok("sample", data, *common, "--store", converted, "--codec", spec, "--readonly-store", "-n", "3")
    assert again["cache_hit_rate"] == 1


# -- per-layer widths ----------------------------------------------------------------------------------
def test_layer_widths_parse_print_and_count_in_the_bits():
    c = get_codec("kvh:6/4:v8=29.0:k8=1.0:k5=3")
    assert c.spec == "kvh:6/4:32/32:k8=0.1:k5=3:v8=0.29+zstd:1" and get_codec(c.spec).spec == c.spec
    assert c.identity != get_codec("kvh:6/4").identity
    q = c.quantizer
    assert q.width_of("keys", "layers.1.keys").bits == 8 and q.width_of("keys", "layers.2.keys").bits == 6
    assert q.width_of("values", "layers.29.heads.2.values").bits == 8 and q.width_of("values", "t").bits == 4
    base = get_codec("kvh:6/4").quantizer.bits_per_value(64, 32)
    k8, v8 = get_codec("kvh:8/4").quantizer, get_codec("kvh:6/8").quantizer
    k5 = get_codec("kvh:5/4").quantizer
    extra = [2 * (k8.bits_per_value(64, 32) - base), 2 * (v8.bits_per_value(64, 32) - base)]
    want = base + (sum(extra) + k5.bits_per_value(64, 32) - base) / 30  # 2 layers' keys and values, 1 layer's keys
    assert q.bits_per_value(64, 32, n_layers=30) == pytest.approx(want)
    with pytest.raises(CodecError, match="layer count"):
        q.bits_per_value(64, 32)
    for bad in ("kvh:8/4:k8=1:k5=1", "kvh:8/4:k9=1", "kvh:8/4:k8=", "kvh:8/4:k8=a", "kvh:8/4:k1=2", "kvh:8/4:x8=1"):
        with pytest.raises(CodecError) as exc:
            get_codec(bad)
        assert "\n" not in str(exc.value), bad


@pytest.mark.parametrize("start", [0, 700])
def test_listed_layers_are_stored_at_their_width(start):
    """Layer 1's keys at 8 bits (unrotated, int8 groups: far closer), layer 0's values at 3; every
    other tensor as the plain spec stores it; the header's spec is all decoding needs."""
    e = _entry(start)
    plain, mixed = decode_entry(encode_entry(e, "kvh:5/5")), decode_entry(encode_entry(e, "kvh:5/5:k8=1:v3=0"))
    assert mixed.header.codec["quant"] == {"name": "kvh", "args": "5/5:32/64:k8=1:v3=0"}
    for i, ((k, v), (pk, pv), (mk, mv)) in enumerate(zip(e.layers, plain.layers, mixed.layers)):
        kerr = [float((t.materialize() - k).abs().max()) for t in (pk, mk)]
        verr = [float((t.materialize() - v).abs().max()) for t in (pv, mv)]
        if i == 1:
            assert kerr[1] * 2 < kerr[0] and torch.equal(pv.materialize(), mv.materialize())
        else:
            assert verr[1] > 2 * verr[0] and torch.equal(pk.materialize(), mk.materialize())
