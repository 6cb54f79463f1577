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

from helpers.entries import assemble, bits, encode, kv_layers, rle_frame, seal, split
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.model.identity import config_digest
from kvstore.store.codecs import get_codec
from kvstore.store.entry import (
    FORMAT_VERSION,
    MAGIC,
    Entry,
    decode_entry,
    encode_entry,
    read_header,
    verify_checksum,
)
from kvstore.store.keys import cache_key

GOLDEN = Path(__file__).parent / "golden"
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
    assert h.format == FORMAT_VERSION
    assert h.codec_spec == "zstd-shuffle:5"
    assert h.kv_bytes == 2 * 2 * 2 * 7 * 8 * 2


# -- golden: the format is pinned ------------------------------------------------------------------
# A failure here means the bytes an entry is stored as (or a key is computed from) changed. Stores
# written before would then be misread or silently miss. If the change is deliberate, bump
# kvstore.store.entry.FORMAT_VERSION (which also changes every cache key), teach the decoder to read the
# old version or refuse it, and regenerate with KVSTORE_REGEN_GOLDEN=1.
GOLDEN_FP = hashlib.sha256(b"kvstore golden model").hexdigest()


def golden_entry(codec: str) -> bytes:
    ids = torch.tensor([1, 2, 3, 5, 8, 13])
    layers = []
    for i in range(2):
        k = (torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4) - 20) / 8 + i
        layers.append((k, -2 * k))
    return encode_entry(
        Entry(cache_key(GOLDEN_FP, torch.float32, ids), GOLDEN_FP, "golden", ids, tuple(layers), 1700000000.25), codec
    )


GOLDEN_KEYS = {  # name -> (fingerprint, dtype, token ids)
    "f32_short": ("a" * 64, "float32", [1, 2, 3]),
    "bf16_empty": (GOLDEN_FP, "bfloat16", []),
    "f16_range": (GOLDEN_FP, "float16", list(range(1000))),
    "f64_extremes": (GOLDEN_FP, "float64", [0, 2**32 - 1, 2**31]),
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


def _golden_facts() -> dict:
    facts: dict = {"format_version": FORMAT_VERSION, "zstd_version": zstandard.ZSTD_VERSION, "entries": {}}
    for codec in ("raw", "zstd-shuffle:1"):
        blob = golden_entry(codec)
        header, payload = split(blob)
        if header["codec"]["name"] == "zstd":
            decompressed = zstandard.ZstdDecompressor().stream_reader(payload, read_across_frames=True).read()
            header = dict(header, codec=dict(header["codec"], frames=[d for _, d in header["codec"]["frames"]]))
        else:
            decompressed = payload
        facts["entries"][codec] = {
            "sha256": hashlib.sha256(blob).hexdigest(),
            "size": len(blob),
            "header": header,  # zstd: only the frames' decompressed sizes (compressed ones follow libzstd)
            "decompressed_sha256": hashlib.sha256(decompressed).hexdigest(),
        }
    facts["cache_keys"] = {name: cache_key(*args) for name, args in GOLDEN_KEYS.items()}
    facts["config_digest"] = config_digest(GOLDEN_CONFIG)
    return facts


@pytest.fixture(scope="module")
def golden() -> dict:
    path = GOLDEN / "format_v1.json"
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(_golden_facts(), indent=2, sort_keys=True) + "\n")
        for codec in ("raw", "zstd-shuffle:1"):
            (GOLDEN / f"entry_v1_{codec.replace(':', '-')}.kvs").write_bytes(golden_entry(codec))
    return json.loads(path.read_text())


def test_golden_format_version(golden):
    assert FORMAT_VERSION == golden["format_version"] == 1


@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle:1"])
def test_golden_entry_bytes(golden, codec):
    want = golden["entries"][codec]
    facts = _golden_facts()["entries"][codec]
    assert facts["header"] == want["header"], "entry header changed: bump FORMAT_VERSION (see comment above)"
    assert facts["decompressed_sha256"] == want["decompressed_sha256"], "payload layout changed: bump FORMAT_VERSION"
    if codec == "raw" or zstandard.ZSTD_VERSION == tuple(golden["zstd_version"]):
        # compressed bytes are only reproducible with the libzstd that wrote them
        assert facts["sha256"] == want["sha256"] and facts["size"] == want["size"]


@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle:1"])
def test_golden_files_still_decode(codec):
    """Entries written by format v1 stay readable, whatever this version writes."""
    blob = (GOLDEN / f"entry_v1_{codec.replace(':', '-')}.kvs").read_bytes()
    decoded = decode_entry(blob, key=cache_key(GOLDEN_FP, "float32", [1, 2, 3, 5, 8, 13]))
    want = golden_entry(codec)
    want_decoded = decode_entry(want)
    header = decoded.header
    assert header.model_name == "golden" and header.created == 1700000000.25
    for name, rec in want_decoded.records.items():
        assert torch.equal(decoded.records[name].materialize(), rec.materialize())
    if codec == "raw":
        assert blob == want


def test_golden_cache_keys(golden):
    for name, (fp, dtype, ids) in GOLDEN_KEYS.items():
        assert cache_key(fp, dtype, ids) == golden["cache_keys"][name], f"cache_key changed for {name}"
    fp, dtype, ids = GOLDEN_KEYS["f32_short"]
    # every input matters; equivalent spellings do not
    assert cache_key(fp, torch.float32, torch.tensor(ids)) == golden["cache_keys"]["f32_short"]
    assert (
        len(
            {
                cache_key(fp, dtype, ids),
                cache_key(fp, "float16", ids),
                cache_key("b" * 64, dtype, ids),
                cache_key(fp, dtype, ids[:2]),
            }
        )
        == 4
    )
    for bad in ([-1], [2**32], [[1, 2]]):
        with pytest.raises(ValueError):
            cache_key(fp, dtype, bad)


def test_golden_config_digest(golden):
    assert config_digest(GOLDEN_CONFIG) == golden["config_digest"]
    volatile = dict(
        GOLDEN_CONFIG, transformers_version="9.9", torch_dtype="bfloat16", _name_or_path="/x", use_cache=False
    )
    assert config_digest(volatile) == golden["config_digest"]
    assert config_digest(dict(GOLDEN_CONFIG, hidden_size=64)) != golden["config_digest"]


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


@pytest.mark.parametrize("field", ["raw_bytes", "n_tokens", "kv_heads", "head_dim", "n_layers"])
def test_huge_declared_sizes(field):
    header, payload = split(encode(kv_layers(n_layers=1), "zstd-shuffle:1"))
    header[field] = 1 << 40
    _raises_small(lambda: decode_entry(assemble(header, payload)))


def test_huge_shape_with_consistent_raw_bytes():
    # the header is self-consistent (raw_bytes matches the shape); only the payload size betrays it
    header, payload = split(encode(kv_layers(n_layers=1), "raw"))
    header["n_tokens"] = 1 << 30
    header["raw_bytes"] = 2 * header["kv_heads"] * header["head_dim"] * (1 << 30) * 4 + 8 * (1 << 30)
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
