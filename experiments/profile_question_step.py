"""Where the question step's time goes: a torch.profiler table of kvstore's floor at 2k tokens.

The floor is the question forward alone (23 tokens, batch 1) on a 2,048-token context already in
kvstore's preallocated buffers, with its grouped-KV attention, fp32 SmolLM2-135M-Instruct, 2
threads: the part of a stored TTFT that no store can shorten. The table lists operators by self
CPU time over ``--repeats`` forwards after one warm-up, so it shows what a leaner step would have to
remove (matrix multiplies are the model's own work; everything else is overhead).

Command (from the repository root; the suite ``profile_question_step``: ``python -m experiments run
profile_question_step [ARGS]`` writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/profile_question_step.py
"""

from __future__ import annotations

import torch

import benchlib as bl


def main() -> None:
    p = bl.parser(__doc__, quick=False)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    args = bl.start(p)
    adapter = bl.load_adapter("float32")
    ctx = bl.synthetic_ids(args.tokens, seed=1000 + args.tokens)
    q_ids = bl.synthetic_ids(bl.QUESTION_TOKENS, seed=7)
    run = bl.floor(adapter, adapter.prefill([ctx])[0], q_ids)
    run()
    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.repeats):
            times.append(run()[1])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    s = bl.summarize(times)
    print(
        f"question step at {args.tokens} tokens, {len(q_ids)}-token question, batch 1: median {s['median'] * 1e3:.1f} "
        f"ms (min {s['min'] * 1e3:.1f}, max {s['max'] * 1e3:.1f}) over {args.repeats} profiled runs (the profiler "
        "adds its own overhead)"
    )
    step = {"median_ms": s["median"] * 1e3, "min_ms": s["min"] * 1e3, "max_ms": s["max"] * 1e3, "n": s["n"]}
    bl.write_result("profile_question_step", params=vars(args) | {"question_tokens": len(q_ids)},
                    rows=bl.profile_rows(prof, 25), notes={"profiled_step": step})  # fmt: skip


if __name__ == "__main__":
    main()
