"""``int4h`` (int4 codes of Hadamard-rotated keys and values): the transform (orthogonal, symmetric,
block-diagonal where head_dim is not a power of two), every token row within the stated bound, the
rotation spreading an outlier channel (closer than int4 on such keys), device decoding equal to the
host's bit for bit with only codes and scales moving, entries (format 6, which a format-5 reader
refuses), specs, the golden file, and a lossless request never answered from int4h entries."""

from __future__ import annotations

import math
import os

import pytest
import torch
from test_prerope import _context, entry, keys_like, llama64, records  # noqa: F401 (fixture)

from helpers.entries import check_lossy_golden, golden_rotary_entry, lossy_facts
from helpers.paths import GOLDEN
from kvstore.errors import CodecError, CorruptEntryError, FormatVersionError
from kvstore.store.codecs import get_codec
from kvstore.store.codecs.hadamard import HadamardQuantizer, hadamard, hadamard_block
from kvstore.store.codecs.quant import SINK_TOKENS, IntQuantizer
from kvstore.store.entry import decode_entry, encode_entry
from kvstore.store.kvstore import KVStore

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"


def quantizer(spec: str = "int4h") -> HadamardQuantizer:
    q = get_codec(spec).quantizer
    assert isinstance(q, HadamardQuantizer)
    return q


def roundtrip(q, role, x, start=0):
    parts = q.encode(role, x, start)
    return dict(parts), q.reader(role, "t", records(parts), tuple(x.shape), x.dtype, start=start).materialize()


@pytest.mark.parametrize(("dim", "block"), [(2, 2), (16, 16), (64, 64), (128, 128), (80, 16), (96, 32), (6, 2)])
def test_the_transform_is_orthogonal_symmetric_and_blockwise(dim, block):
    h = hadamard(dim, torch.float64)
    assert hadamard_block(dim) == block
    assert torch.allclose(h @ h, torch.eye(dim, dtype=torch.float64), atol=1e-12) and torch.equal(h, h.T)
    assert torch.allclose(h.abs()[h != 0], torch.full((1,), 1 / math.sqrt(block), dtype=torch.float64))
    assert int((h != 0).sum()) == dim * block  # block-diagonal: each channel mixes with its block only


