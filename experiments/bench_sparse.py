"""Decode-time sparse attention over stored dense caches: top-k and SparQ against dense.

For the bundled SmolLM2-135M-Instruct (float32, CPU, chat template) and two question sets:

* ``demo``: ``experiments/data/demo.jsonl`` (22 contexts of ~330 tokens, 78 questions);
* ``long``: the demo articles four at a time (5 contexts of ~1.3-1.5k tokens; every question about one
  of the four articles is asked of the joined context),

each set's contexts are built into a fresh store once, then every question is answered under every
variant in **one sweep** (:meth:`Adapter.sweep`: each batch loaded once, no prefill): ``dense``,
``topk:K`` for K in {16, 32, 64, 128, 256} and ``sparq:R:K`` for R in {8, 16, 32} and the same K.
Greedy, at most 16 new tokens, stopping at EOS or a newline. Per variant: ``accuracy`` (lenient),
``contains``, ``exact_match``, ``f1`` (:mod:`kvstore.data.metrics`), ``agreement`` (rows whose
tokens equal the dense variant's), ``first_token_agreement``, ``decode_s`` (question forwards and
decode steps of every batch under that variant) and ``tokens_per_s`` (generated tokens / decode_s).

CPU time is scarce on the shared machine, so by default every third demo question (26) and every
fourth long one (``--every``) are asked; the result file lists the arguments.

Cost of a sweep against separate runs (``cost``): on the first ``--cost-rows`` demo questions, the
variants ``dense``, ``topk:64``, ``sparq:16:64`` answered by one sweep, and by one ``greedy_sample``
per variant (each loads every batch from the store again), ``--repeats`` times each (min, median,
max). A separate CLI ``sample`` run would also load the model once more each time: ``model_load_s``
is that, measured once.

Command (from the repository root; the suite ``sparse``: ``python -m experiments run sparse [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_sparse.py
    .venv/bin/python experiments/bench_sparse.py --sets long --cost-rows 0 --stem sparse_long
    .venv/bin/python experiments/bench_sparse.py --quick     # 16 demo rows, 3 variants, no long set
"""

from __future__ import annotations

import shutil
import statistics

import benchlib as bl

WORK = bl.SCRATCH / "sparse"
KS = (16, 32, 64, 128, 256)
RS = (8, 16, 32)
N_NEW = 16
STOPS = ("\n",)
COST_VARIANTS = ("dense", "topk:64", "sparq:16:64")


def grid() -> list[str]:
    return ["dense"] + [f"topk:{k}" for k in KS] + [f"sparq:{r}:{k}" for r in RS for k in KS]


def kwargs(fmt) -> dict:
    return dict(batch_size=8, prefix=fmt.head or None, special_tokens=fmt.add_special_tokens, stop_strings=STOPS)


def variant_rows(adapter, name: str, rows: list[dict], results: dict, ctx_tokens: list[int]) -> list[dict]:
    from kvstore.data.metrics import clean_prediction, score

    dense = results["dense"]
    out = []
    for v, res in results.items():
        preds = [clean_prediction(adapter.decode(res.tokens[i][: res.lengths[i]])) for i in range(len(rows))]
        s = score(preds, [r["answers"] for r in rows])
        same = [
            res.lengths[i] == dense.lengths[i] and bool((res.tokens[i] == dense.tokens[i]).all())
            for i in range(len(rows))
        ]
        first = [int(res.tokens[i][0]) == int(dense.tokens[i][0]) for i in range(len(rows))]
        generated = sum(res.lengths)
        out.append(
            {
                "set": name,
                "variant": v,
                "method": v.split(":")[0],
                "R": int(v.split(":")[1]) if v.startswith("sparq") else None,
                "K": int(v.split(":")[-1]) if v != "dense" else None,
                "questions": len(rows),
                "context_tokens_median": statistics.median(ctx_tokens),
                "accuracy": round(s["accuracy"], 4),
                "contains": round(s["contains"], 4),
                "exact_match": round(s["exact_match"], 4),
                "f1": round(s["f1"], 4),
                "agreement": round(sum(same) / len(rows), 4),
                "first_token_agreement": round(sum(first) / len(rows), 4),
                "generated_tokens": generated,
                "decode_s": round(res.decode_seconds, 3),
                "tokens_per_s": round(generated / res.decode_seconds, 2) if res.decode_seconds else None,
            }
        )
    return out


