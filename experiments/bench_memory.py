"""Peak memory of a prefill, one forward vs chunked prefill, against the model and its KV.

Each configuration runs in a fresh subprocess: load the bundled SmolLM2-135M-Instruct (float32),
then reset the kernel's peak-RSS mark (``/proc/self/clear_refs``) and prefill one context of
``--tokens`` tokens (the demo articles, repeated as needed) with ``Adapter.prefill`` at the given
``prefill_chunk_tokens`` (0: one forward) and attention implementation, under the grouped-KV
attention that ``build`` uses. Reported: the process's
RSS before, its peak during the prefill (``VmHWM``), the growth between them, the context's KV
bytes (what the cache must hold) and the wall time. The growth beyond the KV is the prefill's
working memory: activations, attention scratch (eager attention materializes a
``heads x piece x context`` score matrix per layer), allocator slack.

Command (from the repository root; the suite ``memory``: ``python -m experiments run memory [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/):

    .venv/bin/python experiments/bench_memory.py                      # 2k and 8k tokens
    .venv/bin/python experiments/bench_memory.py --quick              # smoke test: 1k tokens
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import benchlib as bl


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(tokens: int, piece: int, attn: str) -> dict:
    import torch

    from kvstore.model.adapter import Adapter
    from kvstore.model.compute.attention import grouped_kv

    adapter = Adapter.from_pretrained(None, dtype="float32", attn_implementation=attn)
    text = bl.real_context_ids(adapter.tokenizer, 6000)
    ids = (text * (tokens // len(text) + 1))[:tokens]
    adapter.prefill_chunk_tokens = piece
    with torch.inference_mode():
        adapter.prefill([ids[:64]])  # warm the allocator and kernels
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    with bl.timed() as t, torch.inference_mode(), grouped_kv():  # as build runs it
        layers = adapter.prefill([ids])[0]
    seconds = t.seconds
    peak = _status("VmHWM")
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
    params = sum(p.numel() * p.element_size() for p in adapter.model.parameters())
    return {"tokens": tokens, "prefill_chunk": piece, "attn": attn, "seconds": seconds,
            "rss_before_mib": before / 2**20, "peak_mib": peak / 2**20, "growth_mib": (peak - before) / 2**20,
            "kv_mib": kv / 2**20, "working_mib": (peak - before - kv) / 2**20, "model_mib": params / 2**20}  # fmt: skip


def main() -> None:
    p = bl.parser(__doc__)
    p.add_argument("--tokens", default="2048,8000")
    p.add_argument("--chunks", default="0,2048,512")
    p.add_argument("--attn", default="sdpa,eager")
    p.add_argument("--child", nargs=3, metavar=("TOKENS", "CHUNK", "ATTN"), help=argparse.SUPPRESS)
    args = bl.start(p, quick=dict(tokens="1024", chunks="0,256", attn="sdpa"))
    if args.child:
        n, c, a = args.child
        print(json.dumps(child(int(n), int(c), a)))
        return
    rows = []
    for attn in args.attn.split(","):
        for n in map(int, args.tokens.split(",")):
            for c in map(int, args.chunks.split(",")):
                cmd = [sys.executable, __file__, "--child", str(n), str(c), attn, "--threads", str(args.threads)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(res.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(
                    f"{attn} {n} tokens, chunk {c or 'none'}: peak growth {row['growth_mib']:.0f} MiB "
                    f"(KV {row['kv_mib']:.0f}, working {row['working_mib']:.0f}), {row['seconds']:.1f} s",
                    flush=True,
                )
    bl.write_result("memory", params=vars(args), rows=rows)
    print(bl.md_table(
        [[r["attn"], r["tokens"], r["prefill_chunk"] or "one forward", f"{r['model_mib']:.0f}", f"{r['kv_mib']:.0f}",
          f"{r['growth_mib']:.0f}", f"{r['working_mib']:.0f}", f"{r['seconds']:.1f}"] for r in rows],
        ["attention", "tokens", "prefill chunk", "model MiB", "KV MiB", "peak growth MiB", "working MiB", "s"],
    ))  # fmt: skip


if __name__ == "__main__":
    main()