@pytest.mark.parametrize("dim", [2, 8, 16, 64, 80, 96, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_butterfly_is_the_matrix_product(dim, dtype):
    """hadamard_rotate (the fixed-order butterfly every encode and decode uses) is ``x @ H`` to within
    the rounding of log2(block) sums, and its own inverse."""
    from kvstore.store.codecs.hadamard import hadamard_rotate

    x = torch.randn(3, 40, dim, dtype=dtype, generator=torch.Generator().manual_seed(dim))
    eps = torch.finfo(dtype).eps * 8 * float(x.abs().max())
    assert torch.allclose(hadamard_rotate(x), x @ hadamard(dim, dtype), rtol=0, atol=eps)
    assert torch.allclose(hadamard_rotate(hadamard_rotate(x)), x, rtol=0, atol=eps)
    out = torch.empty_like(x)
    assert hadamard_rotate(x, out=out) is out and torch.equal(out, hadamard_rotate(x))


def test_an_odd_head_dim_is_refused_in_one_line():
    with pytest.raises(CodecError, match="even head_dim") as exc:
        quantizer().encode("keys", torch.randn(2, 10, 7))
    assert "\n" not in str(exc.value)


def _step(parts, role, shape, group):
    heads, m, dim = shape
    s = parts[".scales"].double()
    s, _ = IntQuantizer._expand(role, s, s, (heads, m, dim), group)
    return s


@pytest.mark.parametrize("spec", ["int4h", "int4h:16/16", "int4h:64/8"])
@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("dim", [16, 80])
@pytest.mark.parametrize("start", [0, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_token_row_within_the_stated_bound(spec, role, dim, start, dtype):
    """Each decoded token row is off by at most sqrt(sum_j (step_j / 2)^2) in Euclidean norm (H is
    orthogonal), the steps being those of its rotated elements; the sink tokens are exact."""
    q = quantizer(spec)
    x = keys_like(n=150, dim=dim, dtype=dtype, start=start) if dim == 16 else torch.randn(3, 150, dim, dtype=dtype) * 3
    if role == "values" and dim % min(q.group_v, dim):  # as int4: value groups must divide head_dim
        with pytest.raises(CodecError, match="does not divide head_dim"):
            q.encode(role, x, start)
        return
    parts, y = roundtrip(q, role, x, start)
    k = SINK_TOKENS if start == 0 else 0
    assert parts[".sink"].shape[1] == k and torch.equal(y[:, :k], x[:, :k])
    g = q.group_k if role == "keys" else min(q.group_v, dim)
    bound = (_step(parts, role, (3, 150 - k, dim), g) / 2).square().sum(-1).sqrt()
    err = (y[:, k:].double() - x[:, k:].double()).square().sum(-1).sqrt()
    slack = 1e-5 if dtype == torch.float32 else 1e-9
    assert bool((err <= bound * (1 + slack) + slack).all()), float((err - bound).max())
    # the codes describe the rotated tensor: read as plain int4 they are far from x
    plain = IntQuantizer(4, q.group_k, q.group_v).reader(role, "t", records(parts.items()), tuple(x.shape), x.dtype)
    assert float((plain.materialize() - x).abs().max()) > 10 * float((y - x).abs().max())


def test_the_rotation_spreads_an_outlier_channel():
    """Keys with one channel 30x wider than the rest (the shape of real keys' outliers): int4's
    per-group steps follow the wide channel; after the rotation no channel stands out and int4h's
    squared error is several times smaller, at the same stored bytes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, 64, generator=g)
    x[..., 5] = x[..., 5] * 30 + 10
    errs = {}
    for spec in ("int4h:32/64", "int4:32/64"):
        for role in ("keys", "values"):
            q = get_codec(spec).quantizer
            parts = q.encode(role, x, 0)
            y = q.reader(role, "t", records(parts), tuple(x.shape), x.dtype).materialize()
            errs[spec, role] = float((y - x).square().mean())
            assert sum(t.numel() * t.element_size() for _, t in parts) == sum(
                t.numel() * t.element_size() for _, t in get_codec("int4:32/64").quantizer.encode(role, x, 0)
            )
    assert errs["int4h:32/64", "values"] * 4 < errs["int4:32/64", "values"], errs
    assert errs["int4h:32/64", "keys"] < errs["int4:32/64", "keys"], errs


@pytest.mark.parametrize("role", ["keys", "values"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("start", [0, 48])
def test_device_decoding_equals_the_hosts_bit_for_bit(role, dtype, start):
    """The device branch (``stage=``, run on CPU through the staging bookkeeping) sends the uint8
    codes, scales and zeros, never float values of the tensor, and gives the host's result bit for bit."""
    from helpers.entries import bits, decode_host_and_staged

    q = quantizer("int4h:16/8")
    x = keys_like(n=70, dtype=dtype, start=start)
    parts = q.encode(role, x, start)
    reader = q.reader(role, "t", records(parts), tuple(x.shape), dtype, start=start)
    assert reader.device_decode
    host, dev, st, uploaded = decode_host_and_staged(reader, dtype)
    assert torch.equal(bits(dev), bits(host)), "device branch differs from the host's decoding"
    assert st.counts["device_decoded"] == 1 and st.counts["records"] == 0
    k = SINK_TOKENS if start == 0 else 0
    assert (x.shape[0], 70 - k, 8) in [s for s, d in uploaded if d == torch.uint8], "codes go up as uint8"
    assert not any(s[1] == 70 - k and s[2] == 16 and d.is_floating_point for s, d in uploaded), "no float values"
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    assert ((16, 16), wdt) not in uploaded, "the Hadamard matrix is made on the device once, never uploaded"
    assert torch.isnan(dev[1, :, :7]).all() and torch.isnan(dev[1, :, 77:]).all() and torch.isnan(dev[0]).all()
    assert not torch.isnan(dev[1, :, 7:77]).any()


def test_a_chunk_of_sink_tokens_only():
    x = keys_like(n=3, dtype=torch.float32)
    parts, y = roundtrip(quantizer(), "keys", x, 0)
    assert parts[".codes"].shape == (3, 0, 8) and torch.equal(y, x)


# -- entries ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["int4h", "int4h:16/8", "int4h+raw", "int4h+zstd-shuffle:1"])
@pytest.mark.parametrize("start", [0, 700])
def test_entry_roundtrip_needs_no_model(spec, start):
    e = entry(start=start, rotary=None)
    view = decode_entry(encode_entry(e, spec))
    quant = view.header.codec["quant"]
    assert quant["name"] == "int4h" and "rotary" not in quant and view.header.format == 6
    assert not view.header.lossless
    for (k, v), (rk, rv) in zip(e.layers, view.layers):
        assert float((rk.materialize() - k).abs().max()) < float(k.abs().max()) / 4
        assert float((rv.materialize() - v).abs().max()) < float(v.abs().max()) / 4


def test_specs_keys_and_the_default_packing():
    assert get_codec("int4h").spec == "int4h:32/64+zstd:1" and get_codec("int4h").identity == "int4h:32/64"
    assert get_codec("int4h:16").spec == "int4h:16+zstd:1" and get_codec("int4h+raw").spec == "int4h:32/64+raw"
    assert get_codec("int4h+raw").identity == get_codec("int4h").identity != get_codec("int4:32/64").identity
    assert get_codec("int4h").entry_format == 6 and get_codec("int4").entry_format == 2
    for bad in ("int4h:3", "int4h:x", "int4h:32/", "int4h:8192"):
        with pytest.raises(CodecError):
            get_codec(bad)


def test_int4h_writes_format_6_which_a_format_5_reader_refuses(monkeypatch):
    """A kvstore of entry format 5 does not know int4h: the entry says format 6, so it refuses it
    ("upgrade kvstore") instead of taking it for corrupt and overwriting it."""
    from kvstore.store import frame as header_mod

    blob = encode_entry(entry(rotary=None), "int4h")
    assert decode_entry(blob).header.format == 6
    monkeypatch.setattr(header_mod, "FORMAT_VERSION", 5)
    with pytest.raises(FormatVersionError, match="format version 6; this kvstore reads up to 5 - upgrade kvstore"):
        decode_entry(blob)


def test_an_odd_head_dim_in_a_header_is_corrupt():
    q = quantizer()
    parts = q.encode("keys", torch.randn(2, 10, 8), 0)
    with pytest.raises(CorruptEntryError):
        q.reader("keys", "t", records(parts), (2, 10, 7), torch.float32)


# -- models ----------------------------------------------------------------------------------------
def test_a_lossless_request_never_reads_int4h_entries(llama64, tmp_path):  # noqa: F811
    ids = _context(llama64, 40)
    with KVStore(str(tmp_path / "s"), codec="int4h", chunk_tokens=16) as store:
        llama64.generate_kv_cache([ids], store)
    for other in ("raw", "int4", "int4h:16"):
        with KVStore(str(tmp_path / "s"), codec=other) as store:
            res = llama64.greedy_sample([ids], [[5, 6]], 2, store=store, return_details=True)
            assert not res.cache_hit[0] and res.cached_tokens[0] == 0, other
    with KVStore(str(tmp_path / "s"), codec="int4h+raw", readonly=True) as store:  # same identity: a hit
        res = llama64.greedy_sample([ids], [[5, 6]], 2, store=store, return_details=True)
        assert res.cache_hit[0]


# -- golden ----------------------------------------------------------------------------------------
golden_entry = golden_rotary_entry


def test_golden_int4h_entry():
    check_lossy_golden(GOLDEN / "format_v6_int4h.json", GOLDEN / "entry_v6_int4h.kvs", "int4h", golden_entry, REGEN,
                       "int4h layout")  # fmt: skip
    assert lossy_facts(golden_entry("int4h"))["header"]["format"] == 6


# -- CLI: stacked with a press, verified, converted --------------------------------------------------
def test_cli_press_build_sample_verify_and_sync_under_int4h(tiny_llama_dir, tmp_path, capsys):
    """``build --press kvzip:0.75 --codec int4h`` stores pressed int4h entries that ``sample`` answers
    from without computing anything; ``verify`` finds them intact; ``sync --codec int4h`` converts a
    lossless store without the model (no rotary parameters needed); a lossless sample misses."""
    import json

    from helpers.cli import run_main, write_dataset

    data = write_dataset(tmp_path / "qa.jsonl", range(3), questions=2)
    common = ["--model", tiny_llama_dir, "--quiet", "--format", "json", "--no-chat"]
    store, plain, converted = tmp_path / "pressed", tmp_path / "plain", tmp_path / "converted"

    def ok(*args):
        code, out, err = run_main(capsys, *args)
        assert code == 0, err
        return json.loads(out) if out.lstrip().startswith("{") else out

    built = ok("build", data, *common, "--store", store, "--press", "kvzip:0.75", "--codec", "int4h")
    assert built["pressed_written"] == 3 and built["codec"] == "int4h:32/64+zstd:1"
    got = ok("sample", data, *common, "--store", store, "--press", "kvzip:0.75", "--codec", "int4h", "-n", "3")
    assert got["prefill_tokens_computed"] == 0 and got["scoring_tokens_computed"] == 0 and got["cache_hit_rate"] == 1
    with KVStore(str(store), readonly=True) as s:
        key = s.context_keys()[0]
        headers = []
        for dkey in s.derived_keys(key):
            with s.open_derived(key, dkey) as view:
                headers.append(view.header)
    (pressed,) = [h for h in headers if h.kind == "pressed"]
    assert pressed.codec_spec == "int4h:32/64+zstd:1" and pressed.identity == "int4h:32/64"
    assert "all intact" in ok("verify", "--store", store, "--quiet")
    lossless = ok("sample", data, *common, "--store", store, "--readonly-store", "-n", "3")
    assert lossless["cache_hit_rate"] == 0  # a lossless request never reads the int4h entries
    ok("build", data, *common, "--store", plain)
    synced = ok("sync", plain, converted, "--codec", "int4h", "--quiet", "--format", "json")
    assert synced["converted"] == 3 and synced["codec"] == "int4h:32/64+zstd:1"
    again = ok("sample", data, *common, "--store", converted, "--codec", "int4h", "--readonly-store", "-n", "3")
    assert again["cache_hit_rate"] == 1
    assert "all intact" in ok("verify", "--store", converted, "--quiet")


# -- mixed precision: 8-bit codes for the layers a spec lists -----------------------------------------
def test_mixed_specs_parse_and_plain_int4h_keeps_its_identity():
    c = get_codec("int4h:k8=23.21:v8=23")
    assert c.spec == "int4h:32/64:k8=21.23:v8=23+zstd:1" and c.identity == "int4h:32/64:k8=21.23:v8=23"
    assert get_codec(c.spec).spec == c.spec and get_codec("int4h:16:v8=1").spec == "int4h:16:v8=1+zstd:1"
    assert get_codec("int4h").identity == "int4h:32/64" != c.identity
    assert c.quantizer.params() == {"name": "int4h", "args": "32/64:k8=21.23:v8=23"}
    for bad in ("int4h:k8=", "int4h:k8=a", "int4h:k8=1.1", "int4h:k8=-1", "int4h:k8=1:k8=2", "int4h:32/64:x",
                "int4h:w8=1", "int4h:k8"):  # fmt: skip
        with pytest.raises(CodecError) as exc:
            get_codec(bad)
        assert "\n" not in str(exc.value), bad


@pytest.mark.parametrize("start", [0, 700])
def test_mixed_entries_store_the_listed_layers_in_8_bits(start):
    """Layer 1's keys and layer 0's values get 8-bit codes (read back far closer); every other tensor
    decodes exactly as plain ``int4h``'s; the header's spec is all decoding needs."""
    e = entry(start=start, rotary=None)
    plain_blob, mixed_blob = encode_entry(e, "int4h"), encode_entry(e, "int4h:k8=1:v8=0")
    plain, mixed = decode_entry(plain_blob), decode_entry(mixed_blob)
    assert mixed.header.codec["quant"] == {"name": "int4h", "args": "32/64:k8=1:v8=0"} and mixed.header.format == 6
    assert len(plain_blob) < len(mixed_blob)
    for i, ((k, v), (pk, pv), (mk, mv)) in enumerate(zip(e.layers, plain.layers, mixed.layers)):
        for x, p, m, wide in ((k, pk, mk, i == 1), (v, pv, mv, i == 0)):
            got, four = m.materialize(), p.materialize()
            if wide:
                assert float((got - x).abs().max()) * 8 < float((four - x).abs().max())
            else:
                assert torch.equal(got, four)


def test_a_reader_expecting_8_bit_codes_refuses_4_bit_ones():
    from kvstore.store.codecs.records import TensorRecord

    q = quantizer("int4h:k8=3")
    x = keys_like(n=40, dtype=torch.float32)
    recs = {}
    for suffix, t in q.encode_named("layers.2.keys", "keys", x):  # layer 2: 4-bit codes
        t = t.contiguous()
        recs["layers.3.keys" + suffix] = TensorRecord("layers.3.keys" + suffix, t.dtype, tuple(t.shape),
                                                      t.reshape(-1).view(torch.uint8))  # fmt: skip
    with pytest.raises(CorruptEntryError, match="codes"):
        q.reader("keys", "layers.3.keys", recs, tuple(x.shape), x.dtype)


def test_a_pressed_cache_gives_the_listed_layers_8_bits():
    """The pressed path names its tensors per head (``layers.L.heads.H.keys``): layer 1's keys 8-bit."""
    from test_derived import PRESS, facts, pressed

    from kvstore.store.kind_pressed import encode_pressed
    from kvstore.store.owned import decode_derived

    layers = pressed()
    views = {
        s: decode_derived(encode_pressed(facts(), "kvzip:0.75", PRESS, layers, s)[1]) for s in ("int4h", "int4h:k8=1")
    }
    assert views["int4h:k8=1"].header.codec_spec == "int4h:32/64:k8=1+zstd:1"
    k0, k1 = layers[0][0][0], layers[1][0][0]  # 3 and 40 kept tokens
    err = {
        s: [float((v.kv(i, 0)[0].materialize()[0] - k).abs().max()) for i, k in ((0, k0), (1, k1))]
        for s, v in views.items()
    }
    assert err["int4h:k8=1"][0] == err["int4h"][0] and err["int4h:k8=1"][1] * 8 < err["int4h"][1], err


def test_build_and_sync_refuse_a_layer_the_model_lacks(tiny_llama_dir, tmp_path, capsys):
    """``int4h:k8=L`` with ``L`` past the model's layers (2 here) is refused in one line naming the
    layer and the count, by ``build --codec`` (the model loaded) and ``sync --codec`` (the store's
    layer count), before anything is written; a layer it has is taken."""
    import json

    from helpers.cli import run_main, write_dataset
    from kvstore.store.codecs.hadamard import layer_refusal

    assert layer_refusal(get_codec("int4h:k8=1:v8=3.0"), 2) == (
        "int4h:32/64:k8=1:v8=0.3+zstd:1: v8= names layer 3, but the model has 2 layers (0 to 1)"
    )
    assert layer_refusal(get_codec("int4h:k8=1"), 2) is None and layer_refusal(get_codec("int8"), 1) is None
    data = write_dataset(tmp_path / "qa.jsonl", range(2), questions=1)
    common = ["--model", tiny_llama_dir, "--quiet", "--format", "json", "--no-chat"]
    store, plain, converted = tmp_path / "mixed", tmp_path / "plain", tmp_path / "converted"
    code, _, err = run_main(capsys, "build", data, *common, "--store", store, "--codec", "int4h:k8=2")
    assert code == 1 and err.count("\n") == 1 and "names layer 2, but the model has 2 layers (0 to 1)" in err
    code, out, err = run_main(capsys, "build", data, *common, "--store", store, "--codec", "int4h:k8=1")
    assert code == 0, err
    code, out, err = run_main(capsys, "build", data, *common, "--store", plain)
    assert code == 0, err
    for dry in ([], ["--dry-run"]):
        code, _, err = run_main(capsys, "sync", plain, converted, "--codec", "int4h:v8=0.7", "--quiet", *dry)
        assert code == 1 and err.count("\n") == 1 and "names layer 7, but the model has 2 layers (0 to 1)" in err
    with KVStore(str(converted)) as s:
        assert s.context_keys() == []  # nothing written
    code, out, err = run_main(capsys, "sync", plain, converted, "--codec", "int4h:v8=1", "--quiet", "--format", "json")
    assert code == 0 and json.loads(out)["converted"] == 2, err
