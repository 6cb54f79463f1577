"""The pre-rotation codecs (``int4r``, ``int8r``; ``ecq``'s chains and CLI too): the rotation kvstore
undoes is the model's own, it is undone and redone exactly (float64), keys decode at their chunk's
positions (past a chunk boundary, after a partial hit), every element stays within the stated
bound, the rotary parameters travel in the entry header, models whose rotation kvstore does not
undo are refused in one line, and the stored layout is pinned by a golden file."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from transformers import DynamicCache

from helpers.entries import assemble, check_lossy_golden, golden_rotary_entry, lossy_facts, split
from helpers.paths import GOLDEN
from helpers.tiny import make_tiny_model
from kvstore.errors import CodecError, CorruptEntryError, ModelError
from kvstore.model.adapter import Adapter
from kvstore.model.family.rope import rotary_of, rotary_refusal
from kvstore.store.codecs import get_codec
from kvstore.store.codecs.entropy import EntropyQuantizer
from kvstore.store.codecs.prerope import PreRopeQuantizer, Rotary, rotate
from kvstore.store.codecs.quant import SINK_TOKENS
from kvstore.store.convert import convert_contexts
from kvstore.store.entry import Entry, decode_entry, encode_entry
from kvstore.store.kvstore import KVStore

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"
SPECS = ["int4r", "int8r", "int4r:32/64", "int4r:64/16", "int8r:128/32"]
# full rotary (Llama-like, 8 pairs of a 16-channel head) and partial (GPT-NeoX-like: 2 pairs of 16)
ROTARIES = {
    "full": Rotary(tuple(float(f) for f in 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))),
    "partial": Rotary(tuple(float(f) for f in 1.0 / (10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4)))),
}


def keys_like(heads=3, n=150, dim=16, dtype=torch.float64, seed=0, start=0, rotary=ROTARIES["full"]):
    """Pre-rotation channels with steady scales and offsets (one large channel), rotated at
    positions ``start..`` the way a model rotates its keys."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(heads, n, dim, generator=g, dtype=torch.float64) * (torch.rand(1, 1, dim, generator=g) + 0.2)
    pre += torch.randn(1, 1, dim, generator=g, dtype=torch.float64) * 3
    pre[:, :, 2] *= 10
    return rotate(pre, rotary, start).to(dtype)


def quantizer(spec: str, rotary: Rotary) -> PreRopeQuantizer | EntropyQuantizer:
    q = get_codec(spec).quantizer
    assert isinstance(q, (PreRopeQuantizer, EntropyQuantizer))
    return q.with_rotary(rotary)


def records(parts):
    from kvstore.store.codecs.records import TensorRecord

    out = {}
    for suffix, t in parts:
        t = t.contiguous()
        out["t" + suffix] = TensorRecord("t" + suffix, t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8))
    return out


def roundtrip(q, role, x, start):
    parts = q.encode(role, x, start)
    return dict(parts), q.reader(role, "t", records(parts), tuple(x.shape), x.dtype, start=start).materialize()


# -- the rotation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("which", list(ROTARIES))
@pytest.mark.parametrize("start", [0, 512, 4093, 100_000])
def test_unrotate_then_rotate_is_exact_in_float64(which, start):
    x = keys_like(start=start, rotary=ROTARIES[which])
    back = rotate(rotate(x, ROTARIES[which], start, inverse=True), ROTARIES[which], start)
    assert float((back - x).abs().max()) <= 1e-12 * float(x.abs().max())
    if which == "partial":  # channels past the rotary dimension are never touched
        assert torch.equal(rotate(x, ROTARIES[which], start, inverse=True)[..., 4:], x[..., 4:])


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_the_rotation_undone_is_the_models_own(kind):
    """A layer-0 key depends only on its token and its position: un-rotated, the key of one token
    at positions 0, 37, 300 and 511 is the same vector (to transformers' float32 cos/sin)."""
    model, _ = make_tiny_model(kind, dtype=torch.float64, seed=3)
    rotary = rotary_of(model)
    assert rotary is not None and rotary.dim == (16 if kind == "llama" else 4)
    pre = []
    for p in (0, 37, 300, 511):
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[p]]), past_key_values=cache, use_cache=True)
        pre.append(rotate(cache.layers[0].keys[0], rotary, p, inverse=True))
    scale = float(pre[0].abs().max())
    for other in pre[1:]:
        assert float((other - pre[0]).abs().max()) < 1e-6 * scale
    # ...and a rotation by the wrong position is far off: the check above can fail
    wrong = rotate(cache.layers[0].keys[0], rotary, 510, inverse=True)
    assert float((wrong - pre[0]).abs().max()) > 1e-3 * scale


