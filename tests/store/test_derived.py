"""Derived entries (format 5): a context's scores and pressed caches. Keys, round trips (exact for
scores and lossless codecs, within each codec's bound for int8/int4/fp8 and the pre-rotation codecs
at the kept tokens' true positions), bad input, damage, the format boundary with chunk entries, the
store's methods (written once, verified reads, a miss for anything corrupt or mismatched, access
times, prefetch, the local tier), golden files, and that every older golden file still decodes to
the same tensors."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings

import pytest
import torch

from helpers.entries import assemble, bits, golden_facts, make_entry, split
from helpers.paths import GOLDEN
from kvstore.errors import CodecError, CorruptEntryError, CorruptEntryWarning, FormatVersionError, ReadOnlyStoreError
from kvstore.store import frame as header_mod
from kvstore.store import owned as derived_mod
from kvstore.store.codecs import get_codec
from kvstore.store.codecs.prerope import Rotary, rotate
from kvstore.store.entry import decode_entry
from kvstore.store.header import read_header
from kvstore.store.keyspace import access_key, derived_entry_key
from kvstore.store.kind_pressed import encode_pressed
from kvstore.store.kind_scores import encode_scores
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import PRESSED, SCORES, DerivedFacts, decode_derived, derived_key_of, read_derived_header

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"
CONTEXT = hashlib.sha256(b"kvstore golden context").hexdigest()
FP = hashlib.sha256(b"kvstore golden model").hexdigest()
ROTARY = Rotary(tuple(float(f) for f in 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))))
PRESS = {"method": "kvzip", "ratio": 0.75, "budget": "global", "params": {"chunk": 2048}, "scorer": "kvzip:chunk=2048"}


def facts(n_tokens: int = 40, dtype: str = "float32", context: str = CONTEXT) -> DerivedFacts:
    return DerivedFacts(context, FP, "golden", dtype, n_tokens, {"device": "cpu", "attn": "sdpa"})


def scores(n_layers=2, heads=3, n=40, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(heads, n, generator=g, dtype=torch.float64).to(dtype) for _ in range(n_layers)]


def pressed(counts=((3, 0, 10), (40, 1, 7)), n=40, dim=16, dtype=torch.float32, seed=0, contiguous=False):
    """``layers[i][h] = (keys, values, positions)`` keeping ``counts[i][h]`` tokens of ``n``
    (``contiguous``: the last ones), keys rotated at their positions as a model's are."""
    g = torch.Generator().manual_seed(seed)
    channels = torch.randn(dim, generator=g, dtype=torch.float64) * 3
    channels[2] *= 10
    layers = []
    for row in counts:
        heads = []
        for m in row:
            pos = torch.arange(n - m, n) if contiguous else torch.sort(torch.randperm(n, generator=g)[:m]).values
            # steady channels before the rotation (one large), as a model's keys have
            pre = torch.randn(1, m, dim, generator=g, dtype=torch.float64) * 0.3 + channels
            keys = rotate(pre, ROTARY, 0, positions=pos)[0].to(dtype) if m else torch.empty(0, dim, dtype=dtype)
            heads.append((keys, torch.randn(m, dim, generator=g, dtype=torch.float64).to(dtype), pos))
        layers.append(heads)
    return layers


def time_fixed(monkeypatch) -> None:
    monkeypatch.setattr(derived_mod.time, "time", lambda: 1700000000.75)


# -- keys ---------------------------------------------------------------------------------------------
def test_derived_key_is_the_documented_hash():
    want = hashlib.sha256(b"kvstore-derived\0" + struct.pack("<I", 1) + b"c\0pressed\0kvzip:0.75\0int8:128/64\0")
    assert derived_key_of("c", "pressed", "kvzip:0.75", "int8:128/64") == want.hexdigest()
    base = derived_key_of(CONTEXT, PRESSED, "kvzip:0.75", "")
    others = [
        derived_key_of(CONTEXT[::-1], PRESSED, "kvzip:0.75", ""),
        derived_key_of(CONTEXT, SCORES, "kvzip:0.75", ""),
        derived_key_of(CONTEXT, PRESSED, "kvzip:0.5", ""),
        derived_key_of(CONTEXT, PRESSED, "kvzip:0.75", "int8"),
    ]
    assert len({base, *others}) == 5


