"""The facts a chain's chunks share are validated once per thread and reused (the safetensors
table of a payload, the layer records of an entry header: ``kvstore.store.codecs.records`` and
``kvstore.store.header``): a header reuses them only when it says exactly what the last one
validated said. Each damaged or hostile header below decodes right after an intact entry of the
same shape (so the kept facts are there to be wrongly reused) and must still fail as
CorruptEntryError; intact chunks decode as before, bit for bit."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from helpers.entries import assemble, encode, kv_layers, split
from kvstore.errors import CorruptEntryError
from kvstore.store.codecs.records import parse_header
from kvstore.store.entry import decode_entry

LAYERS = kv_layers(n_layers=2, n_tokens=5, extremes=False)


def _intact() -> bytes:
    return encode(LAYERS, "raw")


def _with_st(edit) -> bytes:
    header, payload = split(_intact())
    (n,) = struct.unpack_from("<Q", payload)
    st = json.loads(payload[8 : 8 + n])
    edit(st)
    text = json.dumps(st).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text + payload[8 + n :]
    return assemble(dict(header, raw_bytes=len(new)), new)


def _with_layers(edit) -> bytes:
    header, payload = split(_intact())
    edit(header["layers"])
    return assemble(header, payload)


def _set(what: str, **fields):
    return lambda st: st[what].update(fields)


@pytest.mark.parametrize(
    "blob",
    [
        _with_st(_set("layers.0.keys", shape=[2, 5, 9])),  # no longer its bytes
        _with_st(_set("layers.1.values", data_offsets=[0, 320])),  # overlaps the keys
        _with_st(_set("layers.0.keys", dtype="F16")),
        _with_layers(lambda layers: layers[1].update(length=5.0)),  # == 5, but not an integer field
        _with_layers(lambda layers: layers[0].update(kv_heads=True)),  # == 1 in Python
        _with_layers(lambda layers: layers[0].update(length=4)),
        _with_layers(lambda layers: layers.append(dict(layers[0]))),
    ],
    ids=["shape", "overlap", "dtype", "float-length", "bool-heads", "length", "extra-layer"],
)
def test_a_header_unlike_the_last_one_is_validated_again(blob):
    intact = decode_entry(_intact())  # what a chain's previous chunk leaves on this thread
    assert torch.equal(intact.layers[0][0].materialize(), LAYERS[0][0])
    with pytest.raises(CorruptEntryError):
        decode_entry(blob)
    with pytest.raises(CorruptEntryError):  # and again, right after itself
        decode_entry(blob)


def test_chunks_alike_decode_as_each_alone():
    """A chain's chunks: the same shapes, other keys, values and token ids; each decodes to its own
    values whether or not the one before it left its facts."""
    blobs = [
        encode(kv_layers(n_layers=2, n_tokens=5, seed=s, extremes=False), "raw", ids=range(s, s + 5), key=str(s) * 64)
        for s in range(1, 4)
    ]
    for s, blob in zip(range(1, 4), blobs):
        view = decode_entry(blob, key=str(s) * 64)
        want = kv_layers(n_layers=2, n_tokens=5, seed=s, extremes=False)
        for (k, v), (wk, wv) in zip(view.layers, want):
            assert torch.equal(k.materialize(), wk) and torch.equal(v.materialize(), wv)
        assert view.token_ids() == list(range(s, s + 5))


def test_the_table_kept_is_not_shared_with_callers():
    _, payload = split(_intact())
    (n,) = struct.unpack_from("<Q", payload)
    first, _ = parse_header(payload, len(payload) - 8 - n)
    first.clear()
    again, _ = parse_header(payload, len(payload) - 8 - n)
    assert len(again) == 5  # token ids and two layers' keys and values
    with pytest.raises(CorruptEntryError):  # the same table against fewer data bytes
        parse_header(payload, len(payload) - 8 - n - 1)
