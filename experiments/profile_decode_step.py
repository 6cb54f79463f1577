"""Where a batch-8 decode step's time goes, eager and compiled (``sample --compile``).

The bundled SmolLM2-135M-Instruct (float32, 2 threads) decodes from a 512-token cache (random keys
and values; a left-padded batch: row r starts 8r slots late, so the step has a real mask), batch
8. After warm-up (and compilation), ``torch.profiler`` records 10 steps of each: kvstore's eager
step (the key length grows) and its fixed-shape step under ``torch.compile`` (a 768-slot bucket).
Self CPU time by operator: the suite writes it to ``experiments/results/profile_decode_step.json``.

Command (from the repository root; the suite ``profile_decode_step``: ``python -m experiments run
profile_decode_step`` writes experiments/results/; run by hand it writes to cache/bench/raw/):

    .venv/bin/python experiments/profile_decode_step.py
"""

from __future__ import annotations

import torch
from torch.profiler import profile

import benchlib as bl


def main() -> None:
    bl.start(bl.parser(__doc__, quick=False))
    from kvstore.model.compute.attention import grouped_kv
    from kvstore.model.compute.cache import PreallocatedCache
    from kvstore.model.compute.static import StaticSteps, bucket_slots

    adapter = bl.load_adapter()
    model = adapter.model
    B, C, steps = 8, 512, 10
    T = bucket_slots(C + 40, True)
    g = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    notes: dict = {"ms_per_step": {}}
    with torch.inference_mode(), grouped_kv():
        bufs = [(torch.randn(B, h, T, dk, generator=g), torch.randn(B, h, T, dv, generator=g))
                for h, dk, dv in adapter.kv_shapes()]  # fmt: skip
        mask = torch.ones(B, T, dtype=torch.long)
        for r in range(B):
            mask[r, : 8 * r] = 0
        tok = torch.randint(100, 1000, (B,), generator=g)
        pos = C - 8 * torch.arange(B)
        eager_cache = PreallocatedCache(bufs, C)

        def eager(t: int):
            return model(input_ids=tok[:, None], attention_mask=mask[:, : C + t + 1], position_ids=(pos + t)[:, None],
                         past_key_values=eager_cache, use_cache=True, logits_to_keep=1)  # fmt: skip

        fixed = StaticSteps(adapter, [(k.clone(), v.clone()) for k, v in bufs], mask, C, pos, compiled=True)
        with bl.timed() as clock:
            fixed(tok, 0)
        notes["first_compiled_step_s"] = clock.seconds
        print(f"first compiled step (compilation included): {notes['first_compiled_step_s']:.1f} s", flush=True)
        runs = (("eager", eager, 0), ("compiled fixed-shape", lambda t: fixed(tok, t), 1))
        for name, step, start in runs:
            for t in range(start, start + 3):
                step(t)
            with profile() as prof, bl.timed() as clock:
                for t in range(start + 3, start + 3 + steps):
                    step(t)
            wall = clock.seconds
            notes["ms_per_step"][name] = wall / steps * 1e3
            rows += [{"section": name} | r for r in bl.profile_rows(prof, 12)]
            print(f"\n{name}: {wall / steps * 1e3:.1f} ms per step (profiled)\n", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    params = {"batch": B, "cache_tokens": C, "fixed_shape_slots": T, "steps": steps}
    bl.write_result("profile_decode_step", params=params, rows=rows, notes=notes)


if __name__ == "__main__":
    main()
