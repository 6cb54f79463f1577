"""The ``zstd-split`` packing: bit-exact round trips on every dtype and layer kind, its golden
bytes, hostile payloads, old codecs still read beside it, and the codecs package's imports."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import zstandard

from helpers.entries import assemble, bits, encode, kv_layers, rle_frame, split
from helpers.paths import GOLDEN, REPO
from kvstore.errors import CodecError, CorruptEntryError
from kvstore.store.codecs import DEFAULT_CODEC, LEGACY_CODEC, Codec, get_codec
from kvstore.store.codecs.split import SplitRecord
from kvstore.store.entry import Entry, decode_entry, encode_entry
from kvstore.store.keys import chain_keys, chain_seed
from kvstore.store.kvstore import KVStore

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _check_layers(view, layers, pad: int = 3) -> None:
    """Every layer of ``view`` copied into a padded buffer (a strided destination, as a load
    does) and materialized holds exactly the bits of ``layers``; the pad slots stay untouched."""
    for got, want in zip(view.layers, layers):
        for rec, t in zip(got, want):
            h, n, d = t.shape
            buf = torch.zeros(2, h, n + pad, d, dtype=t.dtype)
            rec.copy_into(buf[1, :, pad:])
            assert torch.equal(bits(buf[1, :, pad:]), bits(t))
            assert not bits(buf[1, :, :pad]).any() and not bits(buf[0]).any()
            assert torch.equal(bits(rec.materialize()), bits(t))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("shape", [(3, 2, 7, 8), (1, 3, 1, 5), (2, 1, 33, 64)])
def test_round_trip_bit_exact(dtype, lazy, shape):
    """NaN, infinities, -0.0, the smallest normal and the largest value included (kv_layers)."""
    layers = kv_layers(*shape, dtype=dtype, seed=sum(shape))
    for spec, split_widths in (
        ("zstd-split:1", (16, 32, 64)),
        ("zstd-split:1:16", (16,)),
        ("zstd-split:2:32,16", (16, 32)),
    ):
        view = decode_entry(encode(layers, spec), lazy=lazy)
        _check_layers(view, layers)
        assert isinstance(view.layers[0][0], SplitRecord) == (dtype.itemsize * 8 in split_widths)
        assert view.header.codec_spec == get_codec(spec).spec


def test_nan_payloads_and_subnormals_survive():
    """Every bit pattern of a 16-bit float, and float32 patterns with NaN payloads and subnormals."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        t = every.view(dtype).reshape(4, 128, 128)
        view = decode_entry(encode([(t, t.flip(1))], "zstd-split:3"), lazy=True)
        _check_layers(view, [(t, t.flip(1))])
    g = torch.Generator().manual_seed(1)
    words = torch.randint(-(2**31), 2**31, (2, 40, 16), generator=g, dtype=torch.int64).to(torch.int32)
    words[0, :4] = torch.tensor([0x7FC00001, 0x7F800001, -0x7FFFFFFF, 0x00000001], dtype=torch.int32)[:, None]
    t = words.view(torch.float32)
    _check_layers(decode_entry(encode([(t, -t)], "zstd-split:1")), [(t, -t)])


def test_every_layer_kind_and_states():
    """Sliding, state and hybrid layers (float64 KV, float32 states) through the same packing."""
    blob = golden_chunk("zstd-split:1")
    view, want = decode_entry(blob, lazy=True), decode_entry(golden_chunk("raw"))
    assert sorted(view.records) == sorted(want.records)
    for name, rec in want.records.items():
        assert torch.equal(bits(view.records[name].materialize()), bits(rec.materialize()))