# -- round trips ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["raw", "zstd-split:1:16", "zstd-shuffle:1", "int8+zstd:1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scores_round_trip_exactly(codec, dtype):
    want = scores(dtype=dtype)
    want[0][0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0], dtype=dtype)
    key, blob = encode_scores(facts(), "kvzip:chunk=2048", PRESS, want, codec)
    view = decode_derived(blob, key=key)
    h = view.header
    assert key == derived_key_of(CONTEXT, SCORES, "kvzip:chunk=2048", "")  # scores: never a lossy identity
    assert (h.kind, h.context, h.spec, h.n_tokens, h.format, h.lossless, h.identity) == (
        SCORES, CONTEXT, "kvzip:chunk=2048", 40, 5, True, "")  # fmt: skip
    assert h.codec_spec == get_codec(codec).packing.spec and dict(h.press) == PRESS
    assert h.scores_dtype == str(dtype).removeprefix("torch.") and h.kept_fraction == 1.0
    for i, t in enumerate(want):
        assert torch.equal(bits(view.scores(i)), bits(t))
    with pytest.raises(KeyError):
        view.kv(0, 0)


@pytest.mark.parametrize("codec", ["raw", "zstd-split:1:16", "zstd-shuffle:1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pressed_round_trips_exactly_under_lossless_codecs(codec, dtype):
    layers = pressed(counts=((3, 0, 10), (0, 0, 0), (40, 1, 7)), dtype=dtype)
    key, blob = encode_pressed(facts(dtype=str(dtype).removeprefix("torch.")), "kvzip:0.75", PRESS, layers, codec)
    view = decode_derived(blob, key=key, threads=2)
    h = view.header
    assert key == derived_key_of(CONTEXT, PRESSED, "kvzip:0.75", "") and h.identity == ""
    assert [layer.counts for layer in h.layers] == [(3, 0, 10), (0, 0, 0), (40, 1, 7)]
    assert h.kept_pairs == 61 and h.kept_fraction == pytest.approx(61 / (9 * 40))
    assert h.kv_bytes == 2 * 61 * 16 * dtype.itemsize and h.data_bytes == h.kv_bytes + 4 * 61
    for i, heads in enumerate(layers):
        assert torch.equal(view.positions(i), torch.cat([p for _, _, p in heads]))
        for j, (k, v, _) in enumerate(heads):
            rk, rv = view.kv(i, j)
            assert rk.shape == (1, k.shape[0], 16) and rk.dtype == dtype
            assert torch.equal(bits(rk.materialize()[0]), bits(k)) and torch.equal(bits(rv.materialize()[0]), bits(v))
    dest = torch.full((2, 1, 50, 16), float("nan"), dtype=dtype)
    view.kv(0, 2)[0].copy_into(dest[1, :, 5:15])  # a strided view of a batch buffer
    assert torch.equal(bits(dest[1, 0, 5:15]), bits(layers[0][2][0]))
    with pytest.raises(KeyError):
        view.scores(0)
    with pytest.raises(IndexError):
        view.kv(0, 3)


@pytest.mark.parametrize("spec, bound", [("int8", 0.02), ("int4", 0.35), ("fp8", 0.15), ("int8+zstd:1", 0.02),
                                         ("int4:32/64+zstd-shuffle:1", 0.35), ("int4h", 0.35)])  # fmt: skip
def test_pressed_under_lossy_codecs(spec, bound):
    layers = pressed()
    key, blob = encode_pressed(facts(), "kvzip:0.75", PRESS, layers, spec)
    view = decode_derived(blob, key=key)
    codec = get_codec(spec)
    assert key == derived_key_of(CONTEXT, PRESSED, "kvzip:0.75", codec.identity) and view.header.identity
    assert not view.header.lossless and view.header.codec_spec == codec.spec
    for i, heads in enumerate(layers):
        for j, (k, v, pos) in enumerate(heads):
            for want, got in zip((k, v), view.kv(i, j)):
                got = got.materialize()[0]
                assert got.shape == want.shape
                if want.numel():
                    err = float((got - want).abs().max()) / float(want.abs().max())
                    assert err < bound, (i, j, err)
            if spec != "fp8" and pos.numel() and int(pos[0]) == 0:  # the context's first token kept exactly
                assert torch.equal(view.kv(i, j)[0].materialize()[0, 0], k[0])


@pytest.mark.parametrize("spec", ["int8", "int4", "int4r", "int8r", "ecq", "int4h"])
def test_contiguous_positions_store_what_a_chunk_stores(spec):
    """A head keeping tokens start..start+n is quantized exactly as a chunk of those tokens is."""
    q = get_codec(spec).quantizer
    if hasattr(q, "with_rotary"):
        q = q.with_rotary(ROTARY)
    x = pressed(counts=((30,),), n=100, contiguous=True)[0][0][0].unsqueeze(0)
    for start in (0, 70):
        pos = torch.arange(start, start + 30)
        for role in ("keys", "values"):
            a, b = q.encode(role, x, start), q.encode(role, x, positions=pos)
            assert [s for s, _ in a] == [s for s, _ in b]
            assert all(torch.equal(bits(s), bits(t)) for (_, s), (_, t) in zip(a, b)), (spec, start, role)


@pytest.mark.parametrize("spec, bound", [("int8r", 0.03), ("int4r", 0.4), ("ecq", 0.4)])
def test_pre_rotation_codecs_use_the_true_positions(spec, bound):
    layers = pressed(counts=((25, 0, 12),), n=400)
    key, blob = encode_pressed(facts(n_tokens=400), "snapkv:0.9", PRESS, layers, spec, rotary=ROTARY)
    view = decode_derived(blob, key=key)
    assert view.header.codec["quant"]["rotary"]["inv_freq"] == list(ROTARY.inv_freq)
    errors = []
    for j, (k, _, _) in enumerate(layers[0]):
        if k.numel():
            got = view.kv(0, j)[0].materialize()[0]
            errors.append(float((got - k).abs().max()) / float(k.abs().max()))
    assert max(errors) < bound, errors
    # the same keys taken as tokens 100.. un-rotate at the wrong angles: their channels swing, and
    # the codes lose precision (what the true positions avoid)
    shifted = [[(k, v, torch.arange(100, 100 + k.shape[0])) for k, v, _ in layers[0]]]
    view = decode_derived(encode_pressed(facts(n_tokens=400), "snapkv:0.9", PRESS, shifted, spec, rotary=ROTARY)[1])
    wrong = [float((view.kv(0, j)[0].materialize()[0] - k).abs().max()) / float(k.abs().max())
             for j, (k, _, _) in enumerate(layers[0]) if k.numel()]  # fmt: skip
    assert min(w / e for w, e in zip(wrong, errors)) > 1.5, (wrong, errors)
    with pytest.raises(CodecError, match="rotary"):
        encode_pressed(facts(n_tokens=400), "snapkv:0.9", PRESS, layers, spec)


# -- bad input ----------------------------------------------------------------------------------------
def _bad_pressed(edit):
    layers = pressed()
    edit(layers)
    return layers


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda L: L[0].__setitem__(0, (L[0][0][0], L[0][0][1], L[0][0][2].flip(0))), "ascending"),
        (lambda L: L[0].__setitem__(0, (L[0][0][0], L[0][0][1], L[0][0][2] + 40)), "ascending"),
        (lambda L: L[0].__setitem__(0, (L[0][0][0].double(), L[0][0][1], L[0][0][2])), "float32"),
        (lambda L: L[0].__setitem__(0, (L[0][0][0][:2], L[0][0][1], L[0][0][2])), r"\[3, 16\]"),
        (lambda L: L[0].__setitem__(0, (L[0][0][0][:, :8], L[0][0][1][:, :8], L[0][0][2])), "head_dim"),
        (lambda L: L[0].__setitem__(0, (L[0][0][0], L[0][0][1], L[0][0][2].float())), "int64"),
        (lambda L: L.__setitem__(1, []), "KV head"),
    ],
)
def test_pressed_bad_input_is_one_value_error(edit, match):
    with pytest.raises(ValueError, match=match):
        encode_pressed(facts(), "kvzip:0.75", PRESS, _bad_pressed(edit), "raw")


