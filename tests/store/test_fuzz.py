"""Property-based fuzzing of the entry decoder: whatever bytes a store hands back, decoding raises
nothing but kvstore's own errors (``CorruptEntryError``, ``FormatVersionError``), or yields
tensors of exactly the declared shapes within the declared size.

Inputs are valid entries (raw, zstd and byte-shuffled zstd; float32/16, bfloat16) mutated the
ways damage and attackers do: bit flips, truncation, extension, splices of random bytes, and edits
of the entry header, the safetensors header and the zstd frame table *with the checksum
recomputed*, so that the decoder has to get past its first line of defence. Every case also goes
through ``KVStore`` (``get``, ``open_entry``, ``scan``, ``verify``), which must never raise.

CI runs a few hundred derandomized examples per property (``KVSTORE_FUZZ_EXAMPLES`` overrides).
The soak run (``KVSTORE_SOAK=1``, see ``tests/reliability/test_soak.py``) runs
``test_fuzz_soak`` with 10,000 random cases (``KVSTORE_FUZZ_SOAK_EXAMPLES``) and, with
``KVSTORE_FUZZ_REPORT=PATH``, writes the counts there.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import struct
import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from helpers.entries import assemble, encode, encode_v1, seal, split
from helpers.fuzz import SOAK_EXAMPLES, big_ints, ci_settings, json_values
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store.entry import Entry, decode_entry, encode_entry
from kvstore.store.header import MAX_COMPRESSION_RATIO, read_header
from kvstore.store.kvstore import KVStore

KEY = "c" * 64

OUTCOMES: collections.Counter = collections.Counter()


# -- valid entries to start from ---------------------------------------------------------------------
@functools.cache
def base_entries() -> tuple[bytes, ...]:
    out = []
    for i, (codec, dtype, n_layers, n_tokens, head_dim) in enumerate(
        [
            ("raw", torch.float32, 2, 5, 4),
            ("zstd:1", torch.float32, 1, 7, 8),
            ("zstd-shuffle:1", torch.float32, 2, 3, 4),
            ("zstd-shuffle:3", torch.bfloat16, 1, 9, 8),
            ("raw", torch.float16, 1, 4, 2),
        ]
    ):
        g = torch.Generator().manual_seed(i)
        layers = [
            (
                torch.randn(2, n_tokens, head_dim, generator=g).to(dtype),
                torch.randn(2, n_tokens, head_dim, generator=g).to(dtype),
            )
            for _ in range(n_layers)
        ]
        out.append(encode(layers, codec, key=KEY, created=1.7e9))
    # every layer kind (sliding window, recurrent state in its own dtype, hybrid), a chunk of a chain
    g = torch.arange(2 * 5 * 4, dtype=torch.float64).reshape(2, 5, 4) / 16
    state = {"conv": torch.ones(3, 4), "ssm": -torch.ones(2, 2, 2)}
    for codec in ("raw", "zstd-shuffle:1"):
        entry = Entry(KEY, "f" * 64, "tiny", torch.arange(5), ((g, -g), (g[:, 2:], g[:, 2:]), None, (g, g)), 1.7e9,
                      parent="e" * 64, start=6, states=(None, None, state, state),
                      kinds=("attn", "sliding", "state", "hybrid"), windows=(None, 4, None, None))  # fmt: skip
        out.append(encode_entry(entry, codec))
    # format 1 (phase 1), still read
    out += [encode_v1(layers, c, key=KEY) for c in ("raw", "zstd-shuffle:1")]
    return tuple(out)


# -- strategies ------------------------------------------------------------------------------------------
base = st.integers(0, len(base_entries()) - 1).map(lambda i: base_entries()[i])
v2 = st.integers(0, len(base_entries()) - 3).map(lambda i: base_entries()[i])  # all but the format-1 entries


def _json(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def flipped(draw):
    """Bytes XOR-ed in place, checksum left as it was: always detected."""
    blob = bytearray(draw(base))
    for pos in draw(st.sets(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
        blob[pos] ^= draw(st.integers(1, 255))
    return "flip", bytes(blob)


@st.composite
def truncated_or_extended(draw):
    blob = draw(base)
    if draw(st.booleans()):
        return "truncate", blob[: draw(st.integers(0, len(blob) - 1))]
    return "extend", blob + draw(st.binary(min_size=1, max_size=64))


@st.composite
def spliced(draw):
    """A random stretch replaced by random bytes, with or without a recomputed checksum."""
    blob = draw(base)
    body = blob[:-8]
    a = draw(st.integers(0, len(body)))
    b = draw(st.integers(a, min(len(body), a + 64)))
    body = body[:a] + draw(st.binary(max_size=64)) + body[b:]
    assume(body != blob[:-8])  # a splice that changes nothing is not damage
    if draw(st.booleans()):
        return "splice-resealed", seal(body)
    return "splice", body + blob[-8:]


HEADER_FIELDS = [
    *("format", "key", "parent", "model", "model_name", "dtype", "start", "n_tokens", "layers", "numerics"),
    *("n_layers", "kv_heads", "head_dim", "codec", "raw_bytes", "created", "extra"),
]
LAYER_FIELDS = ["kind", "length", "kv_heads", "head_dim", "window", "state", "extra"]


@st.composite
def header_edits(draw):
    """The entry header's JSON edited (fields set to anything, removed, or the text replaced), resealed."""
    header, payload = split(draw(base))
    kind = draw(st.sampled_from(["set", "set", "delete", "codec", "text", "layer"]))
    if kind == "text":
        return "header-text", assemble(draw(st.one_of(st.binary(max_size=80), json_values.map(_json))), payload)
    if kind == "delete":
        header.pop(draw(st.sampled_from(HEADER_FIELDS[:-1])), None)
    elif kind == "codec":
        codec = header["codec"]
        codec[draw(st.sampled_from(["name", "shuffle", "level", "frames"]))] = draw(json_values)
    elif kind == "layer":
        layers = header.get("layers") or [{}]
        layer = layers[draw(st.integers(0, len(layers) - 1))]
        layer[draw(st.sampled_from(LAYER_FIELDS))] = draw(json_values)
    else:
        header[draw(st.sampled_from(HEADER_FIELDS))] = draw(json_values)
    return f"header-{kind}", assemble(header, payload)


