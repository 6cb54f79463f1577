"""The entry format (version 1): bit-exact round trips, standard containers inside (safetensors,
concatenated zstd frames), golden bytes and key hashes that pin the format, and hostile or
damaged entries that must fail as CorruptEntryError - never another exception, never a result,
never a huge allocation."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import tracemalloc
from pathlib import Path

import pytest
import safetensors.torch
import torch
import zstandard

from helpers.entries import assemble, bits, encode, encode_v1, golden_facts, kv_layers, rle_frame, seal, split
from helpers.paths import GOLDEN
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.model.load.identity import config_digest
from kvstore.store.codecs import get_codec
from kvstore.store.entry import Entry, decode_entry, encode_entry
from kvstore.store.header import CHUNK_FORMAT, DERIVED_FORMAT, FORMAT_VERSION, MAGIC, read_header, verify_checksum
from kvstore.store.keys import cache_key, chain_keys, chain_seed, chunk_spans

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"  # rewrite the golden files (after a format bump)

CODECS = ["raw", "zstd:3", "zstd-shuffle:1"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bit_exact(codec, dtype):
    layers = kv_layers(dtype=dtype)
    ids = torch.tensor([5, 0, 2**32 - 1, 7, 7, 1, 3])
    blob = encode(layers, codec, ids=ids)
    decoded = decode_entry(blob, key="k" * 64, threads=2)
    header = decoded.header
    assert header.dtype == str(dtype).removeprefix("torch.")
    assert (header.n_layers, header.kv_heads, header.n_tokens, header.head_dim) == (3, 2, 7, 8)
    assert header.codec_spec == get_codec(codec).spec
    assert header.created == 1700000000.0
    for i, (k, v) in enumerate(layers):
        for name, want in ((f"layers.{i}.keys", k), (f"layers.{i}.values", v)):
            got = decoded.records[name].materialize()
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(bits(got), bits(want)), name
    assert torch.equal(decoded.records["token_ids"].materialize(), ids)


@pytest.mark.parametrize("codec", CODECS)
def test_copy_into_strided_destination(codec):
    layers = kv_layers(dtype=torch.bfloat16)
    decoded = decode_entry(encode(layers, codec))
    dest = torch.zeros(2, 2, 10, 8, dtype=torch.bfloat16)[1, :, 2:9]  # a non-contiguous slice
    decoded.records["layers.1.values"].copy_into(dest)
    assert torch.equal(bits(dest), bits(layers[1][1]))


def test_batch_dim_of_one_is_accepted():
    layers = kv_layers(n_layers=1)
    with_batch = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in layers]
    assert encode(with_batch, "raw", ids=torch.arange(7)) == encode(layers, "raw")


def test_encode_rejects_inconsistent_layers():
    k = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError):
        encode([(k, k), (k, torch.zeros(2, 5, 8))], ids=torch.arange(4))
    with pytest.raises(ValueError):
        encode([(k, k.half())], ids=torch.arange(4))
    with pytest.raises(ValueError):
        encode([(k, k)], ids=torch.arange(3))
    with pytest.raises(ValueError):
        encode([(k.long(), k.long())], ids=torch.arange(4))
    with pytest.raises(ValueError):
        encode_entry(Entry("k", "m", "n", torch.tensor([1]), ()))


def test_raw_payload_is_a_safetensors_file():
    layers = kv_layers(n_layers=2)
    header, payload = split(encode(layers, "raw"))
    tensors = safetensors.torch.load(payload)
    assert sorted(tensors) == ["layers.0.keys", "layers.0.values", "layers.1.keys", "layers.1.values", "token_ids"]
    assert torch.equal(bits(tensors["layers.1.keys"]), bits(layers[1][0]))
    assert torch.equal(tensors["token_ids"], torch.arange(7))
    (n,) = struct.unpack_from("<Q", payload)
    meta = json.loads(payload[8 : 8 + n])["__metadata__"]
    assert meta["key"] == "k" * 64 and meta["n_layers"] == "2" and meta["codec"] == "raw"
    assert header["raw_bytes"] == len(payload)


def test_zstd_payload_is_concatenated_frames_of_a_safetensors_file():
    """``zstd -d`` of a (non-shuffled) zstd payload gives the safetensors file back."""
    layers = kv_layers(n_layers=2, dtype=torch.float16)
    header, payload = split(encode(layers, "zstd:3"))
    assert len(header["codec"]["frames"]) == 1 + 2 * 2 + 1  # safetensors header, 4 tensors, ids
    whole = zstandard.ZstdDecompressor().stream_reader(payload, read_across_frames=True).read()
    assert len(whole) == header["raw_bytes"]
    dobj = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True)
    assert dobj.decompress(payload) == whole
    tensors = safetensors.torch.load(whole)
    assert torch.equal(bits(tensors["layers.0.keys"]), bits(layers[0][0]))
    assert torch.equal(tensors["token_ids"], torch.arange(7))


def test_store_level_facts_in_header():
    layers = kv_layers(n_layers=2, dtype=torch.bfloat16)
    h, _ = read_header(encode(layers, "zstd-shuffle:5"))
    assert h.format == 2  # a codec format-2 readers know: still written as format 2
    assert h.codec_spec == "zstd-shuffle:5"
    assert h.kv_bytes == 2 * 2 * 2 * 7 * 8 * 2


# -- golden: the format is pinned ------------------------------------------------------------------
# A failure here means the bytes an entry is stored as (or a key is computed from) changed. Stores
# written before would then be misread or silently miss. If the change is deliberate, bump
# kvstore.store.header.FORMAT_VERSION (keys change only with kvstore.store.keys.CHAIN_FORMAT), teach the
# decoder to read the old version or refuse it, and regenerate with KVSTORE_REGEN_GOLDEN=1.
GOLDEN_FP = hashlib.sha256(b"kvstore golden model").hexdigest()


def golden_entry(codec: str) -> bytes:
    """A whole context of two full-attention layers, as this kvstore writes it (format 2)."""
    ids = torch.tensor([1, 2, 3, 5, 8, 13])
    layers = []
    for i in range(2):
        k = (torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4) - 20) / 8 + i
        layers.append((k, -2 * k))
    key = chain_keys(chain_seed(GOLDEN_FP, "float32", device="cpu", attn="sdpa"), ids.tolist(), [(0, 6)])[0]
    numerics = {"device": "cpu", "attn": "sdpa", "torch": "2.13.0", "transformers": "5.23.0"}
    return encode_entry(Entry(key, GOLDEN_FP, "golden", ids, tuple(layers), 1700000000.25, numerics=numerics), codec)


def golden_chunk(codec: str) -> bytes:
    """The second chunk of a chain, with every layer kind: full attention, a sliding window that
    keeps the last 3 of the chunk's 5 tokens, a recurrent state (float32 in a float64 model) and a
    hybrid of both."""
    ids = torch.tensor([21, 34, 55, 89, 144])
    g = torch.arange(2 * 5 * 4, dtype=torch.float64).reshape(2, 5, 4) / 16
    conv = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4
    ssm = -torch.arange(8, dtype=torch.float32).reshape(2, 2, 2)
    layers = ((g, -g), (g[:, 2:], g[:, 2:] + 1), None, (g + 2, g - 2))
    states = (None, None, {"conv": conv, "ssm": ssm}, {"conv": conv + 1, "ssm": ssm - 1})
    seed = chain_seed(GOLDEN_FP, "float64", device="cpu", attn="eager")
    spans = [(0, 6), (6, 11)]
    keys = chain_keys(seed, list(range(6)) + ids.tolist(), spans)
    return encode_entry(
        Entry(keys[1], GOLDEN_FP, "golden", ids, layers, 1700000000.5, parent=keys[0], start=6, states=states,
              kinds=("attn", "sliding", "state", "hybrid"), windows=(None, 4, None, None)),
        codec,
    )  # fmt: skip


GOLDEN_KEYS = {  # name -> (fingerprint, dtype, token ids); format-1 whole-context keys
    "f32_short": ("a" * 64, "float32", [1, 2, 3]),
    "bf16_empty": (GOLDEN_FP, "bfloat16", []),
    "f16_range": (GOLDEN_FP, "float16", list(range(1000))),
    "f64_extremes": (GOLDEN_FP, "float64", [0, 2**32 - 1, 2**31]),
}
GOLDEN_CHAINS = {  # name -> (seed arguments, token ids, chunk_tokens, boundaries); format-2 chain keys
    "cpu_sdpa_f32": ((GOLDEN_FP, "float32", "cpu", "sdpa", ""), list(range(600)), 256, []),
    "cuda_eager_bf16_head": ((GOLDEN_FP, "bfloat16", "cuda", "eager", ""), list(range(50, 350)), 256, [30]),
    "cpu_sdpa_f32_int8": ((GOLDEN_FP, "float32", "cpu", "sdpa", "int8:64"), list(range(600)), 256, []),
}
GOLDEN_CONFIG = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "max_position_embeddings": 128,
}
GOLDEN_ENTRIES = {"context": golden_entry, "chunk": golden_chunk}


def _chain(name: str) -> list[str]:
    (fp, dtype, device, attn, lossy), ids, chunk_tokens, boundaries = GOLDEN_CHAINS[name]
    seed = chain_seed(fp, dtype, device=device, attn=attn, lossy=lossy)
    return chain_keys(seed, ids, chunk_spans(len(ids), chunk_tokens, boundaries))


def _golden_facts() -> dict:
    facts: dict = {"format_version": 2, "zstd_version": zstandard.ZSTD_VERSION, "entries": {}}
    for kind, make in GOLDEN_ENTRIES.items():
        for codec in ("raw", "zstd-shuffle:1"):
            facts["entries"][f"{kind}/{codec}"] = golden_facts(make(codec))
    facts["chain_keys"] = {name: _chain(name) for name in GOLDEN_CHAINS}
    return facts


def _v2_file(kind: str, codec: str) -> Path:
    return GOLDEN / f"entry_v2_{kind}_{codec.replace(':', '-')}.kvs"


@pytest.fixture(scope="module")
def golden() -> dict:
    path = GOLDEN / "format_v2.json"
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(_golden_facts(), indent=2, sort_keys=True) + "\n")
        for kind, make in GOLDEN_ENTRIES.items():
            for codec in ("raw", "zstd-shuffle:1"):
                _v2_file(kind, codec).write_bytes(make(codec))
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def golden_v1() -> dict:
    return json.loads((GOLDEN / "format_v1.json").read_text())


def test_golden_format_version(golden, golden_v1):
    # this kvstore reads formats 1 to 7 (chunks 1-4, 6 and 7, derived entries 5); raw and zstd-shuffle
    # entries are still written as format 2
    assert FORMAT_VERSION == 7 and CHUNK_FORMAT == 7 and DERIVED_FORMAT == 5
    assert golden["format_version"] == 2 and golden_v1["format_version"] == 1


@pytest.mark.parametrize("kind", list(GOLDEN_ENTRIES))
@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle:1"])
def test_golden_entry_bytes(golden, kind, codec):
    want = golden["entries"][f"{kind}/{codec}"]
    facts = _golden_facts()["entries"][f"{kind}/{codec}"]
    assert facts["header"] == want["header"], "entry header changed: bump FORMAT_VERSION (see comment above)"
    assert facts["decompressed_sha256"] == want["decompressed_sha256"], "payload layout changed: bump FORMAT_VERSION"
    if codec == "raw" or zstandard.ZSTD_VERSION == tuple(golden["zstd_version"]):
        # compressed bytes are only reproducible with the libzstd that wrote them
        assert facts["sha256"] == want["sha256"] and facts["size"] == want["size"]
        assert _v2_file(kind, codec).read_bytes() == GOLDEN_ENTRIES[kind](codec)


@pytest.mark.parametrize("kind", list(GOLDEN_ENTRIES))
@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle:1"])
def test_golden_v2_files_decode(kind, codec):
    view = decode_entry(_v2_file(kind, codec).read_bytes())
    want = decode_entry(GOLDEN_ENTRIES[kind](codec))
    assert view.header == want.header and sorted(view.records) == sorted(want.records)
    for name, rec in want.records.items():
        assert torch.equal(bits(view.records[name].materialize()), bits(rec.materialize()))
    if kind == "chunk":
        h = view.header
        assert (h.start, h.n_tokens, h.end, len(h.parent)) == (6, 5, 11, 64)
        assert [s.kind for s in h.layers] == ["attn", "sliding", "state", "hybrid"]
        assert [s.length for s in h.layers] == [5, 3, 0, 5] and h.layers[1].window == 4
        assert view.layers[2] is None and view.states[0] is None
        assert view.states[2]["ssm"].dtype == torch.float32 and h.dtype == "float64"


@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle:1"])
def test_v1_helper_writes_what_phase_1_wrote(codec):
    """tests/helpers/entries.encode_v1 (used to test format-1 reading) reproduces the golden files."""
    ids = torch.tensor([1, 2, 3, 5, 8, 13])
    layers = [((torch.arange(48, dtype=torch.float32).reshape(2, 6, 4) - 20) / 8 + i,) for i in range(2)]
    layers = [(k, -2 * k) for (k,) in layers]
    blob = encode_v1(layers, codec, ids, cache_key(GOLDEN_FP, "float32", ids), 1700000000.25, GOLDEN_FP, "golden")
    want = (GOLDEN / f"entry_v1_{codec.replace(':', '-')}.kvs").read_bytes()
    if codec == "raw" or zstandard.ZSTD_VERSION == tuple(
        json.loads((GOLDEN / "format_v1.json").read_text())["zstd_version"]
    ):
        assert blob == want
    assert decode_entry(blob).header == decode_entry(want).header


@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle:1"])
def test_golden_v1_files_still_decode(codec):
    """Entries written by format 1 (phase 1) stay readable, whatever this version writes: the same
    tensors, seen as a one-chunk chain of full-attention layers."""
    blob = (GOLDEN / f"entry_v1_{codec.replace(':', '-')}.kvs").read_bytes()
    decoded = decode_entry(blob, key=cache_key(GOLDEN_FP, "float32", [1, 2, 3, 5, 8, 13]))
    want_decoded = decode_entry(golden_entry(codec))
    header = decoded.header
    assert header.format == 1 and header.model_name == "golden" and header.created == 1700000000.25
    assert (header.parent, header.start, header.n_tokens, dict(header.numerics)) == ("", 0, 6, {})
    assert [(s.kind, s.length, s.kv_heads, s.head_dim) for s in header.layers] == [("attn", 6, 2, 4)] * 2
    for name, rec in want_decoded.records.items():
        assert torch.equal(decoded.records[name].materialize(), rec.materialize())


def test_golden_cache_keys(golden, golden_v1):
    for name, (fp, dtype, ids) in GOLDEN_KEYS.items():
        assert cache_key(fp, dtype, ids) == golden_v1["cache_keys"][name], f"format-1 key changed for {name}"
    for name in GOLDEN_CHAINS:
        assert _chain(name) == golden["chain_keys"][name], f"chain keys changed for {name}"
    fp, dtype, ids = GOLDEN_KEYS["f32_short"]
    # every input matters; equivalent spellings do not
    assert cache_key(fp, torch.float32, torch.tensor(ids)) == golden_v1["cache_keys"]["f32_short"]
    variants = {cache_key(fp, dtype, ids), cache_key(fp, "float16", ids), cache_key("b" * 64, dtype, ids),
                cache_key(fp, dtype, ids[:2])}  # fmt: skip
    assert len(variants) == 4
    seeds = {
        chain_seed(fp, dtype, device=d, attn=a, lossy=q)
        for d in ("cpu", "cuda") for a in ("sdpa", "eager") for q in ("", "int8:64")
    }  # fmt: skip
    assert len(seeds) == 8  # device type, attention and a lossy codec each change every key
    for bad in ([-1], [2**32], [[1, 2]]):
        with pytest.raises(ValueError):
            cache_key(fp, dtype, bad)


def test_chain_keys_share_prefixes():
    seed = chain_seed("c" * 64, "float32", device="cpu", attn="sdpa")
    a = list(range(700))
    b = a[:512] + [7] * 100  # the same first two chunks, then other tokens
    ka, kb = (chain_keys(seed, x, chunk_spans(len(x), 256)) for x in (a, b))
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert chunk_spans(700, 256) == [(0, 256), (256, 512), (512, 700)]
    assert chunk_spans(700, 256, [30]) == [(0, 30), (30, 286), (286, 542), (542, 700)]
    assert chunk_spans(5, 256, [0, 5, 9]) == [(0, 5)]  # boundaries outside (0, n) are ignored


def test_golden_config_digest(golden_v1):
    assert config_digest(GOLDEN_CONFIG) == golden_v1["config_digest"]
    volatile = dict(
        GOLDEN_CONFIG, transformers_version="9.9", torch_dtype="bfloat16", _name_or_path="/x", use_cache=False
    )
    assert config_digest(volatile) == golden_v1["config_digest"]
    assert config_digest(dict(GOLDEN_CONFIG, hidden_size=64)) != golden_v1["config_digest"]


# -- damage -------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["raw", "zstd-shuffle:1"])
def blob(request) -> bytes:
    return encode(kv_layers(n_layers=2, n_tokens=5, head_dim=4), request.param)


def test_flipped_bytes_are_corrupt(blob):
    _, offset = read_header(blob)
    rng = random.Random(1234)
    positions = {0, 3, 7, 8, 11, 12, offset - 1, offset, offset + 8, len(blob) - 9, len(blob) - 8, len(blob) - 1}
    positions |= {rng.randrange(len(blob)) for _ in range(200)}
    for pos in sorted(positions):
        damaged = bytearray(blob)
        damaged[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptEntryError):
            decode_entry(bytes(damaged))


def test_truncated_entries_are_corrupt(blob):
    for n in range(len(blob)):
        with pytest.raises(CorruptEntryError):
            decode_entry(blob[:n])
    with pytest.raises(CorruptEntryError):
        decode_entry(blob + b"\0")


def test_entry_under_another_key_is_corrupt(blob):
    with pytest.raises(CorruptEntryError, match="says it is"):
        decode_entry(blob, key="0" * 64)


def test_resealed_damage_never_escapes_as_another_error(blob):
    """Damage with a recomputed checksum gets past the first line of defence: every later check
    must still fail cleanly (or decode to well-formed tensors of the declared shape)."""
    rng = random.Random(99)
    body = blob[:-8]
    for _ in range(600):
        damaged = bytearray(body)
        for _ in range(rng.choice((1, 1, 3))):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        try:
            decoded = decode_entry(seal(bytes(damaged)))
        except (CorruptEntryError, FormatVersionError):
            continue
        for _name, rec in decoded.records.items():
            assert rec.materialize().numel() == rec.numel


# -- hostile entries with valid checksums ------------------------------------------------------------
def _peak_alloc(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def _raises_small(fn, match=None) -> None:
    def run():
        with pytest.raises(CorruptEntryError, match=match):
            fn()

    assert _peak_alloc(run) < 16 << 20


@pytest.mark.parametrize(
    "field", ["raw_bytes", "n_tokens", "layer.kv_heads", "layer.head_dim", "layer.length", "layers", "state"]
)
def test_huge_declared_sizes(field):
    header, payload = split(encode(kv_layers(n_layers=1), "zstd-shuffle:1"))
    if field.startswith("layer."):
        header["layers"][0][field.split(".")[1]] = 1 << 40
    elif field == "layers":  # a million layers: the header itself is over its limit
        header["layers"] = header["layers"] * 1_000_000
    elif field == "state":
        header["layers"][0] |= {"kind": "hybrid", "state": {"ssm": {"shape": [1 << 20] * 3, "dtype": "float64"}}}
    else:
        header[field] = 1 << 40
    blob = assemble(header, payload)
    _raises_small(lambda: decode_entry(blob))


def test_huge_shape_with_consistent_raw_bytes():
    # the header is self-consistent (raw_bytes matches the shape); only the payload size betrays it
    header, payload = split(encode(kv_layers(n_layers=1), "raw"))
    layer = header["layers"][0]
    header["n_tokens"] = layer["length"] = 1 << 30
    header["raw_bytes"] = 2 * layer["kv_heads"] * layer["head_dim"] * (1 << 30) * 4 + 8 * (1 << 30)
    _raises_small(lambda: decode_entry(assemble(header, payload)), match="implausible")


def _with_st_header(header: dict, payload: bytes, edit) -> bytes:
    (n,) = struct.unpack_from("<Q", payload)
    st = json.loads(payload[8 : 8 + n])
    edit(st)
    text = json.dumps(st).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text + payload[8 + n :]
    return assemble(dict(header, raw_bytes=len(new)), new)


@pytest.mark.parametrize(
    "edit",
    [
        lambda st: st["layers.0.keys"].update(data_offsets=[0, 1 << 62]),
        lambda st: st["layers.0.keys"].update(data_offsets=[1 << 40, (1 << 40) + 448]),
        lambda st: st["layers.0.keys"].update(shape=[1 << 30, 1 << 30, 1 << 30]),
        lambda st: st["layers.0.keys"].update(shape=[-2, 7, -8]),
        lambda st: st["layers.0.keys"].update(shape=[1e999]),
        lambda st: st["layers.0.keys"].update(dtype="F8_E4M3"),
        lambda st: st["layers.0.values"].update(data_offsets=st["layers.0.keys"]["data_offsets"]),
        lambda st: st.pop("token_ids"),
        lambda st: st.update(__metadata__={"key": 5}),
        lambda st: st["__metadata__"].update(n_layers="7"),
    ],
    ids=[
        "offset-beyond",
        "offset-far",
        "huge-shape",
        "negative-shape",
        "inf-shape",
        "dtype",
        "overlap",
        "missing",
        "metadata-type",
        "metadata-disagrees",
    ],
)
def test_hostile_safetensors_header(edit):
    header, payload = split(encode(kv_layers(n_layers=1), "raw"))
    _raises_small(lambda: decode_entry(_with_st_header(header, payload, edit)))


def test_hostile_safetensors_header_length():
    header, payload = split(encode(kv_layers(n_layers=1), "raw"))
    for n in (1 << 63, len(payload), 1 << 24):
        _raises_small(lambda n=n: decode_entry(assemble(header, struct.pack("<Q", n) + payload[8:])))
    deep = b"[" * 200_000
    deep += b" " * (-len(deep) % 8)
    hostile = struct.pack("<Q", len(deep)) + deep
    _raises_small(lambda: decode_entry(assemble(dict(header, raw_bytes=len(hostile)), hostile)))


def test_hostile_entry_header():
    header, payload = split(encode(kv_layers(n_layers=1), "raw"))
    for edit in (
        {"created": float("nan")},
        {"created": 10**400},
        {"dtype": "int8"},
        {"codec": "raw"},
        {"n_tokens": True},
        {"key": 7},
        {"codec": {"name": "lz4"}},
    ):
        with pytest.raises(CorruptEntryError):
            decode_entry(assemble(dict(header, **edit), payload))
    h = b"[" * 100_000
    with pytest.raises(CorruptEntryError):
        decode_entry(seal(MAGIC + struct.pack("<I", len(h)) + h + payload))
    with pytest.raises(CorruptEntryError):
        decode_entry(seal(MAGIC + struct.pack("<I", 0xFFFFFFFF) + payload))


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("declare", [True, False])
def test_zstd_frame_expanding_beyond_its_declared_size(threads, declare):
    assert zstandard.ZstdDecompressor().decompress(rle_frame(1000, 7)) == b"\x07" * 1000  # the helper is a valid frame
    layers = kv_layers(n_layers=1, n_tokens=4, head_dim=4)
    header, payload = split(encode(layers, "zstd:1"))
    frames = header["codec"]["frames"]
    # swap tensor 0's frame for a bomb: 256 MiB of zeros in ~8 KB, the frame table unchanged except
    # for the compressed length, so every declared size still adds up
    bomb = rle_frame(256 << 20, declared=declare)
    sizes = [c for c, _ in frames]
    parts, pos = [], 0
    for c in sizes:
        parts.append(payload[pos : pos + c])
        pos += c
    parts[1] = bomb
    frames[1][0] = len(bomb)
    hostile = assemble(header, b"".join(parts))
    _raises_small(lambda: decode_entry(hostile, threads=threads))


def test_zstd_frame_table_mismatch():
    header, payload = split(encode(kv_layers(n_layers=1), "zstd-shuffle:1"))
    for frames in ([], "x", [[1e999, 1]], [[-1, 5]], [[len(payload), header["raw_bytes"]]], [[1, 2, 3]]):
        h = dict(header, codec=dict(header["codec"], frames=frames))
        with pytest.raises(CorruptEntryError):
            decode_entry(assemble(h, payload))
    swapped = json.loads(json.dumps(header))
    f = swapped["codec"]["frames"]
    f[1][1], f[2][1] = f[2][1] + 8, f[1][1] - 8  # sizes still add up, but disagree with the frames
    with pytest.raises(CorruptEntryError):
        decode_entry(assemble(swapped, payload))


def test_future_format_version():
    header, payload = split(encode(kv_layers(n_layers=1), "raw"))
    future = assemble(dict(header, format=FORMAT_VERSION + 1), payload)
    with pytest.raises(FormatVersionError, match="upgrade kvstore"):
        decode_entry(future)
    with pytest.raises(FormatVersionError):
        read_header(future)
    verify_checksum(future)  # intact bytes: refused for the version, not as damage
