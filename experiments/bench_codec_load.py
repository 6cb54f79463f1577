"""What a stored load costs per lossless codec, without the question step's noise.

For each context length (random token ids, the seeds of ``bench_ttft.py``), the bundled
SmolLM2-135M-Instruct (``--dtype``, default float32) prefills the context once into a store of the
first codec; every other codec's store gets the same chain re-encoded (as ``kvstore sync --codec``
does). Then ``kvstore.model.stages.load.load_prefix`` (open + verify every chunk + decode + copy into the
Adapter's batch buffers: the ``load`` piece of a stored TTFT) runs on each store in turn,
``--repeats`` times, alternating, 2 threads. Reported per codec and length: min / median / max ms,
stored bytes, and the in-memory floor's question step measured in the same run (``bench_ttft``'s
``floor``), so that ``1 + load / floor`` is what the codec adds to the floor. Minimums are the
figures least disturbed by other jobs on a shared machine; the load average is recorded.

Command (from the repository root; the suites ``codec_load`` and ``codec_load_bf16``: ``python -m
experiments run codec_load [ARGS]`` writes experiments/results/; run by hand it writes to
cache/bench/raw/)::

    .venv/bin/python experiments/bench_codec_load.py                      # codec_load.json
    .venv/bin/python experiments/bench_codec_load.py --dtype bfloat16     # codec_load_bfloat16.json
"""

from __future__ import annotations

import shutil

import torch

import benchlib as bl

CODECS = ("zstd-split:1:16", "raw", "zstd-shuffle:1", "zstd-split:1")


def main() -> None:
    p = bl.parser(__doc__, quick=False)
    p.add_argument("--lengths", default="256,1024,2048,4096")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", default="float32")
    args = bl.start(p)
    adapter = bl.load_adapter(args.dtype)
    from kvstore.model.compute.cache import new_buffers
    from kvstore.model.stages.load import load_prefix
    from kvstore.store.kvstore import KVStore

    q_ids = bl.synthetic_ids(bl.QUESTION_TOKENS, seed=7)
    codecs = args.codecs.split(",")
    scratch = bl.SCRATCH / "codec_load"
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        ctx = bl.synthetic_ids(n, seed=1000 + n)
        stores = {c: KVStore(str(scratch / str(i)), codec=c, sync=False) for i, c in enumerate(codecs)}
        try:
            first = stores[codecs[0]]
            adapter.generate_kv_cache([ctx], first, batch_size=1)
            plan = adapter.chain(ctx, first)
            for store in stores.values():
                if store is not first:
                    for key in plan.keys:
                        entry = first.get(key)
                        assert entry is not None
                        store.put(entry)
            with torch.inference_mode():
                layers = tuple((k.contiguous().clone(), v.contiguous().clone()) for k, v in adapter.prefill([ctx])[0])
            run_floor = bl.floor(adapter, layers, q_ids)
            run_floor()  # warm-up
            bufs = new_buffers(adapter.kv_shapes(), 1, n + len(q_ids) + 1, adapter.dtype, adapter.device)
            times: dict[str, list[float]] = {c: [] for c in [*codecs, "floor"]}
            for store in stores.values():  # warm-up: page cache, thread pool
                load_prefix(adapter.handle, store, plan, bufs, 0, 0)
            for _ in range(args.repeats):
                for c, store in stores.items():
                    with bl.timed() as t, torch.inference_mode():
                        got = load_prefix(adapter.handle, store, plan, bufs, 0, 0)
                    times[c].append(t.seconds)
                    assert got == n, f"{c}: loaded {got} of {n} tokens"
                    exact = all(
                        torch.equal(kb[0, :, :n].view(torch.uint8), k.view(torch.uint8))
                        and torch.equal(vb[0, :, :n].view(torch.uint8), v.view(torch.uint8))
                        for (kb, vb), (k, v) in zip(bufs, layers)
                    )
                    assert exact, f"{c}: loaded bytes differ from the prefill's"
                times["floor"].append(run_floor()[1])
            floor_med = bl.summarize(times["floor"])["median"]
            for c in [*codecs, "floor"]:
                s = bl.summarize(times[c])
                row = {"context_tokens": n, "codec": c, "dtype": args.dtype, "n": s["n"],
                       "min_ms": s["min"] * 1e3, "median_ms": s["median"] * 1e3, "max_ms": s["max"] * 1e3}  # fmt: skip
                if c != "floor":
                    stored = sum(len(b) for b in stores[c].backend.get_many([f"e/{k}".encode() for k in plan.keys]))
                    row |= {"stored_bytes": stored, "x_floor_from_load": 1 + s["median"] / floor_med}
                rows.append(row)
                print(
                    f"{n:>5} {c:<16} min {row['min_ms']:7.1f}  median {row['median_ms']:7.1f}  max {row['max_ms']:7.1f}"
                    + (
                        f"  {row['stored_bytes'] / 2**20:6.1f} MiB  1+load/floor {row['x_floor_from_load']:.2f}"
                        if c != "floor"
                        else ""
                    )  # fmt: skip
                    + f"  (load avg {bl.loadavg()})",
                    flush=True,
                )
        finally:
            for store in stores.values():
                store.close()
            shutil.rmtree(scratch, ignore_errors=True)
    bl.write_result("codec_load" + ("" if args.dtype == "float32" else f"_{args.dtype}"), params=vars(args), rows=rows)


if __name__ == "__main__":
    main()
