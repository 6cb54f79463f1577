"""What a press's scoring costs against a prefill of the same context: KVzip's replay above all.

The bundled SmolLM2-135M-Instruct (float32, CPU, sdpa, grouped-KV attention as kvstore's forwards
run), contexts of ``--lengths`` tokens (real text: the demo articles run together and cut to
length, as :func:`benchlib.real_context_ids` gives them; no chat template, so KVzip replays every
token). Per length and ``--repeats`` runs (min/median/max): the prefill of the context
(``kvstore.model.compute.forward.prefill``, the build's), then each scorer's whole scoring of that
context from its dense cache in memory (``kvstore.model.press.select.row_scores`` with a fresh memo:
what a press runs once per context, its forward included): ``kvzip`` (the context replayed after the
repeat prompt, in 2,048-token chunks), ``expected_attention`` (the context's tokens after the sinks
run again for their queries), ``snapkv`` (its 64-token window again) and ``knorm`` (keys only).
Rows: the seconds and their ratio to the prefill's median, and the scoring tokens each ran. KVzip's
goal: at most 2.5x a prefill (kvpress states 2-3x for its implementation).

Command (from the repository root; the suite ``press_cost``: ``python -m experiments run press_cost``
writes ``press_cost.json`` into experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_press_cost.py --wait 600
    .venv/bin/python experiments/bench_press_cost.py --quick   # 512 tokens, 1 run
"""

from __future__ import annotations

import benchlib as bl

LENGTHS = (1024, 2048, 4096)
SCORERS = ("kvzip", "expected_attention", "snapkv", "knorm")


def main() -> None:
    ap = bl.parser(__doc__)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--scorers", default=",".join(SCORERS))
    ap.add_argument("--repeats", type=int, default=3)
    args = bl.start(ap, quick=dict(lengths="512", repeats=1), wait=False)
    import torch

    from kvstore.model.compute.attention import grouped_kv
    from kvstore.model.compute.forward import prefill
    from kvstore.model.press.select import PressMemo, row_scores
    from kvstore.model.press.spec import parse_scorer
    from kvstore.model.stages.answer import prefill_contexts

    adapter = bl.load_adapter("float32")
    handle = adapter.handle
    rows = []
    bl.wait_for_quiet(max_wait_s=args.wait)
    for n in (int(x) for x in args.lengths.split(",")):
        ids = bl.real_context_ids(adapter.tokenizer, n)
        with grouped_kv(), torch.inference_mode():
            prefill(handle, [ids])  # warm-up
            prefill_s = []
            for _ in range(args.repeats):
                with bl.timed() as t:
                    prefill(handle, [ids])
                prefill_s.append(t.seconds)
            base = bl.summarize(prefill_s)
            rows.append({"length": n, "what": "prefill", "seconds": base, "runs_s": prefill_s, "vs_prefill": 1.0,
                         "scoring_tokens": 0})  # fmt: skip
            cache = prefill_contexts(handle, [ids], 1, False)
            for name in args.scorers.split(","):
                scorer = parse_scorer(name)
                runs, tokens = [], 0
                for _ in range(args.repeats):
                    memo = PressMemo()
                    with bl.timed() as t:
                        row_scores(handle, cache, scorer, 0, memo)
                    runs.append(t.seconds)
                    tokens = memo.tokens.total
                s = bl.summarize(runs)
                rows.append({"length": n, "what": name, "seconds": s, "runs_s": runs,
                             "vs_prefill": s["median"] / base["median"], "scoring_tokens": tokens})  # fmt: skip
                print(f"  {n:>5} {name:>20}: {s['median']:.2f} s ({s['median'] / base['median']:.2f}x a prefill of "
                      f"{base['median']:.2f} s)", flush=True)  # fmt: skip
        bl.write_result("press_cost", params=vars(args), rows=rows,
                        notes={"model": "SmolLM2-135M-Instruct (bundled GGUF), float32, CPU, sdpa"})  # fmt: skip


if __name__ == "__main__":
    main()
