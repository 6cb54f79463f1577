"""Golden entries of the windowed, state-space and hybrid layouts, as the real build path writes them.

Each family's tiny model (window or attention chunk 8) builds a 20-token context in 10-token
chunks through ``Adapter.generate_kv_cache``; its second chunk (positions 10-19, so it has a
parent) is the golden entry. The layer records, key, parent and dtypes come from the build path; the tensor *values* are
replaced by fixed ones (model outputs differ in their last bits between CPUs and library versions)
and so are ``created`` and ``numerics``. A failure means the header records kvstore writes for a
family (kinds, kept lengths, windows, state names, shapes and dtypes) or the entry bytes changed:
see ``tests/golden/README.md``. Regenerate with ``KVSTORE_REGEN_GOLDEN=1``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import zstandard

from helpers.entries import bits, golden_facts
from helpers.paths import GOLDEN
from helpers.tiny import make_family_model
from kvstore.model.adapter import Adapter
from kvstore.store.entry import Entry, decode_entry, encode_entry
from kvstore.store.kvstore import KVStore

REGEN = os.environ.get("KVSTORE_REGEN_GOLDEN") == "1"
GOLDEN_FP = hashlib.sha256(b"kvstore golden model").hexdigest()
NUMERICS = {"device": "cpu", "attn": "eager", "torch": "2.13.0", "transformers": "5.23.0"}
# layout -> (tiny family, dtype): sliding + full (Gemma 3), chunked + full (Llama 4), states only
# (Mamba-2: float32 SSM state in a float64 model), states + full attention (Bamba), hybrid (FalconH1)
LAYOUTS = {
    "sliding": ("gemma3", torch.float32),
    "chunked": ("llama4-chunked", torch.float32),
    "state": ("mamba2", torch.float64),
    "state_attn": ("bamba", torch.float32),
    "hybrid": ("falcon_h1", torch.float32),
}
CODECS = ("raw", "zstd-shuffle:1")


def _fixed(t: torch.Tensor, salt: int) -> torch.Tensor:
    return ((torch.arange(t.numel(), dtype=torch.float64) % 97 - 48) / 16 + salt).to(t.dtype).reshape(t.shape)


def built_chunk(layout: str) -> Entry:
    """The second chunk of a 20-token context, as ``generate_kv_cache`` stores it, with fixed values."""
    name, dtype = LAYOUTS[layout]
    attn = None if name == "mamba2" else "eager"
    model, tok = make_family_model(name, dtype=dtype, seed=0, attn_implementation=attn)
    adapter = Adapter(model, tok, name="golden", fingerprint=GOLDEN_FP)
    with KVStore("memory://", chunk_tokens=10) as store:
        report = adapter.generate_kv_cache([[(7 * i) % 390 + 5 for i in range(20)]], store)
        entry = store.get(store.context(report.keys[0]).chunks[1])
    layers = tuple(None if kv is None else (_fixed(kv[0], i), _fixed(kv[1], -i)) for i, kv in enumerate(entry.layers))
    states = entry.states and tuple(
        None if s is None else {n: _fixed(t, i + 2) for n, t in s.items()} for i, s in enumerate(entry.states)
    )
    return Entry(
        entry.key, entry.model, entry.model_name, entry.token_ids, layers, 1700000000.75, entry.parent, entry.start,
        states, entry.kinds, entry.windows, NUMERICS, entry.kv_dtype,
    )  # fmt: skip


def _file(layout: str, codec: str) -> Path:
    return GOLDEN / f"entry_v2_family_{layout}_{codec.replace(':', '-')}.kvs"


@pytest.fixture(scope="module")
def built() -> dict[str, dict[str, bytes]]:
    return {layout: {codec: encode_entry(built_chunk(layout), codec) for codec in CODECS} for layout in LAYOUTS}


@pytest.fixture(scope="module")
def golden(built) -> dict:
    path = GOLDEN / "families_v2.json"
    if REGEN:
        facts = {
            "zstd_version": zstandard.ZSTD_VERSION,
            "entries": {
                f"{layout}/{codec}": golden_facts(blob) for layout, b in built.items() for codec, blob in b.items()
            },
        }
        path.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        for layout, b in built.items():
            for codec, blob in b.items():
                _file(layout, codec).write_bytes(blob)
    return json.loads(path.read_text())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("codec", CODECS)
def test_golden_family_entry_bytes(golden, built, layout, codec):
    want = golden["entries"][f"{layout}/{codec}"]
    facts = golden_facts(built[layout][codec])
    assert facts["header"] == want["header"], "the records the build path writes changed (see tests/golden/README.md)"
    assert facts["decompressed_sha256"] == want["decompressed_sha256"], "payload layout changed"
    if codec == "raw" or zstandard.ZSTD_VERSION == tuple(golden["zstd_version"]):
        assert facts["sha256"] == want["sha256"] and _file(layout, codec).read_bytes() == built[layout][codec]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_golden_family_files_decode(layout):
    """The golden files decode to their layer records (read from the file, not recomputed)."""
    view = decode_entry(_file(layout, "zstd-shuffle:1").read_bytes())
    raw = decode_entry(_file(layout, "raw").read_bytes())
    h = view.header
    assert replace(h, raw_bytes=0) == replace(raw.header, raw_bytes=0)  # the codecs' payload sizes differ
    assert (h.start, h.n_tokens, len(h.parent)) == (10, 10, 64)
    for name, rec in raw.records.items():
        assert torch.equal(bits(view.records[name].materialize()), bits(rec.materialize()))
    records = [(s.kind, s.length, s.window, tuple(n for n, _, _ in s.state)) for s in h.layers]
    state = ("conv", "recurrent")
    want = {
        # a sliding layer keeps what position 20 on can see: 7 (W - 1); a chunked one: 20 mod 8 = 4
        "sliding": [("sliding", 7, 8, ())] * 2 + [("attn", 10, None, ())] + [("sliding", 7, 8, ())],
        "chunked": [("chunked", 4, 8, ())] * 3 + [("attn", 10, None, ())],
        "state": [("state", 0, None, state)] * 2,
        "state_attn": [("state", 0, None, state), ("attn", 10, None, ())] * 2,
        "hybrid": [("hybrid", 10, None, state)] * 2,
    }[layout]
    assert records == want
    if layout == "state":  # float32 SSM state in a float64 model, float64 convolution window
        assert h.dtype == "float64" and h.kv_bytes == 0
        assert [(n, d) for n, _, d in h.layers[0].state] == [("conv", "float64"), ("recurrent", "float32")]