def test_compresses_only_the_high_planes():
    """float32: bytes 0-2 stored as they are, byte 3 compressed; 16-bit: byte 0 raw, byte 1 compressed."""
    layers = kv_layers(2, 2, 64, 32, extremes=False)
    header, payload = split(encode(layers, "zstd-split:1"))
    codec = header["codec"]
    assert codec["planes"]["F32"] == [[2, 0], [1, 0], [1, 1]] and codec["planes"]["BF16"] == [[1, 0], [1, 1]]
    n = 2 * 64 * 32
    kv_parts = codec["parts"][1 : 1 + 3 * 4]  # header frame, then 3 parts per KV tensor
    assert [d for _, d in kv_parts] == [2 * n, n, n] * 4
    assert all(c == d for c, d in kv_parts[0::3] + kv_parts[1::3])  # raw planes
    assert all(c < d for c, d in kv_parts[2::3])  # sign and exponent bytes of normal floats compress
    assert len(payload) < 0.9 * 4 * n * 4
    # the default leaves float32 as it is: one raw part per KV tensor
    header, payload = split(encode(layers, DEFAULT_CODEC))
    assert header["codec"]["planes"]["F32"] == [[4, 0]] and header["codec"]["planes"]["F16"] == [[1, 0], [1, 1]]
    assert [c for c, _ in header["codec"]["parts"][1:5]] == [4 * n] * 4


def test_specs():
    assert DEFAULT_CODEC == "zstd-split:1:16" and get_codec("default").spec == "zstd-split:1:16"
    assert get_codec("zstd-split").spec == "zstd-split:1" and get_codec("zstd-split:3:64,16,32").spec == "zstd-split:3"
    assert get_codec("zstd-split:1:32,16").spec == "zstd-split:1:16,32"
    for bad in ("zstd-split:0", "zstd-split:x", "zstd-split:1:8", "zstd-split:1:", "zstd-split:1:16,x"):
        with pytest.raises(CodecError):
            get_codec(bad)


def test_lossy_quantizers_pack_with_it():
    layers = kv_layers(2, 2, 40, 16, extremes=False)
    for spec in ("int8+zstd-split", "int4:32/16+zstd-split:3", "fp8+zstd-split"):
        a = decode_entry(encode(layers, spec), lazy=True)
        b = decode_entry(encode(layers, spec.split("+")[0]))
        assert a.header.codec_spec == get_codec(spec).spec
        for (ka, va), (kb, vb) in zip(a.layers, b.layers):
            assert torch.equal(ka.materialize(), kb.materialize()) and torch.equal(va.materialize(), vb.materialize())


# -- hostile payloads ---------------------------------------------------------------------------
def _variant(blob: bytes, edit) -> bytes:
    header, payload = split(blob)
    header = json.loads(json.dumps(header))
    out = edit(header["codec"], payload)
    return assemble(header, out if isinstance(out, bytes) else payload)


@pytest.mark.parametrize(
    "edit",
    [
        lambda c, p: c.pop("parts"),
        lambda c, p: c.update(parts="x"),
        lambda c, p: c.update(parts=[[1, "a"]]),
        lambda c, p: c["parts"].append([0, 0]),  # one part too many
        lambda c, p: c["parts"][1].__setitem__(1, c["parts"][1][1] + 4),  # raw plane longer than stored
        lambda c, p: c["parts"][3].__setitem__(1, c["parts"][3][1] * 2),  # frame claims another size
        lambda c, p: c["planes"].update(F32=[[3, 0], [1, 1]]),  # a 3-byte unit cannot be copied
        lambda c, p: c["planes"].update(F32=[[1, 0], [2, 0], [1, 1]]),  # a 2-byte unit at an odd offset
        lambda c, p: c["planes"].update(F32=[[2, 0], [1, 1]]),  # planes do not cover the element
        lambda c, p: c["planes"].update(F32=[[2, 0], [2, 1]]),  # parts no longer line up
        lambda c, p: c["planes"].update(F32=[["a", 0]]),
        lambda c, p: c["planes"].pop("F32"),  # then one zstd frame: the raw planes are no frame
        lambda c, p: c.update(planes=[1]),
        lambda c, p: c.pop("planes"),
        lambda c, p: p[:-1],
    ],
)
def test_hostile_tables_are_corrupt(edit):
    blob = encode(kv_layers(2, 2, 9, 8), "zstd-split:1")
    bad = _variant(blob, edit)
    with pytest.raises(CorruptEntryError):
        view = decode_entry(bad, lazy=True)
        for k, v in view.layers:
            k.materialize(), v.materialize()