# -- error bound -----------------------------------------------------------------------------------
def _step(q, parts, m):
    """Per element of the pre-rotation values, its quantization step [H, m, D] (float64)."""
    return parts[".scales"].double().repeat_interleave(q.group_k, 1)[:, :m]


def _key_bound(q, parts, m, rotary) -> torch.Tensor:
    """The stated bound per output element: rotated channels (|cos| + |sin|) * max(pair steps) / 2,
    the others half a step."""
    step = _step(q, parts, m)
    h, r = rotary.dim // 2, rotary.dim
    bound = step / 2
    pair = torch.maximum(step[..., :h], step[..., h:r]) * math.sqrt(2) / 2
    bound[..., :h], bound[..., h:r] = pair, pair
    return bound


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("which", list(ROTARIES))
@pytest.mark.parametrize("start", [0, 512, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keys_within_the_stated_bound(spec, which, start, dtype):
    rotary = ROTARIES[which]
    q = quantizer(spec, rotary)
    x = keys_like(dtype=dtype, start=start, rotary=rotary)
    parts, y = roundtrip(q, "keys", x, start)
    k = parts[".sink"].shape[1]
    assert k == (SINK_TOKENS if start == 0 else 0)
    assert y.dtype == dtype and torch.equal(y[:, :k], x[:, :k]), "the sink keeps the model's keys"
    err = (y[:, k:].double() - x[:, k:].double()).abs()
    bound = _key_bound(q, parts, x.shape[1] - k, rotary)
    slack = 1e-6 * float(x.abs().max()) if dtype == torch.float32 else 1e-12 * float(x.abs().max())
    assert bool((err <= bound * (1 + 1e-6) + slack).all()), float((err / bound).max())


@pytest.mark.parametrize("spec", SPECS)
def test_keys_at_the_wrong_positions_are_far_off(spec):
    """Decoding at another start (a position bookkeeping bug) breaks the bound: the test above can fail."""
    rotary = ROTARIES["full"]
    q = quantizer(spec, rotary)
    x = keys_like(start=512)
    parts = q.encode("keys", x, 512)
    y = q.reader("keys", "t", records(parts), tuple(x.shape), x.dtype, start=0).materialize()
    assert bool(((y - x).abs() > _key_bound(q, dict(parts), x.shape[1], rotary) * 2).any())


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_are_stored_as_int4_and_int8_store_them(spec, dtype):
    """Values are never rotated: the same parts as the plain quantizer of the same groups."""
    q = quantizer(spec, ROTARIES["full"])
    plain = get_codec(spec.replace("r", "", 1)).quantizer
    plain = type(plain)(q.bits, q.group_k, q.group_v)
    x = keys_like(dtype=dtype)
    for start in (0, 512):
        mine, theirs = q.encode("values", x, start), plain.encode("values", x, start)
        assert [s for s, _ in mine] == [s for s, _ in theirs]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(mine, theirs))


@pytest.mark.parametrize("spec", ["int4r", "int8r", "ecq"])
def test_bfloat16_keys_are_the_float32_result_rounded_once(spec):
    q = quantizer(spec, ROTARIES["full"])
    x = keys_like(dtype=torch.bfloat16, start=300)
    parts = q.encode("keys", x, 300)
    y16 = q.reader("keys", "t", records(parts), tuple(x.shape), torch.bfloat16, start=300).materialize()
    # the same codes read as float32 keys: the bfloat16 decode is that, rounded once
    parts32 = [(s, t.float() if s == ".sink" else t) for s, t in parts]
    y32 = q.reader("keys", "t", records(parts32), tuple(x.shape), torch.float32, start=300).materialize()
    assert torch.equal(y16, y32.to(torch.bfloat16))


@pytest.mark.parametrize(("spec", "role"), [("int4r", "keys"), ("ecq", "keys"), ("ecq", "values")])
def test_decodes_into_a_strided_row_of_the_batch_buffers(spec, role):
    q = quantizer(spec, ROTARIES["full"])
    x = keys_like(dtype=torch.float32, start=64)
    parts = q.encode(role, x, 64)
    buf = torch.full((2, 3, 200, 16), 7.0)
    q.reader(role, "t", records(parts), tuple(x.shape), x.dtype, start=64).copy_into(buf[1, :, 20:170])
    assert torch.equal(
        buf[1, :, 20:170], q.reader(role, "t", records(parts), tuple(x.shape), x.dtype, start=64).materialize()
    )
    assert bool((buf[0] == 7).all()) and bool((buf[1, :, :20] == 7).all()) and bool((buf[1, :, 170:] == 7).all())


# -- entries: the rotary travels in the header -------------------------------------------------------
def entry(dtype=torch.float32, start=0, rotary=ROTARIES["full"]) -> Entry:
    layers = tuple(
        (keys_like(n=40, dtype=dtype, seed=i, start=start), keys_like(n=40, dtype=dtype, seed=9 + i)) for i in range(2)
    )
    return Entry("a" * 64, "b" * 64, "m", torch.arange(40), layers, 1700000000.0, parent="" if start == 0 else "7" * 64,
                 start=start, rotary=rotary)  # fmt: skip


@pytest.mark.parametrize("spec", ["int4r", "int8r", "int4r+zstd:1", "int8r:64/32+zstd-shuffle:1"])
@pytest.mark.parametrize("start", [0, 700])
def test_entry_roundtrip_needs_no_model(spec, start):
    e = entry(start=start)
    view = decode_entry(encode_entry(e, spec))
    quant = view.header.codec["quant"]
    assert quant["name"] == spec.split(":")[0].split("+")[0]
    assert quant["rotary"] == {"inv_freq": list(ROTARIES["full"].inv_freq), "layout": "half"}
    assert view.header.codec_spec.startswith(quant["name"]) and not view.header.lossless
    for (k, _), (rk, _) in zip(e.layers, view.layers):
        got = rk.materialize()
        assert float((got - k).abs().max()) < float(k.abs().max()) / 4


def test_encoding_without_rotary_parameters_is_one_clear_error():
    e = Entry("a" * 64, "b" * 64, "m", torch.arange(40), entry().layers, 1700000000.0)
    with pytest.raises(CodecError) as err:
        encode_entry(e, "int4r")
    assert "rotary" in str(err.value) and "\n" not in str(err.value)
    # a plain int4 entry of the same tensors does not need them
    decode_entry(encode_entry(e, "int4"))


@pytest.mark.parametrize(
    "rotary",
    [None, "x", {"inv_freq": [], "layout": "half"}, {"inv_freq": [1.0, float("nan")], "layout": "half"},
     {"inv_freq": [1.0, 2], "layout": "half"}, {"inv_freq": [1.0], "layout": "interleaved"}],
)  # fmt: skip
def test_a_header_with_bad_rotary_parameters_is_corrupt(rotary):
    header, payload = split(encode_entry(entry(), "int4r"))
    if rotary is None:
        del header["codec"]["quant"]["rotary"]
    else:
        header["codec"]["quant"]["rotary"] = rotary
    with pytest.raises(CorruptEntryError) as err:
        decode_entry(assemble(header, payload))
    assert "\n" not in str(err.value)


def test_a_rotary_wider_than_the_head_is_refused():
    wide = Rotary(tuple(1.0 for _ in range(9)))  # 18 channels, heads of 16
    with pytest.raises(CodecError):
        encode_entry(entry(rotary=wide), "int4r")


def test_plain_entries_do_not_record_the_rotary():
    """A lossless or int4 entry of a rotary model is byte-identical to one without rotary
    parameters: old stores and golden files are untouched."""
    e = entry()
    bare = Entry(e.key, e.model, e.model_name, e.token_ids, e.layers, e.created)
    for spec in ("raw", "zstd-shuffle:1", "int4", "int8:64"):
        assert encode_entry(e, spec) == encode_entry(bare, spec)


def test_specs_and_keys():
    assert get_codec("int4r").spec == "int4r:32" and get_codec("int8r").spec == "int8r:128/64"
    assert get_codec("int4r:128/64").spec == "int4r:128/64"
    assert get_codec("int4r:64/16+zstd:1").spec == "int4r:64/16+zstd:1"
    assert get_codec("int4r").identity == "int4r:32" != get_codec("int4:32").identity
    for bad in ("int4r:3", "int4r:x", "int4r:64/5"):
        with pytest.raises(CodecError):
            get_codec(bad)


# -- models: positions past chunk boundaries and after a partial hit ----------------------------------
@pytest.fixture(scope="module")
def llama64():
    model, tok = make_tiny_model("llama", dtype=torch.float64, seed=5)
    return Adapter(model, tok)


def _context(adapter, n, seed=0):
    rng = random.Random(seed)
    vocab = [i for i in range(len(adapter.tokenizer)) if i not in adapter.tokenizer.all_special_ids]
    return [rng.choice(vocab) for _ in range(n)]


def _layer0_keys(adapter, ids) -> torch.Tensor:
    """The model's own layer-0 keys of ``ids`` (no cache): [kv_heads, n, head_dim]."""
    cache = DynamicCache(config=adapter.model.config)
    adapter.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache.layers[0].keys[0]


def ecq_bound(parts, shape, rotary: Rotary | None) -> torch.Tensor:
    """``ecq``'s stated bound per element past the sink (tests/store/test_ecq.py): half the head's
    step, ``sqrt(2)/2`` of it on rotated channels."""
    heads, m, dim = shape
    step = parts[".steps"].double().expand(heads, m, dim)
    out = step / 2
    if rotary is not None:
        out[..., : rotary.dim] = step[..., : rotary.dim] * math.sqrt(2) / 2
    return out


def _check_chain(adapter, store, ids):
    """Every stored chunk's decoded layer-0 keys are within the bound of the model's own keys at
    the chunk's positions (layer 0's keys depend on token and position only, not on the prefix)."""
    plan = adapter.chain(ids, store)
    exact = _layer0_keys(adapter, ids)
    rotary = adapter.rotary
    q = store.codec.quantizer
    with store.open_chain(plan.keys) as views:
        assert len(views) == len(plan.keys)
        for view in views:
            h = view.header
            got = view.layers[0][0].materialize()
            want = exact[:, h.start : h.end]
            k = view.records["layers.0.keys.sink"].shape[1]
            assert k == (SINK_TOKENS if h.start == 0 else 0)
            if isinstance(q, EntropyQuantizer):
                steps = view.records["layers.0.keys.steps"].materialize()
                bound = ecq_bound({".steps": steps}, got[:, k:].shape, rotary)
            else:
                scales = view.records["layers.0.keys.scales"].materialize()
                bound = _key_bound(q, {".scales": scales}, h.n_tokens - k, rotary)
            assert bool(((got[:, k:] - want[:, k:]).abs() <= bound * (1 + 1e-9) + 1e-12).all()), h.start
            assert torch.allclose(got[:, :k], want[:, :k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("spec", ["int4r", "int8r", "ecq"])
def test_chunks_past_a_boundary_and_after_a_partial_hit_decode_at_their_positions(llama64, tmp_path, spec):
    short = _context(llama64, 45)
    longer = short + _context(llama64, 40, seed=1)
    with KVStore(str(tmp_path / "s"), codec=spec, chunk_tokens=16) as store:
        llama64.generate_kv_cache([short], store)
        _check_chain(llama64, store, short)  # chunks at 0, 16, 32 (a partial last one)
        got = llama64.greedy_sample([longer], [[5, 6]], 3, store=store, return_details=True)
        assert 0 < got.cached_tokens[0] < len(longer), "a partial hit: the prefix loaded, the rest computed"
        _check_chain(llama64, store, longer)  # the chain extended on the loaded prefix
        again = llama64.greedy_sample([longer], [[5, 6]], 3, store=store, return_details=True)
    assert again.cache_hit[0] and torch.equal(got.tokens, again.tokens)


def test_answers_from_int4r_are_closer_than_from_int4(tmp_path):
    """On keys whose channels are steady before rotation, int4r's decoded keys are closer to the
    exact ones than int4's at the same bits (what the codec is for)."""
    x = keys_like(n=512, dtype=torch.float32, start=512)
    qr = quantizer("int4r:32/64", ROTARIES["full"])
    _, yr = roundtrip(qr, "keys", x, 512)
    q4 = get_codec("int4:32/64").quantizer
    parts = q4.encode("keys", x, 512)
    y4 = q4.reader("keys", "t", records(parts), tuple(x.shape), x.dtype, start=512).materialize()
    assert float((yr - x).pow(2).mean()) < float((y4 - x).pow(2).mean()) / 2


def test_convert_needs_and_takes_the_rotary(llama64, tmp_path):
    ctx = [_context(llama64, 30, seed=s) for s in range(2)]
    with KVStore(str(tmp_path / "src"), chunk_tokens=16) as src:
        llama64.generate_kv_cache(ctx, src)
        with pytest.raises(CodecError) as err:
            convert_contexts(src, src, "int4r")
        assert "rotary" in str(err.value)
        report = convert_contexts(src, src, "int4r", rotary=llama64.rotary)
        assert report.converted == 2 and not report.problems
    with KVStore(str(tmp_path / "src"), codec="int4r") as store:
        for ids in ctx:
            _check_chain(llama64, store, ids)
        with KVStore(str(tmp_path / "b"), codec="int4r", chunk_tokens=16) as built:
            llama64.generate_kv_cache(ctx, built)
            for ids in ctx:  # convert writes what a build writes
                for key in llama64.chain(ids, built).keys:
                    a, b = built.get(key), store.get(key)
                    assert a is not None and b is not None
                    for x, y in zip(a.layers, b.layers):
                        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_models_without_a_rotation_kvstore_undoes_are_refused(tmp_path):
    gpt2 = _gpt2()
    assert rotary_of(gpt2) is None and "gpt2" in (rotary_refusal(gpt2) or "")
    from helpers.tiny import make_tokenizer

    adapter = Adapter(gpt2, make_tokenizer())
    with KVStore(str(tmp_path / "s"), codec="int4r") as store:
        with pytest.raises(ModelError) as err:
            adapter.check_supported(store)
    assert "int4r" in str(err.value) and "\n" not in str(err.value)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=400, n_positions=128, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(cfg).eval()


# -- golden ----------------------------------------------------------------------------------------
GOLDEN_SPECS = ("int4r",)


golden_entry = golden_rotary_entry


@pytest.mark.parametrize("spec", GOLDEN_SPECS)
def test_golden_prerope_entries(spec):
    file = GOLDEN / f"entry_v3_{spec.replace(':', '-').replace('/', '-')}.kvs"
    check_lossy_golden(GOLDEN / "format_v3_prerope.json", file, spec, golden_entry, REGEN, "pre-rotation layout")


# -- CLI -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("codec", "label", "other", "bad", "why"),
    [("int4r", "int4r:32", "int4", "int4r:3", "group size"),
     ("ecq", "ecq:0.18+zstd:1", "ecq:0.1", "ecq:0", "ecq step")],
)  # fmt: skip
def test_cli_build_and_sample_with_a_pre_rope_codec(tiny_llama_dir, tmp_path, capsys, codec, label, other, bad, why):
    from helpers.cli import run_main, write_dataset

    data = write_dataset(tmp_path / "d.jsonl", range(3))
    store = tmp_path / "store"
    base = ["--model", tiny_llama_dir, "--store", store, "--quiet", "--format", "json"]
    code, out, err = run_main(capsys, "build", data, *base, "--codec", codec)
    assert code == 0, err
    assert json.loads(out)["codec"] == label and json.loads(out)["lossy"] is True
    code, out, err = run_main(capsys, "sample", data, *base, "-n", "3", "--codec", codec, "--readonly-store")
    assert code == 0 and json.loads(out)["cache_hit_rate"] == 1, err
    # another lossy codec (int4 after RoPE, ecq at another step) has other keys: its request misses them all
    code, out, err = run_main(capsys, "sample", data, *base, "-n", "3", "--codec", other, "--readonly-store")
    assert code == 0 and json.loads(out)["cache_hit_rate"] == 0, err
    code, out, err = run_main(capsys, "build", data, *base, "--codec", bad)
    assert code != 0 and why in err and err.count("\n") == 1
    # converting needs the model's rotation, which sync does not load: one line, nothing written
    code, out, err = run_main(capsys, "sync", store, tmp_path / "other", "--codec", "int8r")
    assert code == 1 and "rotary" in err and err.count("\n") == 1
    assert not (tmp_path / "other").exists() or run_main(capsys, "ls", "--store", tmp_path / "other")[0] == 0


def test_a_format_2_int4r_entry_of_the_pre_release_still_reads():
    """Before entry format 3, int4r entries were written as format 2 (the file kept from then): it
    still decodes, to the same keys and values as the format-3 file of the same chunk."""
    old = decode_entry((GOLDEN / "entry_v2_int4r.kvs").read_bytes())
    new = decode_entry((GOLDEN / "entry_v3_int4r.kvs").read_bytes())
    assert old.header.format == 2 and new.header.format == 3 and old.header.codec == new.header.codec
    for a, b in zip(old.layers[0], new.layers[0]):
        assert torch.equal(a.materialize(), b.materialize())


def test_pre_rope_codecs_write_format_3():
    """A format-2 reader does not know int4r/int8r: their entries say format 3 (it refuses them)."""
    assert get_codec("int4r").entry_format == get_codec("int8r+zstd:1").entry_format == 3
    assert lossy_facts(golden_entry("int4r"))["header"]["format"] == 3
