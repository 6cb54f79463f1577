"""Builds against the prefill: a build of several contexts against the sum of their prefills, and
the writer's encode throughput on one thread and on several.

A build (``Adapter.build``) runs each context's prefill and hands the computed chunks to the
writer (``kvstore.model.io.writer``), which encodes them on its worker threads and writes them
in order to the store while the next context's prefill runs. Issue 39's goal: a dataset of many
contexts built in at most 1.2x the sum of its prefills. Per repeat, in one run and alternating:

* ``prefill``: the same build with nothing handed to the writer (``Writer._enqueue`` a no-op):
  the build's own prefills (batch 1, its batch size on CPU) and placements, summed over the
  contexts;
* ``build:CODEC:tT``: ``Adapter.build`` of the same contexts into an empty LMDB store (``sync=False``)
  with a writer of ``T`` encoding threads (``t1``: one, encoding on the writer's own thread as
  before this change; ``tN``: the default, the CPU count at most 8), writer close included;
  ``x_prefill`` is its seconds over the same repeat's summed prefills;
* ``encode:CODEC:tT``: ``KVStore.encode`` of every chunk of the contexts, twice over (their KV
  from ``Adapter.prefill``), on ``T`` threads at once, GB/s of KV bytes.

Models (``--models``): ``8b-heads``, a random Llama with an 8B-like KV (32 layers, 8 KV heads,
head_dim 128, bfloat16: 128 KiB per token, as Llama-3.1-8B) and a small body (hidden 256, 8 query
heads), so its prefill is cheap against its KV bytes, the hardest case for the writer; and
``smollm2``, the bundled SmolLM2-135M-Instruct (float32). Timings: min / median / max over
``--repeats`` after a warm-up build, the load average recorded per row.

Command (from the repository root; the suite ``build_pace``: ``python -m experiments run
build_pace [ARGS]`` writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_build_pace.py
    .venv/bin/python experiments/bench_build_pace.py --quick            # smoke run
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import bench_realsize as rs
import torch

import benchlib as bl

CODECS = ("raw", "zstd-split:1:16")


def heads_8b_model():
    """A random Llama with Llama-3.1-8B's KV shape and a small body, bfloat16, in an Adapter."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvstore.model.adapter import Adapter

    config = LlamaConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=32, intermediate_size=512,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                         rope_theta=500000.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return Adapter(model, rs.word_tokenizer(), name="8b-heads-random", fingerprint="bench-build-pace-8b-heads")


def run_model(name: str, adapter, args, threads: list[int]) -> list[dict]:
    from kvstore.model.io import writer as writer_mod
    from kvstore.model.options import BuildOptions
    from kvstore.store.kvstore import KVStore

    vocab = min(adapter.model.config.vocab_size, 49152)
    contexts = [bl.synthetic_ids(args.tokens, seed=100 + i, vocab=vocab) for i in range(args.contexts)]
    scratch = bl.SCRATCH / "build_pace"
    real_threads = writer_mod.encode_threads

    def build(codec: str, t: int) -> tuple[float, object]:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        writer_mod.encode_threads = lambda: t  # the Writer the build makes takes its default from here
        try:
            with KVStore(str(scratch / "s"), codec=codec, sync=False) as store:
                with bl.timed() as t_build:
                    report = adapter.build(contexts, store, BuildOptions(batch_size=1))
                seconds = t_build.seconds
        finally:
            writer_mod.encode_threads = real_threads
            shutil.rmtree(scratch, ignore_errors=True)
        assert report.built == len(contexts), report
        return seconds, report

    def prefills() -> float:
        """The same build with nothing handed to the writer: the build's own prefills (and
        placements), summed over the contexts."""
        real_enqueue = writer_mod.Writer._enqueue
        writer_mod.Writer._enqueue = lambda self, job, host=None: None
        try:
            with KVStore("memory://", codec="raw") as store, bl.timed() as t:
                report = adapter.build(contexts, store, BuildOptions(batch_size=1))
        finally:
            writer_mod.Writer._enqueue = real_enqueue
        assert report.built == len(contexts) and report.chunks_written == 0, report
        return t.seconds

    builds = [(c, t) for c in CODECS for t in threads]
    for c, t in builds[:1]:  # warm-up: the model, the allocator, the pools
        build(c, t)
    times: dict[str, list[float]] = {"prefill": []} | {f"build:{c}:t{t}": [] for c, t in builds}
    ratios: dict[str, list[float]] = {k: [] for k in times if k != "prefill"}
    reports: dict[str, object] = {}
    for _ in range(args.repeats):
        p = prefills()
        times["prefill"].append(p)
        for c, t in builds:
            s, reports[f"build:{c}:t{t}"] = build(c, t)
            times[f"build:{c}:t{t}"].append(s)
            ratios[f"build:{c}:t{t}"].append(s / p)
    rows = []
    n_tokens = args.tokens * args.contexts
    for m, xs in times.items():
        s = bl.summarize(xs)
        row = {"model": name, "method": m, "contexts": args.contexts, "context_tokens": args.tokens,
               "n": s["n"], "min_s": s["min"], "median_s": s["median"], "max_s": s["max"],
               "loadavg": bl.loadavg()}  # fmt: skip
        if m in ratios:
            r = bl.summarize(ratios[m])
            rep = reports[m]
            row |= {"x_prefill_min": r["min"], "x_prefill_median": r["median"], "x_prefill_max": r["max"],
                    "kv_bytes": rep.raw_bytes, "stored_bytes": rep.stored_bytes,
                    "store_seconds_last": rep.store_seconds,
                    "store_wait_seconds_last": rep.store_wait_seconds}  # fmt: skip
        else:
            row["tokens_per_s_median"] = n_tokens / s["median"]
        rows.append(row)
        extra = f"  x prefill {row['x_prefill_median']:.2f} (min {row['x_prefill_min']:.2f})" if m in ratios else ""
        print(f"{name:<9} {m:<24} median {s['median']:7.2f} s (min {s['min']:.2f}, max {s['max']:.2f}){extra}"
              f"  (load avg {row['loadavg']})", flush=True)  # fmt: skip
    rows += encode_rows(name, adapter, contexts, args, threads)
    return rows