def test_bad_facts_and_press():
    with pytest.raises(ValueError, match="not a key"):
        encode_scores(facts(context="xyz"), "s", {}, scores(), "raw")
    with pytest.raises(ValueError, match="press"):
        encode_scores(facts(), "s", {"ratio": float("nan")}, scores(), "raw")
    with pytest.raises(ValueError, match="press"):
        encode_scores(facts(), "s", {"f": object()}, scores(), "raw")
    with pytest.raises(ValueError, match="spec"):
        encode_scores(facts(), "", {}, scores(), "raw")
    with pytest.raises(ValueError, match=r"\[kv_heads, 40\]"):
        encode_scores(facts(), "s", {}, scores(n=39), "raw")
    with pytest.raises(ValueError, match="float32 or float64"):
        encode_scores(facts(), "s", {}, [scores()[0], scores(dtype=torch.float64)[1]], "raw")
    with pytest.raises(ValueError, match="float32 or float64"):
        encode_scores(facts(), "s", {}, [t.half() for t in scores()], "raw")


# -- damage and the format boundary ---------------------------------------------------------------------
def _blobs() -> list[tuple[str, bytes]]:
    return [encode_scores(facts(), "kvzip:chunk=2048", PRESS, scores(), "zstd:1"),
            encode_pressed(facts(), "kvzip:0.75", PRESS, pressed(), "int8+zstd:1"),
            encode_pressed(facts(), "kvzip:0.75", PRESS, pressed(), "raw")]  # fmt: skip


