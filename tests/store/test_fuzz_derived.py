"""Property-based fuzzing of the derived-entry decoder, as ``test_fuzz.py`` does entries: whatever
bytes a store hands back under ``x/``, decoding raises nothing but kvstore's own errors
(``CorruptEntryError``, ``FormatVersionError``), or yields tensors of exactly the declared shapes
within the declared size; ``KVStore.open_derived``, ``scan`` and ``verify`` never raise.

Inputs are valid derived entries (scores under raw and zstd; pressed caches under raw, int8, int4
and fp8 with zstd packings; heads keeping different counts, some none) mutated the ways damage and
attackers do: bit flips, truncation, extension, splices, and edits of the header (its fields, its
layer records, its counts, its codec), of the declared sizes kept consistent with each other and of
the safetensors header, *with the checksum recomputed* and, half the time, the key recomputed from
the edited facts, so that the decoder has to get past its first checks. ``KVSTORE_FUZZ_EXAMPLES``
sets the examples per property (150 in CI)."""

from __future__ import annotations

import functools
import json
import struct
import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from helpers.entries import assemble, seal, split
from helpers.fuzz import SOAK_EXAMPLES, big_ints, ci_settings, json_values
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store.codecs import codec_from_params
from kvstore.store.header import MAX_COMPRESSION_RATIO
from kvstore.store.keyspace import derived_entry_key
from kvstore.store.kind_pressed import encode_pressed
from kvstore.store.kind_scores import encode_scores
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import DerivedFacts, decode_derived, derived_key_of

CONTEXT = "c" * 64


@functools.cache
def base_entries() -> tuple[tuple[str, bytes], ...]:
    """(derived key, bytes) of each valid starting entry."""
    out = []
    g = torch.Generator().manual_seed(0)
    for i, (codec, dtype, counts, n) in enumerate([
        ("raw", torch.float32, ((3, 0, 5), (6, 6, 1)), 6),
        ("int8+zstd:1", torch.float32, ((4, 2),), 9),
        ("int4+zstd-shuffle:1", torch.float32, ((5, 0), (0, 0)), 8),
        ("fp8+zstd-split:1:16", torch.bfloat16, ((2, 7),), 7),
        ("zstd-split:1:16", torch.float16, ((1, 3),), 4),
    ]):  # fmt: skip
        facts = DerivedFacts(CONTEXT, "f" * 64, "tiny", str(dtype).removeprefix("torch."), n)
        layers = []
        for row in counts:
            heads = []
            for m in row:
                pos = torch.sort(torch.randperm(n, generator=g)[:m]).values
                heads.append((torch.randn(m, 8, generator=g).to(dtype), torch.randn(m, 8, generator=g).to(dtype), pos))
            layers.append(heads)
        out.append(encode_pressed(facts, f"p:{i}", {"ratio": 0.5, "n": i}, layers, codec))
    for codec, dtype in (("raw", torch.float32), ("zstd:1", torch.float64)):
        facts = DerivedFacts(CONTEXT, "f" * 64, "tiny", "float32", 5)
        out.append(encode_scores(facts, "s", {}, [torch.rand(2, 5, generator=g).to(dtype) for _ in range(2)], codec))
    return tuple(out)


base = st.integers(0, len(base_entries()) - 1).map(lambda i: base_entries()[i])
HEADER_FIELDS = ["format", "key", "context", "kind", "spec", "model", "model_name", "dtype", "n_tokens", "layers",
                 "numerics", "codec", "raw_bytes", "created", "press", "scores_dtype", "extra"]  # fmt: skip
LAYER_FIELDS = ["kv_heads", "head_dim", "counts", "extra"]


def _rekey(header: dict) -> None:
    """Make the header's key its edited facts' own (so that the key check passes)."""
    try:
        identity = codec_from_params(header["codec"]).identity
        header["key"] = derived_key_of(header["context"], header["kind"], header["spec"], identity)
    except (CorruptEntryError, KeyError, TypeError, AttributeError):
        pass


