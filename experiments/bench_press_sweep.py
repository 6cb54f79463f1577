"""The cost of an 8-variant press sweep over stored caches against the kvpress way (re-prefill per press).

The bundled SmolLM2-135M-Instruct (float32, CPU, sdpa), ``--contexts`` contexts of at least
``--min-tokens`` tokens (consecutive demo articles joined until that long, each context starting
``22 // contexts`` articles after the previous one) in the chat template, two questions each (the
first question about the context's first article and the first about its last), greedy, 12 new
tokens, stopping at EOS, under 8 variants: ``dense``, ``knorm:0.5``, ``knorm:0.75``, ``snapkv:0.5``,
``snapkv:0.75``, ``streaming_llm:0.5``, ``streaming_llm:0.75`` and ``tova:0.5``.

* **kvstore**: the contexts built into a store once (``build_s``, reported apart), then one
  :meth:`Adapter.sweep` of the 8 variants from the store (each batch loaded once, no context token
  prefilled; the observation windows of snapkv and tova re-run their tokens over the stored prefix).
* **the kvpress way**, written here with plain transformers: for each variant and each context, a
  dense prefill (the model's own forward into a ``DynamicCache``, batch 1, as kvpress's pipeline
  prefills), the press applied to that cache (the tokens chosen with kvstore's own scorers,
  ``kvstore.model.press.scorers.score`` / ``kept``, from the prefill's keys and, for snapkv and tova,
  the prefill's own queries of the observation window, captured by
  ``kvstore.model.press.window.capturing`` around it), the kept keys and values gathered per head into
  the cache, then each question at positions ``c + j`` and greedy decoding, the cache cut back to the
  kept tokens between questions (kvpress's pipeline does the same).

Checked: every variant's answers are token for token the same both ways (the run fails otherwise).
Timed, interleaved (a kvstore sweep, then the kvpress way, ``--repeats`` times, after one untimed
warm-up sweep): total seconds each way (min / median / max) and their ratio (goal: the sweep costs at
most 1/4 of the kvpress way; moonshot 1/6), and where the time went: the sweep's variants' question
forwards and decode steps (``sweep_decode_s``), the kvpress way's pressed prefills and its questions
answered one row at a time (``kvpress_way_prefill_s``, ``kvpress_way_answer_s``). Decode steps
(``step_s``): each variant of ``--step-variants`` swept alone ``--repeats`` times, the time of every
one-token forward (a greedy step of the whole batch) recorded by forward hooks on the model: min /
median / max per variant, and the median's ratio to dense's.

Command (from the repository root; the suite ``press_sweep``: ``python -m experiments run press_sweep
[ARGS]`` writes ``press_sweep.json`` into experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_press_sweep.py --wait 600
    .venv/bin/python experiments/bench_press_sweep.py --quick   # 2 short contexts, 3 variants, 1 repeat
"""

from __future__ import annotations

import shutil
import statistics

import torch

import benchlib as bl

WORK = bl.SCRATCH / "press_sweep"
VARIANTS = ("dense", "knorm:0.5", "knorm:0.75", "snapkv:0.5", "snapkv:0.75", "streaming_llm:0.5",
            "streaming_llm:0.75", "tova:0.5")  # fmt: skip
STEP_VARIANTS = ("dense", "knorm:0.5", "snapkv:0.5", "knorm:0.75")
N_NEW = 12