def test_misaligned_plane_table_is_refused_even_when_parts_line_up():
    """Planes of 1, 2 and 1 bytes: the 2-byte unit at byte 1 cannot be one strided copy."""
    packing = get_codec("zstd-split:1").packing
    packing.planes["F32"] = ((1, False), (2, False), (1, True))  # type: ignore[attr-defined]
    blob = encode(kv_layers(1, 2, 9, 8), Codec(get_codec("raw").quantizer, packing))
    with pytest.raises(CorruptEntryError, match="cannot be copied"):
        decode_entry(blob, lazy=True)


@pytest.mark.parametrize("lazy", [False, True])
def test_frame_claiming_more_than_the_table_is_never_decompressed(monkeypatch, lazy):
    """A frame whose own header claims 2 GiB (a few KB of RLE blocks) where the table says a few
    hundred bytes is refused before anything is decompressed (nothing allocated in full)."""
    import kvstore.store.codecs.split as split_module

    blob = encode(kv_layers(1, 2, 64, 8, extremes=False), "zstd-split:1")
    header, payload = split(blob)
    parts = header["codec"]["parts"]
    start = sum(c for c, _ in parts[:3])
    bomb = rle_frame(1 << 31)
    payload = payload[:start] + bomb + payload[start + parts[3][0] :]
    parts[3][0] = len(bomb)
    real = split_module._decompress

    def guarded(frame, size):
        assert zstandard.frame_content_size(frame) == size, "decompressed a frame the table disagrees with"
        return real(frame, size)

    monkeypatch.setattr(split_module, "_decompress", guarded)
    with pytest.raises(CorruptEntryError, match="declares"):
        view = decode_entry(assemble(header, payload), lazy=lazy)
        view.layers[0][0].materialize()


def test_damaged_frame_raises_on_copy_when_lazy():
    blob = encode(kv_layers(1, 2, 64, 8, extremes=False), "zstd-split:1")
    header, payload = split(blob)
    parts = header["codec"]["parts"]
    start = sum(c for c, _ in parts[:3])  # keys' compressed plane (after the header frame and 2 raw planes)
    frame = bytearray(payload[start : start + parts[3][0]])
    frame[-5] ^= 0xFF
    bad = assemble(header, payload[:start] + bytes(frame) + payload[start + parts[3][0] :])
    view = decode_entry(bad, lazy=True)  # only the header frame is decompressed here
    with pytest.raises(CorruptEntryError):
        view.layers[0][0].materialize()
    with pytest.raises(CorruptEntryError):
        decode_entry(bad)


# -- stores: the new default, and the old codecs beside it -------------------------------------------
def test_new_stores_default_and_old_codecs_still_read(tmp_path):
    layers = kv_layers(2, 2, 6, 8)
    old = {c: encode(layers, c, key=str(i) * 64) for i, c in enumerate(("raw", "zstd:3", "zstd-shuffle:1"))}
    keys = {c: str(i) * 64 for i, c in enumerate(old)}
    with KVStore(str(tmp_path / "s")) as store:
        assert store.codec.spec == get_codec(DEFAULT_CODEC).spec
        for c, blob in old.items():
            store.put_bytes(keys[c], blob)
    with KVStore(str(tmp_path / "s")) as store:
        for c in old:
            with store.open_entry(keys[c]) as view:
                assert view is not None and view.header.codec_spec == c
                _check_layers(view, layers)


def test_store_keeps_the_codec_it_was_created_with(tmp_path):
    with KVStore(str(tmp_path / "s"), codec="zstd-shuffle:1"):
        pass
    with KVStore(str(tmp_path / "s")) as store:
        assert store.codec.spec == "zstd-shuffle:1"
    with KVStore(str(tmp_path / "t")) as store:  # a description without a codec: the default of its time
        store.backend.put(b"meta", json.dumps({"format": 2, "created": 0}).encode())
    with KVStore(str(tmp_path / "t")) as store:
        assert store.codec.spec == LEGACY_CODEC


# -- golden: the zstd-split layout is pinned ---------------------------------------------------------
GOLDEN_FP = hashlib.sha256(b"kvstore golden model").hexdigest()


