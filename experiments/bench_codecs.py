"""Codec table: compression ratio and compress/decompress MB/s on real KV from the bundled model.

The KV of 2048 tokens of real English (the demo articles run together) from SmolLM2-135M-Instruct,
prefilled with the model itself in fp32, bf16 and fp16 (the KV dtype is the model's dtype), is
packed with each lossless codec by the library's own ``Packing.pack`` and read back by ``Packing.unpack``:

* ``ratio``: payload bytes / uncompressed safetensors bytes (lower is better; raw = 1.0).
* ``compress``: ``Packing.pack`` (byte-shuffle when asked, then one zstd frame per tensor), 1 thread.
* ``decompress``: ``Packing.unpack`` (eager) with the store's default thread count (one per core, here 2)
  and with 1 thread; zero-copy views for raw, so raw's figure is parsing only.
* ``decode+copy``: ``Packing.unpack`` (store threads) + ``copy_into`` every tensor into contiguous
  destinations allocated once (unshuffling on the way for shuffled codecs): what the load path pays.

MB/s are uncompressed bytes per second (1 MB = 10^6 bytes); median over repeats, min-max beside.
Entry-level costs (checksum, LMDB) and the lazy load path are in bench_throughput.py.

Command (from the repository root; the suite ``codecs``: ``python -m experiments run codecs [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/):

    .venv/bin/python experiments/bench_codecs.py             # 2048 tokens, 5 repeats
    .venv/bin/python experiments/bench_codecs.py --quick     # smoke test: 256 tokens, 2 repeats
"""

from __future__ import annotations

import os

import torch

import benchlib as bl

DEFAULT_CODECS = ("raw", "zstd:1", "zstd:3", "zstd:9", "zstd-shuffle:1", "zstd-shuffle:3", "zstd-shuffle:9")


def main() -> None:
    p = bl.parser(__doc__)
    args = bl.start(p, quick=bl.codec_args(p, DEFAULT_CODECS, "float32,bfloat16,float16", repeats=5))
    from kvstore.store.codecs import get_codec

    rows = []
    store_threads = max(1, min(8, os.cpu_count() or 1))
    for dname in args.dtypes.split(","):
        adapter = bl.load_adapter(dname)
        ids = bl.real_context_ids(adapter.tokenizer, args.tokens)
        layers = [(k.contiguous().clone(), v.contiguous().clone()) for k, v in adapter.prefill([ids])[0]]
        del adapter
        tensors = []
        for i, (k, v) in enumerate(layers):
            tensors += [(f"layers.{i}.keys", k), (f"layers.{i}.values", v)]
        tensors.append(("token_ids", torch.tensor(ids, dtype=torch.int64)))
        meta = {"dtype": dname}
        dests = [torch.empty_like(t) for _, t in tensors]
        for spec in args.codecs.split(","):
            packing = get_codec(spec).packing  # lossless: the bytes only
            payload, params, raw_bytes = packing.pack(tensors, meta)

            def decode(threads, packing=packing, payload=payload, params=params, raw_bytes=raw_bytes):
                return packing.unpack(memoryview(payload), params, raw_bytes, threads)

            def decode_copy(decode=decode):
                d = decode(store_threads)
                for (name, _), dst in zip(tensors, dests):
                    d.tensors[name].copy_into(dst)

            t_enc = bl.repeat(lambda packing=packing: packing.pack(tensors, meta), args.repeats, warmup=1)
            t_dec = bl.repeat(lambda: decode(store_threads), args.repeats, warmup=1)
            t_dec1 = bl.repeat(lambda: decode(1), args.repeats, warmup=1)
            t_dc = bl.repeat(decode_copy, args.repeats, warmup=1)
            assert all(torch.equal(dst, t) for (_, t), dst in zip(tensors, dests)), f"{spec} does not round-trip"
            row = {
                "dtype": dname,
                "tokens": args.tokens,
                "codec": spec,
                "raw_mb": round(raw_bytes / 1e6, 2),
                "stored_mb": round(len(payload) / 1e6, 2),
                "ratio": round(len(payload) / raw_bytes, 4),
            }
            for name, ts in (
                ("compress", t_enc),
                ("decompress", t_dec),
                ("decompress_1thread", t_dec1),
                ("decode_copy", t_dc),
            ):
                s = bl.summarize(ts)
                row |= {
                    f"{name}_mb_s": raw_bytes / s["median"] / 1e6,
                    f"{name}_mb_s_min": raw_bytes / s["max"] / 1e6,
                    f"{name}_mb_s_max": raw_bytes / s["min"] / 1e6,
                }
            rows.append(row)
            print(
                f"  {dname:<9} {spec:<15} ratio {row['ratio']:.3f}  compress {row['compress_mb_s']:7.0f}  decompress "
                f"{row['decompress_mb_s']:7.0f} ({row['decompress_1thread_mb_s']:.0f} 1 thread)  decode+copy "
                f"{row['decode_copy_mb_s']:7.0f} MB/s   (load {bl.loadavg()[0]})",
                flush=True,
            )
    bl.write_result("codecs", params=vars(args) | {"decode_threads": store_threads}, rows=rows)
    plot(rows, bl.RESULTS / "codecs.png")


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = {"float32": "o", "bfloat16": "s", "float16": "^"}
    for r in rows:
        ax.scatter(
            r["decode_copy_mb_s"],
            r["ratio"],
            marker=markers.get(r["dtype"], "o"),
            color=f"C{list(dict.fromkeys(x['codec'] for x in rows)).index(r['codec'])}",
        )
        ax.annotate(
            f"{r['codec']}", (r["decode_copy_mb_s"], r["ratio"]), fontsize=6, xytext=(3, 2), textcoords="offset points"
        )
    for d, m in markers.items():
        ax.scatter([], [], marker=m, color="gray", label=d)
    ax.axhline(0.70, color="k", linestyle=":", label="target on bf16: <= 0.70")
    ax.set_xscale("log")
    ax.set_xlabel("decode + copy into place (MB/s of KV, log)")
    ax.set_ylabel("stored / raw size")
    ax.set_title("Codecs on SmolLM2-135M KV (2048 tokens of real text), CPU")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
