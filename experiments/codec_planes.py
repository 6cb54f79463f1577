"""Where the default codec's load time goes, and what other plane layouts would trade.

The float32 KV of one real 2,048-token context (the demo articles, bundled SmolLM2-135M-Instruct)
is split per tensor into planes and each plane compressed as one zstd level-1 frame:

* ``bytes`` (``zstd-shuffle:1``, the default before ``zstd-split:1:16``): 4 byte planes per float;
* ``halves``: 2 planes of 16-bit halves (low: mantissa bits; high: sign, exponent, top mantissa);
* ``whole``: the tensor's bytes as they are (``zstd:1``).

Per layout, on one thread (the load runs on two), ``--repeats`` times each: the stored/raw ratio
of every plane and in all, the time to decompress every frame (fresh output buffers, as the codec
does) and to put the planes back together straight into preallocated float tensors (strided copies,
as ``records._copy_planes`` does), against a plain copy of the same bytes into the same tensors.

Command (from the repository root; the suite ``codec_planes``: ``python -m experiments run codec_planes [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/):

    .venv/bin/python experiments/codec_planes.py
"""

from __future__ import annotations

import torch
import zstandard

import benchlib as bl


def planes(t: torch.Tensor, width: int) -> list[bytes]:
    """``t``'s bytes split into planes of ``width``-byte units (unit j of every element)."""
    unit = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]
    v = t.reshape(-1).view(unit).view(-1, 4 // width).t().contiguous()
    return [row.numpy().tobytes() for row in v]


def main() -> None:
    p = bl.parser(__doc__, threads=1, quick=False)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    args = bl.start(p)
    adapter = bl.load_adapter()
    ids = bl.real_context_ids(adapter.tokenizer, args.tokens)
    with torch.inference_mode():
        layers = adapter.prefill([ids])[0]
    tensors = [k.contiguous() for k, _ in layers] + [v.contiguous() for _, v in layers]
    raw = sum(t.numel() * 4 for t in tensors)
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    dctx = zstandard.ZstdDecompressor()
    dest = [torch.empty_like(t) for t in tensors]
    rows = []
    for name, width in (("bytes", 1), ("halves", 2), ("whole", 4)):
        unit = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]
        frames = [[cctx.compress(pl) for pl in planes(t, width)] for t in tensors]
        n_planes = 4 // width
        plane_ratio = [
            sum(len(f[j]) for f in frames) / (raw / n_planes) for j in range(n_planes)
        ]  # fmt: skip
        dec, put, copy = [], [], []
        for _ in range(args.repeats):
            clock = bl.timed()
            outs = [[dctx.decompress(f) for f in fr] for fr in frames]
            dec.append(clock.lap())
            for d, out in zip(dest, outs):
                target = d.view(-1).view(unit).view(-1, n_planes)
                for j, o in enumerate(out):
                    target[:, j].copy_(torch.frombuffer(o, dtype=unit))
            put.append(clock.lap())
            for d, t in zip(dest, tensors):
                d.copy_(t)
            copy.append(clock.lap())
            for d, out in zip(dest, outs):  # check the layout round-trips
                target = d.view(-1).view(unit).view(-1, n_planes)
                for j, o in enumerate(out):
                    target[:, j].copy_(torch.frombuffer(o, dtype=unit))
            assert all(torch.equal(d, t) for d, t in zip(dest, tensors))
        row = {
            "layout": name, "plane_bytes": width, "ratio": sum(len(f) for fr in frames for f in fr) / raw,
            "plane_ratios": plane_ratio, "decompress_ms": [x * 1e3 for x in dec],
            "reassemble_ms": [x * 1e3 for x in put], "copy_ms": [x * 1e3 for x in copy],
        }  # fmt: skip
        for k in ("decompress_ms", "reassemble_ms", "copy_ms"):
            s = bl.summarize(row[k])
            row |= {f"{k}_median": s["median"], f"{k}_min": s["min"], f"{k}_max": s["max"]}
        rows.append(row)
        print(
            f"{name:<7} ratio {row['ratio']:.3f} planes {[round(x, 3) for x in plane_ratio]}  decompress "
            f"{row['decompress_ms_median']:.1f} ms, reassemble {row['reassemble_ms_median']:.1f} ms, "
            f"plain copy {row['copy_ms_median']:.1f} ms",
            flush=True,
        )
    bl.write_result("codec_planes", params=vars(args), rows=rows, notes={"raw_bytes": raw})


if __name__ == "__main__":
    main()