@pytest.mark.parametrize("which", range(3))
def test_every_flipped_byte_and_truncation_is_corrupt(which):
    key, blob = _blobs()[which]
    for pos in range(0, len(blob), max(1, len(blob) // 97)):
        bad = bytearray(blob)
        bad[pos] ^= 0x41
        with pytest.raises(CorruptEntryError):
            decode_derived(bytes(bad), key=key)
    for n in (0, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptEntryError):
            decode_derived(blob[:n], key=key)


def _resealed(blob: bytes, edit) -> bytes:
    header, payload = split(blob)
    edit(header)
    return assemble(header, payload)


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.update(context="0" * 64),  # the key no longer matches its facts
        lambda h: h.update(spec="kvzip:0.5"),
        lambda h: h.update(kind="scores"),
        lambda h: h.update(key="0" * 64),
        lambda h: h["layers"][0].update(counts=[3, 0, 9]),
        lambda h: h["layers"][0].update(counts=[3, 0, 41]),
        lambda h: h["layers"][0].update(counts=[3, 0]),
        lambda h: h["layers"][0].update(head_dim=8),
        lambda h: h.update(n_tokens=10**15),
        lambda h: h.update(raw_bytes=1 << 50),
        lambda h: h.update(press=[1, 2]),
        lambda h: h.update(press={"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}}),
        lambda h: h.update(scores_dtype="float32"),
        lambda h: h["codec"].update(quant={"name": "int4", "args": "32/64"}),
        lambda h: h.pop("numerics"),
    ],
)
def test_resealed_header_edits_are_corrupt(edit):
    key, blob = _blobs()[1]
    with pytest.raises(CorruptEntryError):
        decode_derived(_resealed(blob, edit))


def test_positions_out_of_order_are_corrupt():
    layers = pressed(counts=((3, 2),))
    key, blob = encode_pressed(facts(), "kvzip:0.75", PRESS, layers, "raw")
    header, payload = split(blob)
    want = torch.cat([p for _, _, p in layers[0]]).to(torch.int32)
    at = payload.index(want.numpy().tobytes())
    swapped = torch.cat([want[:3].flip(0), want[3:]]).numpy().tobytes()
    with pytest.raises(CorruptEntryError, match="ascending"):
        decode_derived(assemble(header, payload[:at] + swapped + payload[at + len(swapped) :]))


def test_format_boundary_with_chunk_entries(monkeypatch):
    key, blob = _blobs()[0]
    with pytest.raises(CorruptEntryError, match="derived entry"):
        read_header(blob)  # a chunk reader takes it for corrupt: format 5 is read only as a derived entry
    with pytest.raises(CorruptEntryError):
        decode_entry(blob)
    chunk = KVStore("memory://").encode(make_entry(1))
    with pytest.raises(CorruptEntryError, match="chunk entry"):
        read_derived_header(chunk)
    monkeypatch.setattr(header_mod, "FORMAT_VERSION", 4)  # a kvstore of format 4 refuses it, never misreads it
    with pytest.raises(FormatVersionError, match="written by format version 5.*upgrade kvstore"):
        decode_derived(blob)
    monkeypatch.setattr(header_mod, "FORMAT_VERSION", 5)
    future = _resealed(blob, lambda h: h.update(format=6))
    with pytest.raises(FormatVersionError, match="upgrade kvstore"):
        decode_derived(future)


# -- the store --------------------------------------------------------------------------------------------
@pytest.fixture(params=["memory", "lmdb"])
def url(request, tmp_path) -> str:
    return f"memory://derived-{tmp_path.name}" if request.param == "memory" else str(tmp_path / "store")


def test_store_puts_and_opens_derived_entries(url):
    (skey, sblob), (pkey, pblob), _ = _blobs()
    with KVStore(url) as s:
        assert not s.has_derived(CONTEXT, pkey) and s.derived_keys(CONTEXT) == []
        with s.open_derived(CONTEXT, pkey) as view:
            assert view is None
        assert s.put_derived(sblob) == len(sblob) and s.put_derived(pblob) == len(pblob)
        assert s.has_derived(CONTEXT, pkey) and s.derived_keys(CONTEXT) == sorted([skey, pkey])
        assert s.backend.get(derived_entry_key(CONTEXT, pkey)) == pblob
        with s.open_derived(CONTEXT, pkey) as view:
            assert view.header.kind == PRESSED and view.kv(1, 0)[0].shape == (1, 40, 16)
        with s.open_derived(CONTEXT, skey) as view:
            assert torch.equal(view.scores(1), decode_derived(sblob).scores(1))
        assert s.keys() == [] and len(s) == 0  # derived entries are not chunks
        s.prefetch([], derived=[(CONTEXT, pkey)])  # a no-op on a local store
    with KVStore(url, readonly=True) as s:
        assert s.recorded_access([pkey, skey]).keys() == {pkey, skey}  # last uses, written at close
        with pytest.raises(ReadOnlyStoreError):
            s.put_derived(sblob)


def test_one_put_and_one_open_for_every_kind(url):
    """``store.put(blob)`` reads the kind, owner and key from the frame; ``store.open(kind, key,
    owner=)`` is the verified open of every kind, and the old names are the same path."""
    from kvstore.store.access import kind_of_blob
    from kvstore.store.kinds import find_kind

    (skey, sblob), (pkey, pblob), _ = _blobs()
    entry = make_entry(seed=3)
    with KVStore(url) as s:
        chunk_blob = s.encode(entry)
        for blob in (sblob, pblob, chunk_blob):
            assert s.put(blob) == len(blob)
        assert [kind_of_blob(b)[0].name for b in (sblob, pblob, chunk_blob)] == ["scores", "pressed", "chunk"]
        assert kind_of_blob(pblob)[1:] == (CONTEXT, pkey) and kind_of_blob(chunk_blob)[1:] == ("", entry.key)
        assert s.backend.get(derived_entry_key(CONTEXT, pkey)) == pblob and s.keys() == [entry.key]
        pressed_kind, chunk = find_kind("pressed"), find_kind("chunk")
        assert s.has(pressed_kind, pkey, owner=CONTEXT) and s.has(chunk, entry.key)
        with s.open(pressed_kind, pkey, owner=CONTEXT) as view, s.open_derived(CONTEXT, pkey) as old:
            assert view.header == old.header and view.header.kind == PRESSED
        with s.open(chunk, entry.key) as view, s.open_entry(entry.key) as old:
            assert view.header == old.header and s[entry.key].key == entry.key
        fresh = s.encode(make_entry(seed=4))
        with pytest.raises(CorruptEntryError):
            s.put(fresh[:-1] + bytes([fresh[-1] ^ 1]))  # bytes are verified before they are stored
        assert s.keys() == [entry.key]


def test_the_one_put_takes_every_golden_format():
    """Every format's golden entry (chunks of formats 1 to 4 and 6, owned entries of format 5) goes
    through ``put(blob)`` and reads back through ``open(kind, key, owner)``."""
    from kvstore.store.access import kind_of_blob

    paths = sorted(GOLDEN.glob("*.kvs"))
    assert len(paths) > 10
    with KVStore("memory://golden-put") as s:
        for path in paths:
            blob = path.read_bytes()
            kind, owner, key = kind_of_blob(blob)
            assert s.put(blob) == len(blob) and s.has(kind, key, owner), path.name
            with s.open(kind, key, owner) as view:
                assert view is not None and view.header.key == key, path.name


def test_written_once_and_a_corrupt_copy_replaced(url, monkeypatch):
    key, blob = _blobs()[1]
    with KVStore(url) as s:
        s.put_derived(blob)
        again = encode_pressed(facts(), "kvzip:0.75", {"other": "press record"}, pressed(), "int8+zstd:1")[1]
        assert again != blob
        s.put_derived(again)  # another writer's copy of the same entry: the first stays
        assert s.backend.get(derived_entry_key(CONTEXT, key)) == blob
        bad = bytearray(blob)
        bad[-30] ^= 1
        s.backend.put(derived_entry_key(CONTEXT, key), bytes(bad))
        with pytest.warns(CorruptEntryWarning, match="treating it as a miss") as caught:
            with s.open_derived(CONTEXT, key) as view:
                assert view is None
        assert len([w for w in caught if w.category is CorruptEntryWarning]) == 1  # once
        s.put_derived(again)
        assert s.backend.get(derived_entry_key(CONTEXT, key)) == again


def test_a_derived_entry_of_another_context_is_a_miss(url):
    key, blob = _blobs()[0]
    other = "9" * 64
    with KVStore(url) as s:
        s.backend.put(derived_entry_key(other, key), blob)  # stored under the wrong context
        with pytest.warns(CorruptEntryWarning, match=f"belongs to context {CONTEXT[:12]}"):
            with s.open_derived(other, key) as view:
                assert view is None
        with pytest.raises(CorruptEntryError):
            s.put_derived(blob[:-1] + bytes([blob[-1] ^ 1]))


def test_local_tier_drops_a_bad_copy_and_reads_the_remote(tmp_path):
    n = 1000  # an entry above the tier's small-value size, which it serves without asking the remote
    key, blob = encode_pressed(facts(n_tokens=n), "kvzip:0.5", PRESS, pressed(((600, 500, 700),), n=n), "raw")
    remote, tier = str(tmp_path / "remote"), str(tmp_path / "tier")
    with KVStore(remote) as s:
        s.put_derived(blob)
    with KVStore(remote, cache_dir=tier) as s:
        with s.open_derived(CONTEXT, key) as view:  # read through: now in the tier
            assert view is not None
        name = derived_entry_key(CONTEXT, key)
        s.backend.tier.put(b"v/" + name, blob[:-9] + b"\0" * 9)  # the tier's copy goes bad
        with pytest.warns(CorruptEntryWarning, match="local tier's copy of derived entry"):
            with s.open_derived(CONTEXT, key) as view:
                assert view is not None and view.header.key == key
        with s.backend.local_copy(name) as copy:
            assert bytes(copy) == blob  # refilled from the remote


def test_prefetch_asks_the_backend_for_derived_keys():
    asked = []
    with KVStore("memory://") as s:
        s.backend.prefetch = asked.extend  # type: ignore[method-assign]
        s.prefetch(["a" * 64, "a" * 64], derived=[(CONTEXT, "b" * 64)])
    assert asked == [b"e/" + b"a" * 64, derived_entry_key(CONTEXT, "b" * 64)]


def test_access_key_of_a_derived_entry_is_its_own():
    key, _ = _blobs()[0]
    assert access_key(key) == b"a/" + key.encode()


# -- golden --------------------------------------------------------------------------------------------------
GOLDEN_DERIVED = {
    "scores_raw": lambda: encode_scores(facts(), "kvzip:chunk=2048", PRESS, scores(), "raw"),
    "pressed_raw": lambda: encode_pressed(facts(), "kvzip:0.75", PRESS, pressed(), "raw"),
    "pressed_int8": lambda: encode_pressed(facts(), "kvzip:0.75", PRESS, pressed(), "int8"),
}


def _decoded_sha(blob: bytes) -> str:
    view = decode_derived(blob)
    h = hashlib.sha256()
    for i, layer in enumerate(view.header.layers):
        if view.header.kind == SCORES:
            h.update(bits(view.scores(i)).numpy().tobytes())
            continue
        h.update(view.positions(i).numpy().tobytes())
        for j in range(layer.kv_heads):
            for t in view.kv(i, j):
                h.update(bits(t.materialize()).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", list(GOLDEN_DERIVED))
def test_golden_derived_entries(name, monkeypatch):
    time_fixed(monkeypatch)
    path, kvs = GOLDEN / "format_v5_derived.json", GOLDEN / f"entry_v5_{name}.kvs"
    key, blob = GOLDEN_DERIVED[name]()
    facts_now = golden_facts(blob) | {"key": key, "decoded_sha256": _decoded_sha(blob)}
    if REGEN:
        pinned = json.loads(path.read_text()) if path.exists() else {}
        pinned[name] = facts_now
        path.write_text(json.dumps(pinned, indent=2, sort_keys=True) + "\n")
        kvs.write_bytes(blob)
    want = json.loads(path.read_text())[name]
    assert facts_now["key"] == want["key"], "derived keys changed: bump derived.KEY_VERSION"
    assert facts_now["header"] == want["header"], "derived entry header changed: bump FORMAT_VERSION"
    assert facts_now == want, "derived entry bytes changed: bump FORMAT_VERSION"
    stored = kvs.read_bytes()
    assert stored == blob and _decoded_sha(stored) == want["decoded_sha256"]


def test_every_older_golden_file_still_decodes_to_the_same_tensors():
    """The decoded tensors of every golden entry of formats 1 to 4, as the kvstore before derived
    entries decoded them (pinned in decoded_v1_v4.json from that commit)."""
    pinned = json.loads((GOLDEN / "decoded_v1_v4.json").read_text())
    older = sorted(p.name for p in GOLDEN.glob("entry_v[1-4]_*.kvs"))
    assert older == sorted(pinned)
    for name in older:
        view = decode_entry((GOLDEN / name).read_bytes())
        h = hashlib.sha256()
        for rec in sorted(view.records):
            h.update(rec.encode())
            h.update(bits(view.records[rec].materialize()).numpy().tobytes())
        for kv in view.layers:
            for t in kv or ():
                h.update(bits(t.materialize()).numpy().tobytes())
        assert h.hexdigest() == pinned[name], name


def test_no_warning_on_a_clean_read(url):
    key, blob = _blobs()[2]
    with KVStore(url) as s:
        s.put_derived(blob)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with s.open_derived(CONTEXT, key) as view:
                assert view is not None
