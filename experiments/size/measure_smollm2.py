"""Measured beside estimated: the bundled SmolLM2-135M-Instruct's caches of the demo contexts,
stored in float32 and bfloat16 with each codec, then reported by ``kvstore size --store``.

Command (from the repository root; the suite ``size_smollm2``: ``python -m experiments run size_smollm2``
writes experiments/results/size_smollm2.json; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/size/measure_smollm2.py

Deterministic: the same contexts and weights give the same stored bytes on every run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # experiments/, for benchlib

import benchlib as bl  # noqa: E402
from kvstore.model.adapter import Adapter  # noqa: E402
from kvstore.store.kvstore import KVStore  # noqa: E402

CODECS = ("raw", "zstd:1", "zstd-shuffle:1")
DTYPES = ("float32", "bfloat16")
SEQ_LEN = 2048  # the estimate's context length (the stored bytes are per token)


def main() -> None:
    bl.start(bl.parser(__doc__, quick=False))
    contexts = list(dict.fromkeys(json.loads(line)["context"] for line in (bl.HERE / "data" / "demo.jsonl").open()))
    with tempfile.TemporaryDirectory() as tmp:
        stores = []
        for dtype in DTYPES:
            adapter = Adapter.from_pretrained(None, dtype=dtype)
            built = None
            for codec in CODECS:
                path = Path(tmp) / f"{dtype}-{codec.replace(':', '')}"
                with KVStore(str(path), codec=codec) as store:
                    if built is None:  # prefill once per dtype; the other codecs re-encode the same entries
                        adapter.generate_kv_cache(contexts, store)
                        built = path
                    else:
                        with KVStore(str(built), readonly=True) as source:
                            for key in source.keys():  # the chunks, re-encoded; then the context records
                                store.put(source[key])
                            for key in source.context_keys():
                                record = source.context(key)
                                assert record is not None
                                store.put_context(key, record.chunks, record.n_tokens)
                stores.append((dtype, codec, path))
        table, rows = [], []
        for dtype, codec, path in stores:
            cmd = [
                sys.executable,
                "-m",
                "kvstore.cli.main",
                "size",
                "default",
                "--dtype",
                dtype,
                "--seq-len",
                str(SEQ_LEN),
                "--store",
                str(path),
            ]
            out = subprocess.run(cmd, cwd=bl.ROOT, capture_output=True, text=True, check=True).stdout
            measured = out[out.index("Measured in store") :].split("\n", 1)[1].strip("\n")
            table.append(f"# {dtype}, codec {codec}\n{measured}\n")
            doc = subprocess.run(cmd + ["--format", "json"], cwd=bl.ROOT, capture_output=True, text=True, check=True)
            rows += [{"config": f"{dtype} {codec}"} | row for row in json.loads(doc.stdout)["measured"]]
    print(
        f"SmolLM2-135M-Instruct, {len(contexts)} demo contexts (experiments/data/demo.jsonl); "
        "stored bytes include entry headers, token ids and checksums.\n\n" + "\n".join(table)
    )
    params = {"codecs": CODECS, "dtypes": DTYPES, "seq_len": SEQ_LEN, "contexts": len(contexts)}
    bl.write_result("size_smollm2", params=params, rows=rows)


if __name__ == "__main__":
    main()