def golden_entry(dtype: torch.dtype, codec: str) -> bytes:
    """A whole context of two full-attention layers in ``dtype`` (float32 values that every dtype holds)."""
    ids = torch.tensor([1, 2, 3, 5, 8, 13])
    layers = []
    for i in range(2):
        k = ((torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4) - 20) / 8 + i).to(dtype)
        layers.append((k, -2 * k))
    name = str(dtype).removeprefix("torch.")
    key = chain_keys(chain_seed(GOLDEN_FP, name, device="cpu", attn="sdpa"), ids.tolist(), [(0, 6)])[0]
    numerics = {"device": "cpu", "attn": "sdpa", "torch": "2.13.0", "transformers": "5.23.0"}
    return encode_entry(Entry(key, GOLDEN_FP, "golden", ids, tuple(layers), 1700000000.25, numerics=numerics), codec)


def golden_chunk(codec: str) -> bytes:
    """A chain's second chunk with every layer kind (as tests/test_entry.py's golden chunk)."""
    ids = torch.tensor([21, 34, 55, 89, 144])
    g = torch.arange(2 * 5 * 4, dtype=torch.float64).reshape(2, 5, 4) / 16
    conv = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4
    ssm = -torch.arange(8, dtype=torch.float32).reshape(2, 2, 2)
    layers = ((g, -g), (g[:, 2:], g[:, 2:] + 1), None, (g + 2, g - 2))
    states = (None, None, {"conv": conv, "ssm": ssm}, {"conv": conv + 1, "ssm": ssm - 1})
    seed = chain_seed(GOLDEN_FP, "float64", device="cpu", attn="eager")
    keys = chain_keys(seed, list(range(6)) + ids.tolist(), [(0, 6), (6, 11)])
    return encode_entry(
        Entry(keys[1], GOLDEN_FP, "golden", ids, layers, 1700000000.5, parent=keys[0], start=6, states=states,
              kinds=("attn", "sliding", "state", "hybrid"), windows=(None, 4, None, None)),
        codec,
    )  # fmt: skip


GOLDEN_SPLIT = {  # file name part -> entry
    "context_float32_zstd-split-1": lambda: golden_entry(torch.float32, "zstd-split:1"),
    "context_float32_zstd-split-1-16": lambda: golden_entry(torch.float32, "zstd-split:1:16"),
    "context_bfloat16_zstd-split-1-16": lambda: golden_entry(torch.bfloat16, "zstd-split:1:16"),
    "context_float16_zstd-split-1-16": lambda: golden_entry(torch.float16, "zstd-split:1:16"),
    "chunk_zstd-split-1": lambda: golden_chunk("zstd-split:1"),
}


def split_facts(blob: bytes) -> dict:
    """What the golden file pins: the header (parts by their decompressed sizes only: compressed
    sizes follow libzstd), the payload decoded (raw planes as they are, frames decompressed), and
    the whole entry's sha256 and size (checked only under the libzstd that wrote them)."""
    header, payload = split(blob)
    decoded, pos = bytearray(), 0
    for c, d in header["codec"]["parts"]:
        part = payload[pos : pos + c]
        decoded += zstandard.ZstdDecompressor().decompress(part) if c != d or d == 0 else part
        pos += c
    header = dict(header, codec=dict(header["codec"], parts=[d for _, d in header["codec"]["parts"]]))
    return {
        "sha256": hashlib.sha256(blob).hexdigest(),
        "size": len(blob),
        "header": header,
        "decoded_sha256": hashlib.sha256(decoded).hexdigest(),
    }


def _file(name: str) -> Path:
    return GOLDEN / f"entry_v3_{name}.kvs"


@pytest.fixture(scope="module")
def golden() -> dict:
    path = GOLDEN / "format_v3_split.json"
    if REGEN:
        facts = {"zstd_version": zstandard.ZSTD_VERSION, "entries": {}}
        for name, make in GOLDEN_SPLIT.items():
            facts["entries"][name] = split_facts(make())
            _file(name).write_bytes(make())
        path.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", list(GOLDEN_SPLIT))