@st.composite
def consistent_size_edits(draw):
    """Shape fields scaled with raw_bytes kept consistent with them: only the payload can tell."""
    header, payload = split(draw(v2))
    value = draw(st.integers(1, 2**40))
    layers = [x for x in header["layers"] if "length" in x]
    field = draw(st.sampled_from(["n_tokens", "length", "kv_heads", "head_dim", "n_layers"]))
    if field == "n_tokens":  # every full layer follows the chunk's length
        header["n_tokens"] = value
        for x in layers:
            if x["kind"] in ("attn", "hybrid"):
                x["length"] = value
    elif field == "n_layers":
        header["layers"] = header["layers"] * min(value, 64)
    else:
        for x in layers:
            x[field] = value
    item = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[header["dtype"]]
    kv = sum(2 * x["kv_heads"] * x["length"] * x["head_dim"] * item for x in header["layers"] if "length" in x)
    header["raw_bytes"] = kv + 8 * header["n_tokens"] + draw(st.integers(0, 4096))
    return "consistent-size", assemble(header, payload)


@st.composite
def safetensors_edits(draw):
    """The safetensors header inside a raw payload edited (dtype, shape, offsets, metadata, names), resealed."""
    raw = [b for b in base_entries() if split(b)[0]["codec"]["name"] == "raw"]
    header, payload = split(draw(st.sampled_from(raw)))
    (n,) = struct.unpack_from("<Q", payload)
    st_head = json.loads(payload[8 : 8 + n])
    names = [k for k in st_head if k != "__metadata__"]
    kind = draw(st.sampled_from(["field", "field", "metadata", "rename", "drop", "length"]))
    if kind == "field":
        st_head[draw(st.sampled_from(names))][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(
            st.one_of(json_values, st.lists(big_ints, max_size=4))
        )
    elif kind == "metadata":
        st_head["__metadata__"] = draw(
            st.one_of(
                json_values,
                st.dictionaries(st.sampled_from(["key", "model", "dtype", "n_tokens", "n_layers", "x"]), json_values),
            )
        )
    elif kind == "rename":
        st_head[draw(st.text(max_size=12))] = st_head.pop(draw(st.sampled_from(names)))
    elif kind == "drop":
        st_head.pop(draw(st.sampled_from(names)))
    text = json.dumps(st_head, allow_nan=True).encode()
    text += b" " * (-len(text) % 8)
    length = len(text) if kind != "length" else draw(big_ints.filter(lambda v: 0 <= v < 2**64))
    new = struct.pack("<Q", length) + text + payload[8 + n :]
    return f"safetensors-{kind}", assemble(dict(header, raw_bytes=len(new)), new)


@st.composite
def frame_table_edits(draw):
    """The zstd frame table edited (sizes, count, order), payload frames optionally swapped, resealed."""
    zstd = [b for b in base_entries() if split(b)[0]["codec"]["name"] == "zstd"]
    header, payload = split(draw(st.sampled_from(zstd)))
    frames = header["codec"]["frames"]
    kind = draw(st.sampled_from(["size", "size", "drop", "swap", "frame-bytes"]))
    if kind == "size":
        i = draw(st.integers(0, len(frames) - 1))
        frames[i][draw(st.integers(0, 1))] = draw(big_ints)
        if draw(st.booleans()):
            header["raw_bytes"] = sum(d for _, d in frames if isinstance(d, int))
    elif kind == "drop":
        frames.pop(draw(st.integers(0, len(frames) - 1)))
    elif kind == "swap" and len(frames) > 2:
        i, j = draw(st.permutations(range(len(frames))))[:2]
        frames[i], frames[j] = frames[j], frames[i]
    else:  # flip bytes inside one frame, table unchanged
        pos = draw(st.integers(0, len(payload) - 1))
        payload = payload[:pos] + bytes([payload[pos] ^ draw(st.integers(1, 255))]) + payload[pos + 1 :]
    return f"frames-{kind}", assemble(header, payload)


ALL = st.one_of(
    flipped(),
    truncated_or_extended(),
    spliced(),
    header_edits(),
    consistent_size_edits(),
    safetensors_edits(),
    frame_table_edits(),
)


# -- the property ------------------------------------------------------------------------------------------
def check(kind: str, blob: bytes, *, must_fail: bool = False) -> str:
    """Decode ``blob`` every way kvstore does; only kvstore's errors may come out. Returns the outcome."""
    try:
        decoded = decode_entry(blob, key=KEY, threads=2)
    except (CorruptEntryError, FormatVersionError) as exc:
        outcome = type(exc).__name__
    else:
        assert not must_fail, f"{kind}: damaged entry decoded"
        total = 0
        for rec in decoded.records.values():
            t = rec.materialize()
            assert tuple(t.shape) == rec.shape and t.dtype == rec.dtype
            total += t.numel() * t.element_size()
        assert total <= decoded.header.raw_bytes <= MAX_COMPRESSION_RATIO * len(blob) + (1 << 20)
        outcome = "decoded"
    try:
        read_header(blob)
    except (CorruptEntryError, FormatVersionError):
        pass
    store = KVStore("memory://")  # a private in-memory store
    store.put_bytes(KEY, blob)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            got = store.get(KEY)  # None for a damaged entry (a miss, with a CorruptEntryWarning)
        except FormatVersionError:  # intact but from a newer kvstore: refused, never misread
            assert outcome == "FormatVersionError"
        else:
            assert (got is not None) == (outcome == "decoded")
            with store.open_entry(KEY) as view:
                assert (view is None) == (got is None)
    store.scan()
    info = store.verify()
    assert info.n_entries + len(info.corrupt) == 1 and (info.n_entries == 1) == (outcome == "decoded")
    OUTCOMES[(kind, outcome)] += 1
    return outcome


def test_base_entries_decode():
    assert all(check("valid", b) == "decoded" for b in base_entries())


@ci_settings
@given(flipped())
def test_flipped_bytes_are_always_detected(case):
    check(*case, must_fail=True)


@ci_settings
@given(truncated_or_extended())
def test_truncated_or_extended_entries_are_always_detected(case):
    check(*case, must_fail=True)


@ci_settings
@given(spliced())
def test_splices_raise_only_kvstore_errors(case):
    check(*case, must_fail=case[0] == "splice")


@ci_settings
@given(header_edits())
def test_resealed_header_edits_raise_only_kvstore_errors(case):
    check(*case)


@ci_settings
@given(consistent_size_edits())
def test_resealed_size_claims_raise_only_kvstore_errors(case):
    check(*case)


@ci_settings
@given(safetensors_edits())
def test_resealed_safetensors_edits_raise_only_kvstore_errors(case):
    check(*case)


@ci_settings
@given(frame_table_edits())
def test_resealed_frame_table_edits_raise_only_kvstore_errors(case):
    check(*case)


@pytest.mark.soak
@settings(max_examples=SOAK_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(ALL)
def test_fuzz_soak(case):
    kind, blob = case
    check(kind, blob, must_fail=kind in ("flip", "truncate", "extend", "splice"))


def teardown_module(module) -> None:
    report = os.environ.get("KVSTORE_FUZZ_REPORT")
    if report and OUTCOMES:
        by_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for (kind, outcome), n in sorted(OUTCOMES.items()):
            by_kind[kind][outcome] = n
        with open(report, "w") as f:
            json.dump(
                {"cases": sum(OUTCOMES.values()), "by_kind": by_kind, "errors_other_than_kvstore": 0}, f, indent=2
            )  # any other error fails the run instead