def encode_rows(name, adapter, contexts, args, threads: list[int]) -> list[dict]:
    from kvstore.model.io.chains import chain_of, chunk_entries
    from kvstore.store.kvstore import KVStore

    rows = []
    entries = []
    with KVStore("memory://", codec="raw") as probe:
        for ids in contexts:  # every context's chunks, from its prefill
            entries += chunk_entries(adapter.handle, chain_of(adapter.handle, ids, probe), adapter.prefill([ids])[0])
    entries *= 2  # at least a few chunks per thread
    kv_bytes = sum(e.kv_bytes for e in entries)
    for codec in CODECS:
        with KVStore("memory://", codec=codec) as store:
            for t in threads:
                with ThreadPoolExecutor(t) as pool:

                    def encode_all(pool=pool, store=store) -> None:
                        list(pool.map(store.encode, entries))

                    xs = bl.repeat(encode_all, args.repeats)
                s = bl.summarize(xs)
                row = {"model": name, "method": f"encode:{codec}:t{t}", "chunks": len(entries), "kv_bytes": kv_bytes,
                       "n": s["n"], "min_s": s["min"], "median_s": s["median"], "max_s": s["max"],
                       "gbps_median": kv_bytes / s["median"] / 1e9, "gbps_max": kv_bytes / s["min"] / 1e9,
                       "loadavg": bl.loadavg()}  # fmt: skip
                rows.append(row)
                mib = kv_bytes / len(entries) / 2**20
                print(f"{name:<9} {row['method']:<24} {row['gbps_median']:.2f} GB/s (best {row['gbps_max']:.2f}) "
                      f"over {len(entries)} chunks of {mib:.0f} MiB", flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = bl.parser(__doc__)
    p.add_argument("--models", default="8b-heads,smollm2")
    p.add_argument("--contexts", type=int, default=3, help="contexts per build")
    p.add_argument("--tokens", type=int, default=512, help="tokens per context")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--encode-threads", default="", help="writer threads compared (default: 1 and the CPU count)")
    args = bl.start(p, {"tokens": 512, "contexts": 2, "repeats": 1, "models": "8b-heads"})
    from kvstore.model.io.writer import encode_threads

    threads = [int(x) for x in args.encode_threads.split(",")] if args.encode_threads else [1, encode_threads()]
    threads = sorted(set(threads))
    rows = []
    for name in args.models.split(","):
        adapter = heads_8b_model() if name == "8b-heads" else bl.load_adapter("float32")
        rows += run_model(name, adapter, args, threads)
        del adapter
    bl.write_result("build_pace", params=vars(args) | {"writer_threads": threads, "cpu_count": os.cpu_count(),
                                                      "codecs": list(CODECS)}, rows=rows)  # fmt: skip


if __name__ == "__main__":
    main()