@st.composite
def flipped(draw):
    key, blob = draw(base)
    blob = bytearray(blob)
    for pos in draw(st.sets(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
        blob[pos] ^= draw(st.integers(1, 255))
    return "flip", key, bytes(blob)


@st.composite
def truncated_or_extended(draw):
    key, blob = draw(base)
    if draw(st.booleans()):
        return "truncate", key, blob[: draw(st.integers(0, len(blob) - 1))]
    return "extend", key, blob + draw(st.binary(min_size=1, max_size=64))


@st.composite
def spliced(draw):
    key, blob = draw(base)
    body = blob[:-8]
    a = draw(st.integers(0, len(body)))
    b = draw(st.integers(a, min(len(body), a + 64)))
    body = body[:a] + draw(st.binary(max_size=64)) + body[b:]
    assume(body != blob[:-8])
    if draw(st.booleans()):
        return "splice-resealed", key, seal(body)
    return "splice", key, body + blob[-8:]


@st.composite
def header_edits(draw):
    key, blob = draw(base)
    header, payload = split(blob)
    kind = draw(st.sampled_from(["set", "set", "delete", "codec", "text", "layer", "counts"]))
    if kind == "text":
        return "header-text", key, assemble(draw(st.one_of(st.binary(max_size=80), json_values.map(
            lambda v: json.dumps(v).encode()))), payload)  # fmt: skip
    if kind == "delete":
        header.pop(draw(st.sampled_from(HEADER_FIELDS[:-1])), None)
    elif kind == "codec":
        header["codec"][draw(st.sampled_from(["name", "level", "shuffle", "frames", "parts", "quant"]))] = draw(
            json_values
        )
    elif kind == "layer":
        layer = header["layers"][draw(st.integers(0, len(header["layers"]) - 1))]
        layer[draw(st.sampled_from(LAYER_FIELDS))] = draw(json_values)
    elif kind == "counts" and "counts" in header["layers"][0]:
        layer = header["layers"][draw(st.integers(0, len(header["layers"]) - 1))]
        i = draw(st.integers(0, len(layer["counts"]) - 1))
        layer["counts"][i] = draw(big_ints)
    else:
        header[draw(st.sampled_from(HEADER_FIELDS))] = draw(json_values)
    if draw(st.booleans()):
        _rekey(header)
    return f"header-{kind}", key, assemble(header, payload)


@st.composite
def consistent_size_edits(draw):
    """Counts, tokens or head sizes scaled with raw_bytes kept consistent: only the payload can tell."""
    key, blob = draw(base)
    header, payload = split(blob)
    value = draw(st.integers(1, 2**40))
    field = draw(st.sampled_from(["n_tokens", "counts", "kv_heads", "head_dim"]))
    if field == "n_tokens":
        header["n_tokens"] = value
    for layer in header["layers"]:
        if field == "counts" and "counts" in layer:
            layer["counts"] = [value] * len(layer["counts"])
        elif field == "kv_heads":
            layer["kv_heads"] = value
            if "counts" in layer:
                layer["counts"] = [1] * min(value, 64)
        elif field == "head_dim" and "head_dim" in layer:
            layer["head_dim"] = value
    item = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[header.get("scores_dtype") or header["dtype"]]
    kept = sum(sum(layer.get("counts", [])) for layer in header["layers"])
    if header["kind"] == "scores":
        data = sum(layer["kv_heads"] for layer in header["layers"]) * header["n_tokens"] * item
    else:
        data = sum(2 * sum(layer["counts"]) * layer["head_dim"] for layer in header["layers"]) * item + 4 * kept
    header["raw_bytes"] = data + draw(st.integers(0, 4096))
    return "consistent-size", key, assemble(header, payload)


@st.composite
def safetensors_edits(draw):
    raw = [(k, b) for k, b in base_entries() if split(b)[0]["codec"]["name"] == "raw"]
    key, blob = draw(st.sampled_from(raw))
    header, payload = split(blob)
    (n,) = struct.unpack_from("<Q", payload)
    st_head = json.loads(payload[8 : 8 + n])
    names = [k for k in st_head if k != "__metadata__"]
    kind = draw(st.sampled_from(["field", "field", "metadata", "rename", "drop"]))
    if kind == "field":
        st_head[draw(st.sampled_from(names))][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(
            st.one_of(json_values, st.lists(big_ints, max_size=4))
        )
    elif kind == "metadata":
        st_head["__metadata__"] = draw(json_values)
    elif kind == "rename":
        st_head[draw(st.text(max_size=12))] = st_head.pop(draw(st.sampled_from(names)))
    else:
        st_head.pop(draw(st.sampled_from(names)))
    text = json.dumps(st_head).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text + payload[8 + n :]
    return f"safetensors-{kind}", key, assemble(dict(header, raw_bytes=len(new)), new)


ALL = st.one_of(flipped(), truncated_or_extended(), spliced(), header_edits(), consistent_size_edits(),
                safetensors_edits())  # fmt: skip


def check(kind: str, key: str, blob: bytes, *, must_fail: bool = False) -> str:
    try:
        view = decode_derived(blob, key=key, threads=2)
    except (CorruptEntryError, FormatVersionError) as exc:
        outcome = type(exc).__name__
    else:
        assert not must_fail, f"{kind}: damaged derived entry decoded"
        h, total = view.header, 0
        for rec in view.records.values():
            t = rec.materialize()
            assert tuple(t.shape) == rec.shape and t.dtype == rec.dtype
            total += t.numel() * t.element_size()
        assert total <= h.raw_bytes <= MAX_COMPRESSION_RATIO * len(blob) + (1 << 20)
        for i, layer in enumerate(h.layers):
            if h.kind == "scores":
                assert tuple(view.scores(i).shape) == (layer.kv_heads, h.n_tokens)
                continue
            assert view.positions(i).shape == (layer.kept,)
            for j, m in enumerate(layer.counts or ()):
                for t in view.kv(i, j):
                    assert tuple(t.materialize().shape) == (1, m, layer.head_dim)
        outcome = "decoded"
    store = KVStore("memory://")
    store.backend.put(derived_entry_key(CONTEXT, key), blob)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with store.open_derived(CONTEXT, key) as got:
                assert (got is not None) == (outcome == "decoded")
        except FormatVersionError:  # intact but from a newer kvstore: refused, never misread
            assert outcome == "FormatVersionError"
    store.scan()
    info = store.verify()
    assert len(info.derived) + len(info.corrupt) == 1 and (len(info.derived) == 1) == (outcome == "decoded")
    return outcome


def test_base_entries_decode():
    assert all(check("valid", k, b) == "decoded" for k, b in base_entries())


STRATEGIES = {
    "flipped": flipped(),
    "truncated or extended": truncated_or_extended(),
    "spliced": spliced(),
    "header edits": header_edits(),
    "consistent size edits": consistent_size_edits(),
    "safetensors edits": safetensors_edits(),
}
MUST_FAIL = ("flip", "truncate", "extend", "splice")  # damage the checksum still covers


@pytest.mark.parametrize("name", list(STRATEGIES))
@ci_settings
@given(data=st.data())
def test_damage_raises_only_kvstore_errors(name, data):
    kind, key, blob = data.draw(STRATEGIES[name])
    check(kind, key, blob, must_fail=kind in MUST_FAIL)


@pytest.mark.soak
@settings(max_examples=SOAK_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(ALL)
def test_fuzz_derived_soak(case):
    kind, key, blob = case
    check(kind, key, blob, must_fail=kind in MUST_FAIL)
