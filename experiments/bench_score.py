"""``Adapter.score`` on 4-option questions over ~1.3k-token documents: no cache, cold store, warm store.

The rows of the lm-eval benchmark task (experiments/data/lm_eval/kv_bench_data.py: documents of
four demo articles, one question about the last, four options), scored with the library directly
(no lm-eval): prompt ``document + "\\nQuestion: " + question + "\\nAnswer:"``, options after a space.
The bundled SmolLM2-135M-Instruct, float32, CPU, batch size 8. Per repetition, in this order: the
no-cache reference (every option runs its whole prompt), kvstore on an empty store (cold: each
prompt prefilled once and stored), kvstore again on that store (warm: a new store object, every
prompt loaded). Checked on every repetition: acc and acc_norm identical in the three modes,
option log-likelihoods within 1e-4 of the reference, ``is_greedy`` identical, warm computes no
context token.

    .venv/bin/python experiments/bench_score.py --documents 8 --repeats 3

Writes ``score.json`` after every repetition (min / median / max per mode, the speed-ups of the
medians, the load average before and after each run): through the suite ``score`` (``python -m
experiments run score [ARGS]``) into experiments/results/, run by hand into cache/bench/raw/.
"""

from __future__ import annotations

import importlib.util
import shutil
import statistics

from benchlib import HERE, SCRATCH, load_adapter, loadavg, parser, start, timed, write_result


def _rows(n: int) -> list[dict]:
    spec = importlib.util.spec_from_file_location("kv_bench_data", HERE / "data" / "lm_eval" / "kv_bench_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rows()[:n]


def _accuracy(lls: list[list[float]], rows: list[dict]) -> tuple[float, float]:
    acc = sum(max(range(len(x)), key=x.__getitem__) == r["label"] for x, r in zip(lls, rows)) / len(rows)
    norm = [[v / len(c) for v, c in zip(x, r["choices"])] for x, r in zip(lls, rows)]
    acc_norm = sum(max(range(len(x)), key=x.__getitem__) == r["label"] for x, r in zip(norm, rows)) / len(rows)
    return acc, acc_norm


def main() -> None:
    ap = parser(__doc__, batch_size=8, quick=False)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = start(ap)
    from kvstore.store.kvstore import KVStore

    rows = _rows(args.documents)
    prompts, options, owner = [], [], []
    for n, r in enumerate(rows):
        prompt = f"{r['document']}\nQuestion: {r['question']}\nAnswer:"
        for c in r["choices"]:
            prompts.append(prompt)
            options.append(" " + c)
            owner.append(n)
    adapter = load_adapter("float32")
    prompt_tokens = [len(adapter.encode_context(r["document"] + "\nQuestion: " + r["question"] + "\nAnswer:"))
                     for r in rows]  # fmt: skip
    params = vars(args) | {
        "documents": len(rows),
        "options": len(options),
        "model": "SmolLM2-135M-Instruct (bundled)",
        "dtype": "float32",
        "prompt_tokens": {"min": min(prompt_tokens), "max": max(prompt_tokens)},
    }
    runs: list[dict] = []
    store_dir = SCRATCH / "score-store"
    for rep in range(args.repeats):
        shutil.rmtree(store_dir, ignore_errors=True)
        run: dict = {"repeat": rep}
        scored = {}
        for mode in ("no_cache", "cold", "warm"):
            load = loadavg()
            with timed() as t:
                if mode == "no_cache":
                    got = adapter.score(prompts, options, use_cache=False, batch_size=args.batch_size)
                else:
                    with KVStore(str(store_dir)) as store:
                        got = adapter.score(prompts, options, store=store, batch_size=args.batch_size)
            seconds = t.seconds
            scored[mode] = got
            lls = [[s.logprob for j, s in enumerate(got.rows) if owner[j] == n] for n in range(len(rows))]
            acc, acc_norm = _accuracy(lls, rows)
            run[mode] = {"seconds": round(seconds, 3), "load_before": load, "load_after": loadavg(), "acc": acc,
                         "acc_norm": acc_norm, "prefill_tokens_computed": got.prefill_tokens_computed,
                         "prefill_tokens_saved": got.prefill_tokens_saved}  # fmt: skip
            print(f"repeat {rep} {mode}: {seconds:.1f} s, computed {got.prefill_tokens_computed}", flush=True)
        ref = scored["no_cache"]
        for mode in ("cold", "warm"):
            diff = max(abs(a.logprob - b.logprob) for a, b in zip(scored[mode].rows, ref.rows))
            same_greedy = all(a.is_greedy == b.is_greedy for a, b in zip(scored[mode].rows, ref.rows))
            run[mode] |= {"max_abs_logprob_diff_vs_no_cache": diff, "is_greedy_identical": same_greedy}
            assert diff <= 1e-4 and same_greedy, (mode, diff)
            assert (run[mode]["acc"], run[mode]["acc_norm"]) == (run["no_cache"]["acc"], run["no_cache"]["acc_norm"])
        assert run["warm"]["prefill_tokens_computed"] == 0
        runs.append(run)
        write_result("score", params=params, rows=runs, notes={"summary": _summary(runs)})
    shutil.rmtree(store_dir, ignore_errors=True)
    print(_summary(runs))


def _summary(runs: list[dict]) -> dict:
    out: dict = {}
    for mode in ("no_cache", "cold", "warm"):
        xs = [r[mode]["seconds"] for r in runs]
        out[mode] = {"median_s": round(statistics.median(xs), 3), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}
    for mode in ("cold", "warm"):
        out[f"speedup_{mode}_vs_no_cache"] = round(out["no_cache"]["median_s"] / out[mode]["median_s"], 2)
    return out


if __name__ == "__main__":
    main()