def run_set(adapter, fmt, name: str, rows: list[dict], variants: list[str]) -> tuple[list[dict], dict]:
    from kvstore.store.kvstore import KVStore

    contexts = [fmt.context_part(r["context"]) for r in rows]
    questions = [fmt.question_part(r["question"]) for r in rows]
    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    ctx_tokens = [len(adapter.encode_context(c, special_tokens=fmt.add_special_tokens)) for c in contexts]
    with KVStore(str(path)) as store:
        built = adapter.generate_kv_cache(
            sorted(set(contexts)), store, prefix=fmt.head or None, special_tokens=fmt.add_special_tokens
        )
        print(f"  {name}: built {built.built} contexts, {built.tokens} tokens in {built.seconds:.1f} s", flush=True)
        with bl.timed() as t:
            results = adapter.sweep(
                contexts, questions, num_new_tokens=N_NEW, variants=variants, store=store, **kwargs(fmt)
            )
        sweep_s = t.seconds
        assert all(results["dense"].cache_hit), "the sweep should prefill nothing"
        computed = results["dense"].prefill_tokens_computed
    out = variant_rows(adapter, name, rows, results, ctx_tokens)
    info = {
        "set": name,
        "questions": len(rows),
        "contexts": built.built,
        "build_tokens": built.tokens,
        "build_s": round(built.seconds, 3),
        "sweep_s": round(sweep_s, 3),
        "sweep_prefill_tokens_computed": computed,
        "variants": len(variants),
        "load_during": bl.loadavg(),
    }
    print(f"  {name}: sweep of {len(variants)} variants in {sweep_s:.1f} s", flush=True)
    return out, info


def cost(adapter, fmt, rows: list[dict], repeats: int) -> dict:
    from kvstore.store.kvstore import KVStore

    contexts = [fmt.context_part(r["context"]) for r in rows]
    questions = [fmt.question_part(r["question"]) for r in rows]
    path = WORK / "cost"
    shutil.rmtree(path, ignore_errors=True)
    with KVStore(str(path)) as store:
        adapter.generate_kv_cache(sorted(set(contexts)), store, prefix=fmt.head or None,
                                  special_tokens=fmt.add_special_tokens)  # fmt: skip

        def sweep():
            adapter.sweep(
                contexts, questions, num_new_tokens=N_NEW, variants=list(COST_VARIANTS), store=store, **kwargs(fmt)
            )

        def separate():
            for v in COST_VARIANTS:
                adapter.greedy_sample(contexts, questions, N_NEW, decode_attention=v, store=store, **kwargs(fmt))

        sweeps, separates = [], []
        for _ in range(repeats):  # interleaved, so drifting load hits both alike
            sweeps += bl.repeat(sweep, 1, warmup=0)
            separates += bl.repeat(separate, 1, warmup=0)
    return {
        "questions": len(rows),
        "variants": list(COST_VARIANTS),
        "sweep_s": bl.summarize(sweeps),
        "separate_s": bl.summarize(separates),
        "load_during": bl.loadavg(),
    }


def main() -> None:
    ap = bl.parser(__doc__)
    ap.add_argument("--sets", default="demo,long")
    ap.add_argument("--limit", type=int, default=None, help="first N questions of each set (after --every)")
    ap.add_argument("--every", default="demo:3,long:4", help="SET:S keeps every S-th question of SET")
    ap.add_argument("--cost-rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stem", default="sparse")
    args = bl.start(ap, quick=dict(sets="demo", limit=16, every="", cost_rows=8, repeats=1))
    variants = ["dense", "topk:16", "sparq:8:16"] if args.quick else grid()
    from kvstore.data.prompts import PromptFormat

    sets = bl.question_sets()
    with bl.timed() as t:
        adapter = bl.load_adapter("float32")
    notes: dict = {"model_load_s": round(t.seconds, 3), "sets": [], "cost": None}
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    params = vars(args) | {"new_tokens": N_NEW, "stop_strings": STOPS}
    rows: list[dict] = []

    def save():
        bl.write_result(args.stem, params=params, rows=rows, notes=notes)

    for set_name in args.sets.split(","):
        stride = dict((k, int(v)) for k, v in (x.split(":") for x in args.every.split(",") if x)).get(set_name, 1)
        questions = sets[set_name][::stride]
        questions = questions[: args.limit] if args.limit else questions
        got, info = run_set(adapter, fmt, set_name, questions, variants)
        rows += got
        notes["sets"].append(info)
        save()
        for r in got:
            print(
                f"    {r['variant']:>12}  acc {r['accuracy']:.3f}  contains {r['contains']:.3f}  f1 {r['f1']:.3f}  "
                f"agree {r['agreement']:.3f}  {r['tokens_per_s']} tok/s",
                flush=True,
            )
        if set_name == "demo" and args.cost_rows:
            notes["cost"] = cost(adapter, fmt, sets["demo"][: args.cost_rows], args.repeats)
            save()
            print(f"  cost: {notes['cost']}", flush=True)
    save()


if __name__ == "__main__":
    main()
