"""Presses on long-context QA: accuracy against the compression ratio, every variant from one store.

The bundled SmolLM2-135M-Instruct (float32, CPU, sdpa) and the ``long`` question set
(``benchlib.question_sets()``: the demo articles four at a time, 5 contexts of ~1.3k tokens, 71
questions, each about one of the four articles asked of the joined context) in the chat template
(``PromptFormat.from_chat_template``, as ``bench_quant.py`` and ``bench_sparse.py`` ask it). The
contexts are built into a fresh store once; then every question is answered under every variant in
**one sweep** (:meth:`Adapter.sweep`: each batch loaded once, no context token prefilled): ``dense``,
each press (``knorm``, ``streaming_llm``, ``random``, ``keydiff``, ``snapkv``, ``tova``, ``kvzip`` and
``kvzip:layer``, ``expected_attention``, and the AdaKV and PyramidKV budgets ``snapkv:adakv``,
``expected_attention:adakv``, ``snapkv:pyramid``) at the ratios 0.25, 0.5 and 0.75, and the
question-aware ``snapkv:R:q`` and ``tova:R:q`` at the same ratios. Every press but the question-aware
ones compresses each context **without the question**, and every question about it is answered from the
same kept tokens (SCBench's multi-request protocol: a context compressed once serves many questions);
the ``:q`` rows are the question-aware upper reference. Greedy, 12 new tokens, stopping at EOS.

Per variant (one row each): ``accuracy`` (lenient), ``contains``, ``exact_match``, ``f1``
(:mod:`kvstore.data.metrics`), ``rows_identical`` (rows whose tokens equal dense's), ``tokens_agree``
(of dense's generated tokens, the fraction the variant generated at the same step),
``first_token_agree``, ``kept_frac`` (mean over rows of kept / context tokens), ``cache_bytes`` (keys
and values answered over, summed over rows) and ``cache_vs_dense``, ``decode_s`` (the variant's question
forwards and decode steps, every batch) and ``tokens_per_s`` (generated tokens / ``decode_s``),
``window_tokens``, ``replay_tokens`` and ``scoring_tokens`` (context tokens the observation windows,
KVzip's replays and all scoring forwards ran, shared by the whole sweep).
``notes.dense_vs_no_cache``: the dense row against a plain run (``use_cache=False``: each context and
question through the model together, no store), rows and tokens identical. The plot
(``press_accuracy.png``, in docs/img/ through the suite): accuracy as ``contains`` (SmolLM2 answers in
sentences, which lenient matching seldom credits) and agreement with dense against the ratio, one line
per press (ratio 0 is dense: a press at ratio 0 keeps every token and answers dense's tokens bit for
bit).

Command (from the repository root; the suite ``press``: ``python -m experiments run press [ARGS]``
writes ``press.json`` into experiments/results/ and the plot into docs/img/; run by hand it writes to
cache/bench/raw/)::

    .venv/bin/python experiments/bench_press.py
    .venv/bin/python experiments/bench_press.py --quick     # one context's first 6 questions, 3 variants
"""

from __future__ import annotations

import shutil
import statistics

import benchlib as bl

WORK = bl.SCRATCH / "press"
# a press as NAME[:FIELDS]: the ratio goes after the name (snapkv:adakv -> snapkv:0.5:adakv)
PRESSES = ("knorm", "streaming_llm", "random", "keydiff", "snapkv", "tova", "kvzip", "kvzip:layer",
           "expected_attention", "snapkv:adakv", "expected_attention:adakv", "snapkv:pyramid")  # fmt: skip
QUESTION_AWARE = ("snapkv", "tova")
RATIOS = (0.25, 0.5, 0.75)
N_NEW = 12


def grid(ratios, presses=PRESSES) -> list[str]:
    out = ["dense"] + [bl.press_spec(p, r) for p in presses for r in ratios]
    return out + [bl.press_spec(f"{p}:q", r) for p in QUESTION_AWARE for r in ratios]


def agreement(res, dense) -> dict:
    """Rows and tokens of ``res`` equal to ``dense``'s (each row up to its own stop)."""
    rows = len(dense.lengths)
    same = agree = total = first = 0
    for i in range(rows):
        a = dense.tokens[i, : dense.lengths[i]].tolist()
        b = res.tokens[i, : res.lengths[i]].tolist()
        same += a == b
        total += len(a)
        agree += sum(x == y for x, y in zip(a, b))
        first += a[:1] == b[:1]
    return {"rows_identical": same, "rows_identical_frac": same / rows, "tokens_agree": agree / total,
            "first_token_agree": first / rows}  # fmt: skip


def variant_rows(adapter, questions: list[dict], results: dict, ctx_tokens: list[int]) -> list[dict]:
    from kvstore.data.metrics import answer_metrics, clean_prediction
    from kvstore.model.variants.variant import parse_variant

    dense = results["dense"]
    out = []
    for name, res in results.items():
        press = parse_variant(name).press
        preds = [clean_prediction(adapter.decode(res.tokens[i][: res.lengths[i]])) for i in range(len(questions))]
        m = answer_metrics(preds, [q["answers"] for q in questions])
        generated = sum(res.lengths)
        out.append({
            "variant": name,
            "press": bl.press_label(name) if press else "dense",
            "ratio": press.ratio if press else 0.0,
            "question_aware": bool(press and press.question),
            "questions": len(questions),
            "accuracy": m["accuracy"], "contains": m["contains"], "exact_match": m["exact_match"], "f1": m["f1"],
            **agreement(res, dense),
            "kept_frac": statistics.mean(k / c for k, c in zip(res.kept_tokens, ctx_tokens)),
            "kept_tokens_median": statistics.median(res.kept_tokens),
            "cache_bytes": res.cache_bytes,
            "cache_vs_dense": res.cache_bytes / dense.cache_bytes,
            "generated_tokens": generated,
            "decode_s": res.decode_seconds,
            "tokens_per_s": generated / res.decode_seconds if res.decode_seconds else None,
            "window_tokens": res.window_tokens_computed,
            "scoring_tokens": res.scoring_tokens_computed,
            "replay_tokens": res.replay_tokens_computed,
            "prefill_tokens_computed": res.prefill_tokens_computed,
        })  # fmt: skip
    return out


