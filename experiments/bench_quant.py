"""Quality gate of the lossy codecs: size, agreement with the lossless cache, load time and TTFT.

For each model dtype (float32, bfloat16) of the bundled SmolLM2-135M-Instruct and each question set:

* ``demo``: ``experiments/data/demo.jsonl`` (22 contexts of ~330 tokens, 78 questions);
* ``long``: the demo articles four at a time (5 contexts of ~1.3k tokens; every question about one of
  the four articles asks it of the joined context: ~60 questions);

both in the chat template (the default for this model), the lossless store is built once (the
store default when it runs: ``zstd-shuffle:1`` before ``zstd-split:1:16``, named in its row), then
converted to each lossy codec without recomputing
(``kvstore.store.convert``, which writes exactly what ``build --codec`` writes). Every row is
answered with 12 greedy tokens (no stop at EOS) from the lossless cache (the reference), from each
lossy cache, and without any cache (``no-cache``: the model's own rounding noise against the
lossless cache, the floor agreement is judged against). Reported per codec:

* ``size``: stored bytes of the converted chunks / the raw keys and values (and token ids) in the
  model's dtype; ``size_vs_f32``: the same against float32 raw;
* ``rows_identical``: rows whose 12 tokens equal the lossless answer's;
* ``tokens_before_divergence``: mean tokens until the first that differs (12 when none does);
* ``max_dlogit``: max |logit difference| at the first answer step, over rows and vocabulary;
* ``contains``: rows whose answer contains an accepted answer (the task metric, for context);
* ``load_ms``: one ~1.3k-token context's chain copied into a batch's buffers (``stages.load.load_prefix``),
  median of ``--repeats`` (min..max in the JSON); ``ttft_ms``: ``greedy_sample`` of one row, one new
  token, from the warm store (same).

Command (from the repository root; the suite ``quant``: ``python -m experiments run quant [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_quant.py
    .venv/bin/python experiments/bench_quant.py --quick        # float32, the demo set's first 16 rows
    .venv/bin/python experiments/bench_quant.py --dtypes bfloat16 --stem quant_bf16   # one dtype per file
    # the pre-RoPE codecs (docs/lossy-codecs.md; the suite quant_prerope), floor rows in quant.json / quant_bf16.json:
    .venv/bin/python experiments/bench_quant.py --dtypes float32 --codecs int8r,int4r --no-floor --stem quant_prerope
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import torch

import benchlib as bl

WORK = bl.SCRATCH / "quant"
CODECS = ("int8", "int8:64", "int4", "int4:64", "fp8", "int8+zstd:1")
N_NEW = 12


def agreement(ref, got) -> dict:
    same, before, dlogit = 0, [], 0.0
    for i in range(ref.tokens.shape[0]):
        a, b = ref.tokens[i].tolist(), got.tokens[i].tolist()
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        before.append(k)
        same += k == len(a)
        dlogit = max(dlogit, float((ref.scores[i][0].float() - got.scores[i][0].float()).abs().max()))
    return {
        "rows_identical": same,
        "rows": len(before),
        "rows_identical_frac": same / len(before),
        "tokens_before_divergence": statistics.mean(before),
        "tokens_frac": statistics.mean(before) / N_NEW,
        "max_dlogit": dlogit,
    }


def contains(adapter, result, rows) -> int:
    from kvstore.data.metrics import clean_prediction, contains_match

    return sum(
        bool(r["answers"]) and contains_match(clean_prediction(adapter.decode(result.tokens[i])), r["answers"])
        for i, r in enumerate(rows)
    )


def timings(adapter, store, plan, context, question, repeats: int, fmt) -> dict:
    from kvstore.model.compute.cache import new_buffers
    from kvstore.model.stages.load import load_prefix

    bufs = new_buffers(adapter.kv_shapes(), 1, plan.n_tokens + 64, adapter.dtype, adapter.device)
    loaded = load_prefix(adapter.handle, store, plan, bufs, 0, 0)
    assert loaded == plan.n_tokens, (loaded, plan.n_tokens)
    load = bl.repeat(lambda: load_prefix(adapter.handle, store, plan, bufs, 0, 0), repeats, warmup=1)
    ttft = bl.repeat(
        lambda: adapter.greedy_sample(
            [context], [question], 1, store=store, stop_at_eos=False, prefix=fmt.head,
            special_tokens=fmt.add_special_tokens,
        ),
        repeats,
        warmup=1,
    )  # fmt: skip
    return {"load": bl.summarize(load), "ttft": bl.summarize(ttft), "load_runs": load, "ttft_runs": ttft}


def run_set(adapter, fmt, name: str, rows: list[dict], dtype: str, args) -> list[dict]:
    from kvstore.store.convert import convert_contexts
    from kvstore.store.kvstore import KVStore

    contexts = [fmt.context_part(r["context"]) for r in rows]
    questions = [fmt.question_part(r["question"]) for r in rows]
    kw = dict(stop_at_eos=False, return_details=True, return_scores=True, batch_size=8, prefix=fmt.head,
              special_tokens=fmt.add_special_tokens)  # fmt: skip
    path = WORK / f"{dtype}-{name}"
    shutil.rmtree(path, ignore_errors=True)
    out = []
    longest = max(range(len(rows)), key=lambda i: len(contexts[i]))
    with KVStore(str(path)) as store:
        built = adapter.generate_kv_cache(
            sorted(set(contexts)), store, prefix=fmt.head, special_tokens=fmt.add_special_tokens
        )
        print(
            f"  {dtype}/{name}: built {built.built} contexts, {built.tokens} tokens in {built.seconds:.1f} s",
            flush=True,
        )
        ref = adapter.greedy_sample(contexts, questions, N_NEW, store=store, **kw)
        assert all(ref.cache_hit)
        nocache = adapter.greedy_sample(contexts, questions, N_NEW, use_cache=False, **kw) if args.floor else None
        plan = adapter.chain(adapter.encode_context(contexts[longest], special_tokens=fmt.add_special_tokens), store,
                            prefix=fmt.head, special_tokens=fmt.add_special_tokens)  # fmt: skip
        base = {"dtype": dtype, "set": name, "contexts": built.distinct, "context_tokens": built.tokens}
        lossless = {
            **base, "codec": f"{store.codec.spec} (lossless)", "size": built.ratio,
            "size_vs_f32": built.ratio / 2 if dtype == "bfloat16" else built.ratio,
            **agreement(ref, ref), "contains": contains(adapter, ref, rows),
        }  # fmt: skip
        floor = {**base, "codec": "no-cache (model's own rounding)", **agreement(ref, nocache),
                 "contains": contains(adapter, nocache, rows)} if nocache is not None else None  # fmt: skip
        if name == "long" or args.quick:
            t = timings(adapter, store, plan, contexts[longest], questions[longest], args.repeats, fmt)
            lossless |= {"load_ms": t["load"]["median"] * 1e3, "ttft_ms": t["ttft"]["median"] * 1e3, "timing": t}
        out += [floor, lossless] if floor is not None else [None, lossless]
        for codec in args.codecs:  # each into a store of its own (int8 and int8+zstd share their keys)
            dst_path = WORK / f"{dtype}-{name}-{codec.replace(':', '-').replace('/', '-').replace('+', '-')}"
            shutil.rmtree(dst_path, ignore_errors=True)
            with KVStore(str(dst_path)) as dst:
                report = convert_contexts(store, dst, codec, keys=sorted(set(built.keys)), rotary=adapter.rotary)
            assert report.converted == built.distinct and not report.problems, report
            out.append({**base, "codec": codec, "size": report.ratio, "path": str(dst_path)})
    for row in out[2:]:  # out[0] is the floor (None without --floor), out[1] the lossless reference
        with KVStore(row.pop("path"), codec=row["codec"], readonly=True) as store:
            got = adapter.greedy_sample(contexts, questions, N_NEW, store=store, **kw)
            assert all(got.cache_hit), row["codec"]
            row |= agreement(ref, got) | {"contains": contains(adapter, got, rows), "codec": store.codec.spec}
            row["size_vs_f32"] = row["size"] / 2 if dtype == "bfloat16" else row["size"]
            if name == "long" or args.quick:
                plan = adapter.chain(adapter.encode_context(contexts[longest], special_tokens=fmt.add_special_tokens),
                                    store, prefix=fmt.head, special_tokens=fmt.add_special_tokens)  # fmt: skip
                t = timings(adapter, store, plan, contexts[longest], questions[longest], args.repeats, fmt)
                row |= {"load_ms": t["load"]["median"] * 1e3, "ttft_ms": t["ttft"]["median"] * 1e3, "timing": t}
        print(f"  {dtype}/{name} {row['codec']}: size {row['size']:.3f}, rows {row['rows_identical']}/{row['rows']}, "
              f"tokens {row['tokens_before_divergence']:.2f}, dlogit {row['max_dlogit']:.3f}", flush=True)  # fmt: skip
    return [row for row in out if row is not None]


def main() -> None:
    global WORK
    ap = bl.parser(__doc__)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sets", default="demo,long")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--no-floor", dest="floor", action="store_false",
        help="skip the no-cache rows (the floor; it does not depend on the codecs: quant.json has it)",
    )  # fmt: skip
    ap.add_argument("--stem", default="quant", help="results file stem: STEM.json")
    ap.add_argument("--work", default=str(WORK), help="scratch directory of the stores (one per concurrent run)")
    args = bl.start(ap, quick=dict(dtypes="float32", sets="demo", repeats=2, codecs="int8,int4"), wait=False)
    WORK = Path(args.work)
    args.codecs = args.codecs.split(",")
    from kvstore.data.prompts import PromptFormat

    sets = bl.question_sets()
    if args.quick:
        sets["demo"] = sets["demo"][:16]
    bl.wait_for_quiet(max_wait_s=args.wait)
    rows: list[dict] = []
    for dtype in args.dtypes.split(","):
        adapter = bl.load_adapter(dtype)
        fmt = PromptFormat.from_chat_template(adapter.tokenizer)
        for name in args.sets.split(","):
            rows += run_set(adapter, fmt, name, sets[name], dtype, args)
        del adapter
    bl.write_result(args.stem, params=vars(args) | {"new_tokens": N_NEW}, rows=rows)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
