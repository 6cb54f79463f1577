"""Which lossless layout loads closest to a plain copy: byte planes, 16-bit halves, or a raw low part.

The KV of one real context (the demo articles, bundled SmolLM2-135M-Instruct, float32 prefill;
bfloat16 and float16 rows are that KV cast, which keeps the bit statistics of a 16-bit cache) is cut
into the store's 512-token chunks, one tensor per layer, role and chunk, and stored per layout:

* ``raw``: the bytes as they are (a load is one copy);
* ``whole``: one zstd frame per tensor (``zstd:L``);
* ``bytes``: one zstd frame per byte plane (``zstd-shuffle:L``, the old default);
* ``split-LO/HI``: each element's first ``LO`` bytes (little-endian: the low mantissa bits) stored
  as they are, its last ``HI`` bytes (sign, exponent, top mantissa bits) in one zstd frame;
  ``split-2+1/1`` (float32): bytes 0-1 and byte 2 as they are, only byte 3 (sign and 7 exponent
  bits) compressed.

Per layout and level, on one thread, ``--repeats`` times: stored/raw ratio, compress time, and the
load: decompress and put every tensor straight into its place in a padded batch buffer (a strided
view, as a kvstore load does), against a plain copy of the same bytes into the same place. Every
load is checked to give the original bytes back.

Command (from the repository root; the suite ``codec_split``: ``python -m experiments run codec_split
[ARGS]`` writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/codec_split.py
"""

from __future__ import annotations

import warnings

import torch
import zstandard

import benchlib as bl

UNIT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
Planes = tuple[tuple[int, bool], ...]  # (width in bytes, compressed) per plane, in byte order


def layouts(itemsize: int) -> list[tuple[str, Planes]]:
    """Candidate plane layouts for ``itemsize``-byte elements."""
    out: list[tuple[str, Planes]] = [("raw", ((itemsize, False),)), ("whole", ((itemsize, True),))]
    out.append(("bytes", ((1, True),) * itemsize))
    if itemsize == 4:
        out += [("split-2/2", ((2, False), (2, True))), ("split-2+1/1", ((2, False), (1, False), (1, True)))]
    if itemsize == 2:
        out.append(("split-1/1", ((1, False), (1, True))))
    return out


def encode(t: torch.Tensor, planes: Planes, cctx) -> list[tuple[bool, bytes]]:
    """``(compressed, bytes)`` per plane of ``t``."""
    b = t.reshape(-1).view(torch.uint8).view(-1, t.element_size())
    out, off = [], 0
    for width, compressed in planes:
        data = b[:, off : off + width].contiguous().numpy().tobytes()
        out.append((compressed, cctx.compress(data) if compressed else data))
        off += width
    return out


def place(dest: torch.Tensor, parts: list[tuple[bool, bytes]], planes: Planes, dctx) -> None:
    """Decompress ``parts`` and put them into ``dest`` ([heads, n, dim] strided view)."""
    size, rows = dest.element_size(), dest.shape[0]
    if len(planes) == 1:
        c, p = parts[0]
        dest.copy_(torch.frombuffer(dctx.decompress(p) if c else p, dtype=dest.dtype).view(dest.shape))
        return
    off = 0
    for (width, _), (c, p) in zip(planes, parts):
        unit = UNIT[width]
        target = dest.view(rows, -1).view(unit).view(rows, -1, size // width)
        target[:, :, off // width].copy_(torch.frombuffer(dctx.decompress(p) if c else p, dtype=unit).view(rows, -1))
        off += width


def main() -> None:
    p = bl.parser(__doc__, threads=1, quick=False)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--levels", default="1")
    p.add_argument("--repeats", type=int, default=5)
    args = bl.start(p)
    warnings.simplefilter("ignore", UserWarning)  # read-only frombuffer views: never written
    adapter = bl.load_adapter()
    ids = bl.real_context_ids(adapter.tokenizer, args.tokens)
    with torch.inference_mode():
        layers = adapter.prefill([ids])[0]
    dctx = zstandard.ZstdDecompressor()
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kv = [t.to(dtype).contiguous() for pair in layers for t in pair]
        pad = 7  # the batch buffer has a few slots of left padding: destinations are strided views
        bufs = [torch.zeros(t.shape[0], t.shape[1] + pad, t.shape[2], dtype=dtype) for t in kv]
        chunks = [
            (i, s, t[:, s : s + args.chunk].contiguous())
            for i, t in enumerate(kv)
            for s in range(0, t.shape[1], args.chunk)
        ]
        raw = sum(c.numel() * c.element_size() for _, _, c in chunks)
        for name, planes in layouts(dtype.itemsize):
            for level in [int(x) for x in args.levels.split(",")] if name != "raw" else [0]:
                cctx = zstandard.ZstdCompressor(level=max(level, 1), write_content_size=True)
                with bl.timed() as t:
                    enc = [encode(c, planes, cctx) for _, _, c in chunks]
                comp = t.seconds
                stored = sum(len(b) for parts in enc for _, b in parts)
                load, copy = [], []
                for _ in range(args.repeats):
                    for b in bufs:
                        b.zero_()
                    with bl.timed() as t:
                        for (i, s, c), parts in zip(chunks, enc):
                            place(bufs[i][:, pad + s : pad + s + c.shape[1]], parts, planes, dctx)
                    load.append(t.seconds * 1e3)
                    unit = UNIT[dtype.itemsize]
                    assert all(torch.equal(b[:, pad:].view(unit), x.view(unit)) for b, x in zip(bufs, kv))
                    with bl.timed() as t:
                        for i, s, c in chunks:
                            bufs[i][:, pad + s : pad + s + c.shape[1]].copy_(c)
                    copy.append(t.seconds * 1e3)
                row = {
                    "dtype": str(dtype).removeprefix("torch."), "layout": name, "level": level,
                    "ratio": stored / raw, "compress_ms": comp * 1e3, "load_ms": load, "copy_ms": copy,
                }  # fmt: skip
                for k in ("load_ms", "copy_ms"):
                    s = bl.summarize(row[k])
                    row |= {f"{k}_median": s["median"], f"{k}_min": s["min"], f"{k}_max": s["max"]}
                rows.append(row)
                lm, cm = row["load_ms_median"], row["copy_ms_median"]
                print(
                    f"{row['dtype']:<9} {name:<10} L{level} ratio {row['ratio']:.3f}  compress {comp * 1e3:6.1f} ms  "
                    f"load {lm:6.1f} ms (min {min(load):.1f} max {max(load):.1f})  copy {cm:5.1f} ms  "
                    f"x copy {lm / cm:4.2f}",
                    flush=True,
                )
    bl.write_result("codec_split", params=vars(args), rows=rows)


if __name__ == "__main__":
    main()