def plot(rows: list[dict], path) -> None:
    dense = next(r for r in rows if r["variant"] == "dense")
    lines: dict[str, dict] = {"contains": {}, "rows_identical_frac": {}}
    for metric, by_label in lines.items():
        for r in rows:
            if r["variant"] == "dense":
                continue
            xs, ys = by_label.setdefault(r["press"], ([0.0], [dense[metric]]))  # ratio 0 keeps every token: dense
            xs.append(r["ratio"])
            ys.append(r[metric])
    n = dense["questions"]
    # contains, not lenient accuracy: the model answers in sentences, which lenient matching rarely credits
    bl.ratio_plot(path, [("accuracy: an accepted answer in the output", lines["contains"], dense["contains"]),
                         ("answers identical to dense (fraction of rows)", lines["rows_identical_frac"], None)],
                  f"Presses over stored caches: SmolLM2-135M-Instruct fp32, {n} questions on ~1.3k-token "
                  f"contexts, {N_NEW} greedy tokens")  # fmt: skip


def main() -> None:
    ap = bl.parser(__doc__, batch_size=8)
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--limit", type=int, default=None, help="the first N questions of the long set")
    args = bl.start(ap, quick=dict(limit=6))
    ratios = [float(r) for r in args.ratios.split(",")]
    variants = ["dense", "knorm:0.5", "snapkv:0.5:q"] if args.quick else grid(ratios)
    from kvstore.data.prompts import PromptFormat
    from kvstore.store.kvstore import KVStore

    questions = bl.question_sets()["long"][: args.limit]
    with bl.timed() as t:
        adapter = bl.load_adapter("float32")
    load_s = t.seconds
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    contexts = [q["context"] for q in questions]
    asked = [q["question"] for q in questions]
    ctx_tokens = [len(adapter.encode_context(fmt.context_part(c), special_tokens=fmt.add_special_tokens))
                  for c in contexts]  # fmt: skip
    shutil.rmtree(WORK, ignore_errors=True)
    with KVStore(str(WORK)) as store:
        built = adapter.build(sorted(set(contexts)), store, prompt=fmt)
        print(f"built {built.built} contexts, {built.tokens} tokens in {built.seconds:.1f} s", flush=True)
        load_before_sweep = bl.loadavg()
        with bl.timed() as t:
            results = adapter.sweep(contexts, asked, variants=variants, store=store, prompt=fmt, num_new_tokens=N_NEW,
                                    stop_at_eos=True, batch_size=args.batch_size)  # fmt: skip
        sweep_s = t.seconds
        codec = store.codec.spec
    assert all(all(r.cache_hit) and r.prefill_tokens_computed == 0 for r in results.values()), "prefilled a context"
    with bl.timed() as t:
        plain = adapter.sample(contexts, asked, prompt=fmt, use_cache=False, num_new_tokens=N_NEW, stop_at_eos=True,
                               batch_size=args.batch_size)  # fmt: skip
    dense_vs_plain = agreement(plain, results["dense"]) | {"no_cache_s": t.seconds}
    print(f"dense against a plain run: {dense_vs_plain}", flush=True)
    rows = variant_rows(adapter, questions, results, ctx_tokens)
    for r in rows:
        print(f"  {r['variant']:>20}  acc {r['accuracy']:.3f}  f1 {r['f1']:.3f}  same {r['rows_identical']:>2}/"
              f"{r['questions']}  kept {r['kept_frac']:.3f}  {r['tokens_per_s']:.1f} tok/s", flush=True)  # fmt: skip
    notes = {
        "model": "SmolLM2-135M-Instruct (bundled GGUF), float32, CPU, sdpa; chat template",
        "model_load_s": load_s,
        "contexts": built.distinct,
        "context_tokens": {"min": min(ctx_tokens), "median": statistics.median(ctx_tokens), "max": max(ctx_tokens)},
        "build": {"contexts": built.built, "tokens": built.tokens, "seconds": built.seconds},
        "sweep_s": sweep_s,
        "sweep_variants": len(variants),
        "load_before_sweep": load_before_sweep,
        "codec": codec,
        "dense_vs_no_cache": dense_vs_plain,
        "answers": {name: [adapter.decode(res.tokens[i][: res.lengths[i]]) for i in range(len(questions))]
                    for name, res in results.items()},
        "question_ids": [q["id"] for q in questions],
    }  # fmt: skip
    params = vars(args) | {"new_tokens": N_NEW, "stop_at_eos": True, "variants": variants, "set": "long"}
    bl.write_result("press", params=params, rows=rows, notes=notes)
    plot(rows, bl.RESULTS / "press_accuracy.png")


if __name__ == "__main__":
    main()