def long_rows(tokenizer, fmt, n_contexts: int, min_tokens: int) -> list[dict]:
    """Two questions on each of ``n_contexts`` contexts of at least ``min_tokens`` tokens (see the
    module docstring): rows ``{id, context, question, answers, context_tokens}``."""
    demo = bl.demo_rows()
    articles = list(dict.fromkeys(r["context"] for r in demo))
    out = []
    for g in range(n_contexts):
        start, group = g * (len(articles) // n_contexts), []
        while True:
            group.append(articles[(start + len(group)) % len(articles)])
            text = "\n\n".join(group)
            n = len(tokenizer(fmt.context_part(text), add_special_tokens=fmt.add_special_tokens)["input_ids"])
            if n >= min_tokens or len(group) == len(articles):
                break
        for article in (group[0], group[-1]):
            r = next(r for r in demo if r["context"] == article)
            out.append({"id": f"ctx{g}-{r['id']}", "context": text, "question": r["question"], "answers": r["answers"],
                        "context_tokens": n})  # fmt: skip
    return out


class StepTimer:
    """Forward hooks on the model timing every call that feeds one token per row (a greedy step)."""

    def __init__(self, model):
        self.times: list[float] = []
        self._step: bl.Timer | None = None
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._step = bl.timed() if ids is not None and ids.shape[1] == 1 else None

    def _post(self, module, args, kwargs, output):
        if self._step is not None:
            self.times.append(self._step.elapsed())
            self._step = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()


# -- the kvpress way, with plain transformers --------------------------------------------------------
@torch.inference_mode()
def pressed_prefill(model, ctx: list[int], press, cache_arg: str) -> tuple:
    """``(cache, c)``: the context prefilled densely into a ``DynamicCache`` (batch 1), then, under
    ``press`` (a :class:`Press` or None), only the kept tokens of every head gathered into it."""
    from transformers import DynamicCache

    from kvstore.model.press.scorers import Observation, kept, score
    from kvstore.model.press.window import capturing

    c = len(ctx)
    cache = DynamicCache()
    ids = torch.tensor([ctx])
    if press is not None and press.needs_queries:
        with capturing(model) as queries:  # the prefill's own queries (after the rotary embedding)
            model.model(input_ids=ids, use_cache=True, **{cache_arg: cache})
        w = min(press.window, c - 1)
        observations = [Observation(queries[i][0, :, c - w :]) for i in range(len(cache.layers))]
    else:
        model.model(input_ids=ids, use_cache=True, **{cache_arg: cache})
        observations = [None] * len(cache.layers)
    if press is None or press.n_kept(c) >= c:
        return cache, c
    n = press.n_kept(c)
    for layer, obs in zip(cache.layers, observations):
        keys, values = layer.keys[0], layer.values[0]  # [kv_heads, c, head_dim]
        idx = kept(score(press, keys, obs), n)  # [kv_heads, n], position order
        layer.keys = keys.gather(1, idx[..., None].expand(-1, -1, keys.shape[-1]))[None].contiguous()
        layer.values = values.gather(1, idx[..., None].expand(-1, -1, values.shape[-1]))[None].contiguous()
    return cache, c


@torch.inference_mode()
def answer(model, cache, c: int, question: list[int], n_new: int, eos: set[int], cache_arg: str) -> list[int]:
    """Greedy tokens after ``question`` fed at positions ``c + j`` over ``cache``, stopping at EOS
    (included); the cache is cut back to what it held before."""
    held = cache.layers[0].keys.shape[2]
    q = len(question)
    logits = model(input_ids=torch.tensor([question]), position_ids=torch.arange(c, c + q)[None],
                   use_cache=True, logits_to_keep=1, **{cache_arg: cache}).logits[0, -1]  # fmt: skip
    out: list[int] = []
    for t in range(n_new):
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt in eos or t == n_new - 1:
            break
        logits = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[c + q + t]]),
                       use_cache=True, logits_to_keep=1, **{cache_arg: cache}).logits[0, -1]  # fmt: skip
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :held], layer.values[:, :, :held]
    return out


def kvpress_way(adapter, contexts: list[list[int]], questions: list[list[list[int]]], variants) -> tuple[dict, dict]:
    """Every variant's answers the kvpress way: per variant, per context, one pressed prefill, then its
    questions. ``({variant: [tokens per row, rows in context order]}, {"prefill_s", "answer_s"})``:
    the seconds spent in the pressed prefills and in the questions' forwards and decode steps."""
    from kvstore.model.variants.variant import parse_variant

    # cache_arg: the name the model's forward takes its cache by (as kvstore passes it)
    model, eos, cache_arg = adapter.model, set(adapter.eos_ids), adapter.handle.layout.cache_arg
    out = {}
    spent = {"prefill_s": 0.0, "answer_s": 0.0}
    for name in variants:
        press = parse_variant(name).press
        got = []
        for ctx, qs in zip(contexts, questions):
            t = bl.timed()
            cache, c = pressed_prefill(model, ctx, press, cache_arg)
            spent["prefill_s"] += t.lap()
            got += [answer(model, cache, c, q, N_NEW, eos, cache_arg) for q in qs]
            spent["answer_s"] += t.lap()
        out[name] = got
    return out, spent


