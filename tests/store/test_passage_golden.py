"""Golden facts of the passages that composed contexts read (issue 50): a passage's chain keys
(under :func:`kvstore.store.keys.passage_seed`) and the bytes of its context record. A change to
either is a change to what is on disk: old stores would stop hitting (keys) or be misread
(records). Plain records must stay byte for byte what earlier versions wrote. Regenerate, after a
deliberate change, with ``KVSTORE_REGEN_GOLDEN=1``."""

from __future__ import annotations

import json
import os

from helpers.paths import GOLDEN
from kvstore.store.infos import ContextRecord
from kvstore.store.keys import chain_keys, chain_seed, chunk_spans, passage_seed

PATH = GOLDEN / "passages_v7.json"
FP = "5" * 64


def _facts() -> dict:
    seeds = {name: chain_seed(FP, dtype, device="cpu", attn="sdpa", lossy=lossy)
             for name, dtype, lossy in (("f32", "float32", ""), ("bf16_int8", "bfloat16", "int8:64"))}  # fmt: skip
    ids = list(range(100, 700))
    keys = {name: chain_keys(passage_seed(seed), ids, chunk_spans(len(ids), 256)) for name, seed in seeds.items()}
    chunks = tuple(keys["f32"])
    records = {
        "passage": ContextRecord(chunks[-1], chunks, len(ids), 1700000000.5, passage=True).to_bytes().decode(),
        "plain": ContextRecord(chunks[-1], chunks, len(ids), 1700000000.5).to_bytes().decode(),
    }
    return {"passage_seeds": {n: passage_seed(s) for n, s in seeds.items()}, "chain_keys": keys, "records": records}


def test_golden_passage_keys_and_records():
    facts = _facts()
    if os.environ.get("KVSTORE_REGEN_GOLDEN") == "1":
        PATH.write_text(json.dumps(facts, indent=1) + "\n")
    want = json.loads(PATH.read_text())
    assert facts == want, "passage keys or records changed: a format change (see tests/golden/README.md)"
    last = facts["chain_keys"]["f32"][-1]
    plain, passage = (ContextRecord.read(last, want["records"][k].encode()) for k in ("plain", "passage"))
    assert passage.passage and not plain.passage
    assert "passage" not in want["records"]["plain"]  # a plain record is what earlier versions wrote
    assert set(facts["chain_keys"]["f32"]).isdisjoint(facts["chain_keys"]["bf16_int8"])