def test_golden_split_entries(golden, name):
    want, blob = golden["entries"][name], GOLDEN_SPLIT[name]()
    facts = split_facts(blob)
    assert facts["header"] == want["header"], "zstd-split header changed: a format change (see golden/README.md)"
    assert facts["decoded_sha256"] == want["decoded_sha256"], "zstd-split layout changed"
    if zstandard.ZSTD_VERSION == tuple(golden["zstd_version"]):
        assert facts["sha256"] == want["sha256"] and _file(name).read_bytes() == blob
    stored, fresh = decode_entry(_file(name).read_bytes(), lazy=True), decode_entry(blob)
    assert stored.header == fresh.header
    for rec_name, rec in fresh.records.items():
        assert torch.equal(bits(stored.records[rec_name].materialize()), bits(rec.materialize()))


# -- the codecs package has no import cycle --------------------------------------------------------
def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports anywhere (module level or inside functions;
    ``from package import child`` counts as importing ``package.child``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(package)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            for a in node.names:
                child = f"{node.module}.{a.name}"
                out.add(child if (path.parent / f"{a.name}.py").exists() and node.module == package else node.module)
    return out


def test_codecs_package_has_no_import_cycle():
    root = REPO / "kvstore" / "store" / "codecs"
    package = "kvstore.store.codecs"
    graph = {
        (package if p.stem == "__init__" else f"{package}.{p.stem}"): _imports(p, package) for p in root.glob("*.py")
    }
    assert graph[package] >= {f"{package}.base", f"{package}.split"}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = [m for m in graph if reaches(m, m, {m})]
    assert not cycles, f"import cycle through {cycles}"


@pytest.mark.parametrize(
    ("codec", "fmt"),
    [("raw", 2), ("zstd-shuffle:1", 2), ("zstd:3", 2), ("int8", 2), ("int4+zstd-shuffle:1", 2),
     ("zstd-split:1:16", 3), ("zstd-split:1", 3), ("int8+zstd-split:1", 3)],
)  # fmt: skip
def test_an_entry_is_written_in_the_format_its_codec_came_with(codec, fmt):
    """Codecs a format-2 reader knows keep writing format 2 (its golden files are unchanged);
    zstd-split (and int4r/int8r: tests/store/test_prerope.py) write format 3."""
    header, _ = split(golden_entry(torch.float32, codec))
    assert header["format"] == fmt and get_codec(codec).entry_format == fmt


def test_a_reader_of_format_2_refuses_a_format_3_entry_instead_of_taking_it_for_corrupt(monkeypatch):
    """What the previous release does with a zstd-split entry: FormatVersionError ("upgrade
    kvstore"), which its loads raise and its puts leave in place, where an unknown codec in a
    format-2 entry would have been a CorruptEntryError (a miss, recomputed and overwritten)."""
    from kvstore.errors import FormatVersionError
    from kvstore.store import frame as header_mod

    blob = golden_entry(torch.float32, "zstd-split:1:16")
    assert decode_entry(blob).header.format == 3
    monkeypatch.setattr(header_mod, "FORMAT_VERSION", 2)
    with pytest.raises(FormatVersionError, match="format version 3; this kvstore reads up to 2 - upgrade kvstore"):
        decode_entry(blob)


@pytest.mark.parametrize(
    "name",
    ["chunk_zstd-split-1", "context_bfloat16_zstd-split-1-16", "context_float16_zstd-split-1-16",
     "context_float32_zstd-split-1-16", "context_float32_zstd-split-1"],
)  # fmt: skip
def test_format_2_split_entries_of_the_pre_release_still_read(name):
    """Before entry format 3, zstd-split entries were written as format 2 (the files kept from
    then): they still decode, to the same tensors as the format-3 file of the same chunk."""
    old, new = (
        decode_entry((GOLDEN / f"entry_v2_{name}.kvs").read_bytes()),
        decode_entry((GOLDEN / f"entry_v3_{name}.kvs").read_bytes()),
    )
    assert old.header.format == 2 and new.header.format == 3 and old.header.codec_spec == new.header.codec_spec
    assert old.header.key == new.header.key and sorted(old.records) == sorted(new.records)
    for name, rec in old.records.items():
        assert torch.equal(bits(rec.materialize()), bits(new.records[name].materialize())), name
