"""Store throughput vs the physical limit: MB/s of KV delivered, per codec, next to memcpy.

One context of real text (the demo articles, 2048 tokens by default) is prefilled once with the
bundled SmolLM2-135M-Instruct; its KV is stored as fp32 (the model's dtype) and as bf16 (the fp32
KV cast down) in one warm LMDB store per codec. Then, in the same run and round-robin per repeat:

* ``memcpy-prealloc`` / ``memcpy-fresh``: ``dst.copy_(src)`` of the same number of bytes into a
  buffer allocated once / into a fresh ``torch.empty`` (page faults included). The physical limit.
* ``checksum``: xxh3-64 over the stored entry (every load verifies it first).
* ``open``: ``store.open_entry(key)`` alone: checksum, header, decompression (zero-copy for raw).
* ``get+to_dynamic_cache``: ``store.get(key).to_dynamic_cache()``: a ready ``DynamicCache``.
* ``adapter-fresh``: what ``Adapter._decode_cached`` does for one row: fresh padded buffers
  ``[1, kv_heads, n + 40, head_dim]`` per layer, then ``copy_into`` each record (the destination
  is a strided slice of the buffer).
* ``into-prealloc``: ``open_entry`` + ``copy_into`` contiguous buffers allocated once (the best
  case for a reused decode cache).
* ``sample-path`` (float32 only: the model's dtype): what ``sample`` does for one row, on the same
  context stored by ``generate_kv_cache`` as a chain of 256-token chunks in a store of that codec:
  ``kvstore.model.stages.load.load_prefix`` into batch buffers ``[1, kv_heads, n + 40, head_dim]`` allocated once
  (lazy per-tensor decoding on the store's decode threads, straight into the buffers).

The fair baseline for the load paths into preallocated buffers is ``memcpy-prealloc`` (the same
bytes copied into memory allocated once); ``memcpy-fresh`` is the baseline for fresh buffers.

MB/s counts the KV bytes delivered (keys + values, uncompressed), 1 MB = 10^6 bytes.

Command (from the repository root; the suite ``throughput``: ``python -m experiments run throughput [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/):

    .venv/bin/python experiments/bench_throughput.py             # 2048 tokens, 7 repeats
    .venv/bin/python experiments/bench_throughput.py --quick     # smoke test: 256 tokens, 2 repeats
"""

from __future__ import annotations

import shutil

import torch
import xxhash

import benchlib as bl

DEFAULT_CODECS = ("raw", "zstd:1", "zstd:3", "zstd-shuffle:1", "zstd-shuffle:3")