def main() -> None:
    ap = bl.parser(__doc__, batch_size=8)
    ap.add_argument("--contexts", type=int, default=4)
    ap.add_argument("--min-tokens", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--step-variants", default=",".join(STEP_VARIANTS))
    ap.add_argument("--repeats", type=int, default=3)
    quick = dict(contexts=2, min_tokens=400, repeats=1, variants="dense,knorm:0.5,snapkv:0.5",
                 step_variants="dense,knorm:0.5")  # fmt: skip
    args = bl.start(ap, quick=quick, wait=False)  # waits for a quiet machine once the model and rows are ready
    variants = args.variants.split(",")
    step_variants = args.step_variants.split(",")
    torch.set_grad_enabled(False)
    from kvstore.data.metrics import answer_metrics, clean_prediction
    from kvstore.data.prompts import PromptFormat
    from kvstore.store.kvstore import KVStore

    adapter = bl.load_adapter("float32")
    model = adapter.model
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    rows = long_rows(adapter.tokenizer, fmt, args.contexts, args.min_tokens)
    # token ids, the same both ways: the context part with the template's head, the question part
    ctx_of = {t: adapter.encode_context(fmt.context_part(t), special_tokens=fmt.add_special_tokens)
              for t in dict.fromkeys(r["context"] for r in rows)}  # fmt: skip
    contexts = [ctx_of[r["context"]] for r in rows]
    questions = [adapter.encode_question(fmt.question_part(r["question"])) for r in rows]
    distinct = list(ctx_of.values())
    per_context = [[q for q, r in zip(questions, rows) if r["context"] == t] for t in ctx_of]
    sweep_kw = dict(num_new_tokens=N_NEW, stop_at_eos=True, batch_size=args.batch_size)

    bl.wait_for_quiet(max_wait_s=args.wait)
    shutil.rmtree(WORK, ignore_errors=True)
    with KVStore(str(WORK)) as store:
        with bl.timed() as t:
            built = adapter.build(distinct, store)
        build_s = t.seconds
        print(f"built {built.built} contexts, {built.tokens} tokens in {build_s:.1f} s", flush=True)

        def sweep():
            return adapter.sweep(contexts, questions, variants=variants, store=store, **sweep_kw)

        results = sweep()  # warm-up, and the answers checked below
        assert all(r.prefill_tokens_computed == 0 for r in results.values())
        mine = [[results[v].tokens[i, : results[v].lengths[i]].tolist() for i in range(len(rows))] for v in variants]
        sweep_s: list[float] = []
        kvpress_s: list[float] = []
        theirs: dict = {}
        order = [i for t in ctx_of for i, r in enumerate(rows) if r["context"] == t]  # rows in context order
        sweep_decode_s: list[float] = []
        kvpress_parts: list[dict] = []
        for rep in range(args.repeats):
            with bl.timed() as t:
                timed = sweep()
            sweep_s.append(t.seconds)
            sweep_decode_s.append(sum(r.decode_seconds for r in timed.values()))
            with bl.timed() as t:
                got, parts = kvpress_way(adapter, distinct, per_context, variants)
            kvpress_s.append(t.seconds)
            kvpress_parts.append(parts)
            theirs = theirs or {v: {i: got[v][k] for k, i in enumerate(order)} for v in variants}
            print(f"  repeat {rep + 1}: sweep {sweep_s[-1]:.1f} s, the kvpress way {kvpress_s[-1]:.1f} s "
                  f"(load {bl.loadavg()[0]})", flush=True)  # fmt: skip

        steps: dict[str, list[float]] = {v: [] for v in step_variants}
        decode: dict[str, list[float]] = {v: [] for v in step_variants}
        for _ in range(args.repeats):  # interleaved, so drifting load hits every variant alike
            for v in step_variants:
                timer = StepTimer(model)
                try:
                    res = adapter.sweep(contexts, questions, variants=[v], store=store, **sweep_kw)[v]
                finally:
                    timer.close()
                steps[v] += timer.times
                decode[v].append(res.decode_seconds)
    load_after_timing = bl.loadavg()

    per_variant = []
    dense_step = statistics.median(steps["dense"]) if "dense" in steps else None
    for k, v in enumerate(variants):
        same = [mine[k][i] == theirs[v][i] for i in range(len(rows))]
        preds = [clean_prediction(adapter.decode(t)) for t in mine[k]]
        m = answer_metrics(preds, [r["answers"] for r in rows])
        row = {"variant": v, "rows": len(rows), "rows_identical_to_kvpress_way": sum(same),
               "identical": all(same), "contains": m["contains"], "f1": m["f1"],
               "kept_tokens": results[v].kept_tokens, "generated_tokens": sum(results[v].lengths),
               "decode_s_in_sweep": results[v].decode_seconds}  # fmt: skip
        if v in steps:
            s = bl.summarize(steps[v])
            row |= {"step_s": s, "step_vs_dense": s["median"] / dense_step if dense_step else None,
                    "decode_s_alone": bl.summarize(decode[v])}  # fmt: skip
        per_variant.append(row)
        print(f"  {v:>20}: identical {sum(same)}/{len(rows)}" + (f", step {row['step_s']['median'] * 1e3:.1f} ms "
              f"({row['step_vs_dense']:.2f}x dense)" if v in steps else ""), flush=True)  # fmt: skip
    sw, kp = bl.summarize(sweep_s), bl.summarize(kvpress_s)
    notes = {
        "model": "SmolLM2-135M-Instruct (bundled GGUF), float32, CPU, sdpa; chat template",
        "contexts": len(distinct),
        "context_tokens": [len(c) for c in distinct],
        "questions": len(rows),
        "question_ids": [r["id"] for r in rows],
        "build_s": build_s,
        "build_tokens": built.tokens,
        "sweep_s": sw,
        "kvpress_way_s": kp,
        "ratio_median": sw["median"] / kp["median"],
        "ratio_with_build": (sw["median"] + build_s) / kp["median"],
        "goal_quarter_met": sw["median"] / kp["median"] <= 1 / 4,
        "moonshot_sixth_met": sw["median"] / kp["median"] <= 1 / 6,
        "sweep_runs_s": sweep_s,
        "kvpress_way_runs_s": kvpress_s,
        # where the time went: the variants' question forwards and decode steps (batched) in the sweep;
        # the pressed prefills and the questions (one row at a time) the kvpress way
        "sweep_decode_s": bl.summarize(sweep_decode_s),
        "kvpress_way_prefill_s": bl.summarize([p["prefill_s"] for p in kvpress_parts]),
        "kvpress_way_answer_s": bl.summarize([p["answer_s"] for p in kvpress_parts]),
        "window_tokens_computed": results[variants[0]].window_tokens_computed,
        "all_identical": all(r["identical"] for r in per_variant),
        "step_batch_rows": len(rows),
        "load_after_timing": load_after_timing,
        "answers": {v: [adapter.decode(t) for t in mine[k]] for k, v in enumerate(variants)},
    }
    print(f"sweep {sw['median']:.1f} s, the kvpress way {kp['median']:.1f} s: ratio {notes['ratio_median']:.3f}",
          flush=True)  # fmt: skip
    params = vars(args) | {"new_tokens": N_NEW, "stop_at_eos": True}
    bl.write_result("press_sweep", params=params, rows=per_variant, notes=notes)
    assert notes["all_identical"], "the two ways answered differently: see rows_identical_to_kvpress_way"


if __name__ == "__main__":
    main()