def main() -> None:
    p = bl.parser(__doc__)
    args = bl.start(p, quick=bl.codec_args(p, DEFAULT_CODECS, "float32,bfloat16", repeats=7))
    adapter = bl.load_adapter("float32")
    from kvstore.model.compute.cache import new_buffers
    from kvstore.model.stages.load import load_prefix
    from kvstore.store.entry import Entry
    from kvstore.store.keys import cache_key
    from kvstore.store.kvstore import KVStore

    ids = bl.real_context_ids(adapter.tokenizer, args.tokens)
    layers32 = tuple((k.contiguous().clone(), v.contiguous().clone()) for k, v in adapter.prefill([ids])[0])
    scratch = bl.SCRATCH / "throughput"
    shutil.rmtree(scratch, ignore_errors=True)
    codecs = args.codecs.split(",")
    stores = {c: KVStore(str(scratch / c.replace(":", "")), codec=c, sync=False) for c in codecs}
    rows = []
    chain_stores: list = []
    try:
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            layers = tuple((k.to(dtype), v.to(dtype)) for k, v in layers32)
            key = cache_key(adapter.fingerprint, dtype, ids)
            entry = Entry(key, adapter.fingerprint, adapter.name, torch.tensor(ids), layers)
            kv_bytes = sum(2 * k.numel() * k.element_size() for k, _ in layers)
            h, n, d = layers[0][0].shape
            sizes = {}
            for c, s in stores.items():
                s.put(entry)
                sizes[c] = len(s.backend.get(b"e/" + key.encode()))
            src = torch.empty(kv_bytes, dtype=torch.uint8).fill_(7)
            dst = torch.empty_like(src).fill_(0)
            pre = [(torch.empty(h, n, d, dtype=dtype), torch.empty(h, n, d, dtype=dtype)) for _ in layers]

            def fresh_copy():
                torch.empty_like(src).copy_(src)

            methods: dict[str, object] = {"memcpy-prealloc": lambda: dst.copy_(src), "memcpy-fresh": fresh_copy}
            for c, s in stores.items():

                def checksum(s=s):
                    with s.backend.view(b"e/" + key.encode()) as buf:
                        xxhash.xxh3_64_intdigest(buf[:-8])

                def open_only(s=s):
                    with s.open_entry(key) as view:
                        assert view is not None

                def get_dynamic(s=s):
                    cache = s.get(key).to_dynamic_cache()
                    assert cache.get_seq_length() == n

                def adapter_fresh(s=s):
                    bufs = [
                        (torch.empty(1, h, n + 40, d, dtype=dtype), torch.empty(1, h, n + 40, d, dtype=dtype))
                        for _ in layers
                    ]
                    with s.open_entry(key) as view:
                        for li, (kb, vb) in enumerate(bufs):
                            kr, vr = view.layer(li)
                            kr.copy_into(kb[0, :, 40:])
                            vr.copy_into(vb[0, :, 40:])

                def into_prealloc(s=s):
                    with s.open_entry(key) as view:
                        for li, (kb, vb) in enumerate(pre):
                            kr, vr = view.layer(li)
                            kr.copy_into(kb)
                            vr.copy_into(vb)

                if dname == "float32":  # the sample path: a chain of chunks into the batch buffers
                    chain_store = KVStore(str(scratch / f"chain-{c.replace(':', '')}"), codec=c, sync=False)
                    chain_stores.append(chain_store)
                    adapter.generate_kv_cache([ids], chain_store, batch_size=1)
                    plan = adapter.chain(ids, chain_store)
                    bufs = new_buffers(adapter.kv_shapes(), 1, n + 40, adapter.dtype, adapter.device)

                    def sample_path(store=chain_store, plan=plan, bufs=bufs):
                        assert load_prefix(adapter.handle, store, plan, bufs, 0, 40) == n

                    methods[f"{c}|sample-path"] = sample_path
                methods |= {
                    f"{c}|checksum": checksum,
                    f"{c}|open": open_only,
                    f"{c}|get+to_dynamic_cache": get_dynamic,
                    f"{c}|adapter-fresh": adapter_fresh,
                    f"{c}|into-prealloc": into_prealloc,
                }
            for fn in methods.values():  # warm-up
                fn()
            for c, s in stores.items():  # the load path delivers the right values
                with s.open_entry(key) as view:
                    kb = torch.zeros(h, n + 40, d, dtype=dtype)
                    view.layer(len(layers) - 1)[1].copy_into(kb[:, 40:])
                    assert torch.equal(kb[:, 40:], layers[-1][1]), c
            times: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(args.repeats):
                for m, fn in methods.items():
                    times[m] += bl.repeat(fn, 1, warmup=0)
            summ = {m: bl.summarize(ts) for m, ts in times.items()}
            mc_pre = kv_bytes / summ["memcpy-prealloc"]["median"] / 1e6
            mc_fresh = kv_bytes / summ["memcpy-fresh"]["median"] / 1e6
            for m, s in summ.items():
                codec, _, what = m.rpartition("|")
                mbps = kv_bytes / s["median"] / 1e6
                rows.append(
                    {
                        "dtype": dname,
                        "tokens": n,
                        "kv_mb": round(kv_bytes / 1e6, 1),
                        "codec": codec or "-",
                        "path": what,
                        "stored_mb": round(sizes[codec] / 1e6, 1) if codec else "",
                        "ratio": round(sizes[codec] / kv_bytes, 3) if codec else "",
                        "median_ms": s["median"] * 1e3,
                        "min_ms": s["min"] * 1e3,
                        "max_ms": s["max"] * 1e3,
                        "mb_per_s": mbps,
                        "mb_per_s_min": kv_bytes / s["max"] / 1e6,
                        "mb_per_s_max": kv_bytes / s["min"] / 1e6,
                        "pct_memcpy_fresh": 100 * mbps / mc_fresh,
                        "pct_memcpy_prealloc": 100 * mbps / mc_pre,
                        "n": s["n"],
                    }
                )
            print(f"{dname}, {n} tokens, {kv_bytes / 1e6:.1f} MB of KV (load {bl.loadavg()}):")
            for r in rows:
                if r["dtype"] == dname:
                    print(
                        f"  {r['codec']:<16} {r['path']:<22} {r['median_ms']:8.1f} ms  {r['mb_per_s']:8.0f} MB/s  "
                        f"{r['pct_memcpy_fresh']:5.0f}% of fresh memcpy  {r['pct_memcpy_prealloc']:5.0f}% of prealloc",
                        flush=True,
                    )
    finally:
        for s in [*stores.values(), *chain_stores]:
            s.close()
        shutil.rmtree(scratch, ignore_errors=True)
    bl.write_result("throughput", params=vars(args), rows=rows)


if __name__ == "__main__":
    main()
