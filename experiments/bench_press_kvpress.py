"""kvstore's presses against NVIDIA kvpress 0.5.5 on the same token ids: kept tokens and answers.

kvpress pins ``transformers<5.3``, so it runs in its own virtual environment (``--kvpress-python``,
default /work/kvpress-venv/bin/python; see ``experiments/kvpress_reference.py`` for how it is built):
without that interpreter this script prints why and exits without a result (this suite never runs in
CI). Steps:

1. **kvpress**: ``experiments/kvpress_reference.py --rows`` with that interpreter on the long set's
   rows (``benchlib.question_sets()["long"]``, the first ``--per-context`` questions of each of its 5
   contexts of ~1.3k tokens), tokenized the kvpress pipeline's way (``preprocess``: the chat template
   around the context, the question followed by the template's suffix; the question is given as
   ``"\\nQuestion: Q\\nAnswer:"``, the text kvstore's benchmarks ask, so the ids are kvstore's own
   prompt format's: checked, ``ids_equal_kvstore_prompt``), for knorm, streaming_llm, snapkv, keydiff,
   tova and random (seed 0) at the ratios 0.25, 0.5 and 0.75, 12 new tokens, stopping at EOS. It
   reports, per row and press, the positions every (layer, KV head) kept (captured from the scores
   kvpress itself ranked, and verified against its cache), the layers and heads whose cut fell on a
   tie (``boundary_ties``) and its answer ids.
2. **kept tokens**: kvstore's press on the same context ids: a dense in-memory prefill
   (``kvstore.model.stages.answer.prefill_contexts``, under kvstore's grouped-KV attention, as its
   sweeps run), each press's scores (``kvstore.model.press.prune.row_scores``: the observation window
   re-run for snapkv and tova) and kept positions (``kvstore.model.press.scorers.kept``). Per press and
   ratio over every (context, layer, KV head) set: ``sets_identical``, ``jaccard_mean`` / ``_min``,
   and the differing sets explained by ties (``differ_at_ties``: every position in the symmetric
   difference scores exactly kvstore's boundary score, so the order of equal scores decided it) or by
   near-ties (``differ_near_ties``: within ``--near`` of the boundary, relative; rounding of keys
   computed by another transformers version), with the largest relative gap seen.
3. **answers**: the contexts built into a store, then one :meth:`Adapter.sweep` of ``dense`` and
   every press/ratio over the same context and question ids: rows whose tokens equal kvpress's
   (``answers_identical``), and the fraction of kvpress's answer tokens matched step by step. Every
   row whose answer differs is replayed with plain transformers (a dense prefill, each head's kept
   positions gathered, the question at ``c + j``, greedy) once with kvpress's kept sets and once with
   kvstore's (``notes.differing_answers_replayed``): which choice of tokens gives which answer.

**RULER** (``--set ruler``, written as ``press_kvpress_ruler``): the rows are instead the first
``--ruler-samples`` requests of lm-eval's ``niah_single_1`` at 4096 tokens (the samples
``bench_press_ruler.py`` scores, generated the same way), as kvstore's lm-eval backend splits them
(captured from ``KVStoreLM``: the prompt but its last token is the context, the last token the
question), fed to kvpress as ids (``kvpress_reference.py --ids``), 32 new tokens (the niah tasks'
``max_gen_toks`` in that suite): whether kvpress's presses fail the needle where kvstore's do.

Command (from the repository root; the suite ``press_kvpress``: ``python -m experiments run
press_kvpress [ARGS]`` writes ``press_kvpress.json`` into experiments/results/; run by hand it writes to
cache/bench/raw/)::

    .venv/bin/python experiments/bench_press_kvpress.py
    .venv/bin/python experiments/bench_press_kvpress.py --reference cache/bench/press_kvpress/kvpress.json  # reuse
    .venv/bin/python experiments/bench_press_kvpress.py --quick   # 1 row, knorm and snapkv at 0.5
    .venv/bin/python experiments/bench_press_kvpress.py --set ruler
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

WORK = bl.SCRATCH / "press_kvpress"
KVPRESS_PYTHON = "/work/kvpress-venv/bin/python"
PRESSES = ("knorm", "streaming_llm", "snapkv", "keydiff", "tova", "random")
RATIOS = (0.25, 0.5, 0.75)
N_NEW = 12
RULER_NEW = 32


def ruler_ids(model_dir: str, n: int, path: Path) -> list[str]:
    """Write the first ``n`` niah_single_1 requests at 4096 tokens, as kvstore's lm-eval backend
    splits them, to ``path`` (``kvpress_reference.py --ids`` lines); returns their ids."""
    import bench_press_ruler as ruler  # points NLTK_DATA at its scratch folder
    import lm_eval

    from kvstore.lm_eval import KVStoreLM

    (ruler.NLTK_DATA / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
    tasks = ruler.load_tasks(["niah_single_1"], model_dir, RULER_NEW)
    lm = KVStoreLM(pretrained=model_dir, dtype="float32", use_cache=False)  # no store: nothing is answered
    prompts: list[list[int]] = []

    def capture(batch: list[list[int]], until: list[str], new_tokens: int) -> list[str]:
        prompts.extend(batch)
        return [""] * len(batch)

    lm._generate = capture  # the prompts the backend would answer (it splits each as below)
    try:
        lm_eval.simple_evaluate(model=lm, tasks=list(tasks.values()), limit=n, verbosity="WARNING")
    finally:
        lm.close()
    ids = [f"niah_single_1-{i}" for i in range(len(prompts))]
    with path.open("w") as f:
        for name, p in zip(ids, prompts):
            f.write(json.dumps({"id": name, "context_ids": p[:-1], "question_ids": p[-1:]}) + "\n")
    return ids


def rows_file(questions: list[dict], path: Path) -> None:
    with path.open("w") as f:
        for q in questions:
            f.write(json.dumps({"id": q["id"], "context": q["context"],
                                "question": f"\nQuestion: {q['question']}\nAnswer:"}) + "\n")  # fmt: skip


def run_kvpress(args, rows_path: Path, out: Path, model_dir: str, new_tokens: int) -> float:
    given = "--ids" if args.set == "ruler" else "--rows"
    cmd = [args.kvpress_python, str(bl.HERE / "kvpress_reference.py"), "--model", model_dir, given, str(rows_path),
           "--presses", args.presses, "--ratios", args.ratios, "--new-tokens", str(new_tokens), "--out", str(out),
           "--threads", str(args.threads)]  # fmt: skip
    print("running", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return time.perf_counter() - t0


def kvstore_kept(adapter, ctx_ids: list[int], specs: list[str]) -> dict:
    """Per spec: ``(kept [layer][head] sets, scores [layer] [kv_heads, c], n_kept)`` of kvstore's press
    over the dense in-memory prefill of ``ctx_ids``."""
    from kvstore.model.compute.attention import grouped_kv
    from kvstore.model.press.prune import PressMemo, row_scores
    from kvstore.model.press.scorers import kept
    from kvstore.model.press.spec import parse_press
    from kvstore.model.stages.answer import prefill_contexts

    with grouped_kv():
        cache = prefill_contexts(adapter.handle, [ctx_ids], 0, False)
        memo = PressMemo()
        out = {}
        for spec in specs:
            press = parse_press(spec)
            scores = row_scores(adapter.handle, cache, press, 0, memo, None)
            n = press.kept(len(ctx_ids))
            sets = [[set(h) for h in kept(s, n).tolist()] for s in scores]
            out[spec] = (sets, [s.float() for s in scores], n)
    return out


def boundary_gap(a: set, b: set, scores, n: int) -> float:
    """How far from kvstore's cut the positions that differ between kvstore's set ``a`` and kvpress's
    ``b`` of one head score, under kvstore's ``scores`` ``[c]``: the largest |score - the n-th best
    score|, relative to the spread of the head's scores (0: every one of them ties with the cut, so
    only the order of equal scores decided it)."""
    import torch

    boundary = torch.sort(scores, descending=True).values[n - 1]
    gap = float((scores[torch.tensor(sorted(a ^ b))] - boundary).abs().max())
    return gap / (float(scores.max() - scores.min()) or 1.0)


def compare_kept(reference: dict, mine: dict, near: float) -> list[dict]:
    """One row per press and ratio: the kept sets of every distinct context compared."""
    from kvstore.model.press.spec import parse_press

    by_spec: dict[str, dict] = {}
    seen: set = set()
    for row in reference["rows"]:
        key = tuple(row["context_ids"])
        if key in seen:  # kept sets depend on the context alone (no press here reads the question)
            continue
        seen.add(key)
        for run in row["runs"]:
            spec = parse_press(f"{run['press']}:{run['ratio']}").name
            sets, scores, n = mine[key][spec]
            assert n == run["n_kept"], (spec, n, run["n_kept"])
            acc = by_spec.setdefault(spec, {"sets": 0, "identical": 0, "jaccard": [], "tie": 0, "near": 0, "far": 0,
                                            "max_gap": 0.0, "kvpress_boundary_ties": 0, "verified": True})  # fmt: skip
            acc["kvpress_boundary_ties"] += len(run["boundary_ties"])
            acc["verified"] &= all(run["verified"].values())
            for layer, heads in enumerate(run["kept"]):
                for h, theirs in enumerate(heads):
                    a, b = sets[layer][h], set(theirs)
                    acc["sets"] += 1
                    acc["jaccard"].append(len(a & b) / len(a | b))
                    if a == b:
                        acc["identical"] += 1
                        continue
                    gap = boundary_gap(a, b, scores[layer][h], n)
                    acc["tie" if gap == 0 else "near" if gap <= near else "far"] += 1
                    acc["max_gap"] = max(acc["max_gap"], gap)
    out = []
    for spec, acc in by_spec.items():
        press = parse_press(spec)
        out.append({
            "press": press.method, "ratio": press.ratio, "contexts": len(seen), "sets": acc["sets"],
            "sets_identical": acc["identical"], "sets_identical_frac": acc["identical"] / acc["sets"],
            "jaccard_mean": statistics.mean(acc["jaccard"]), "jaccard_min": min(acc["jaccard"]),
            "differ_at_ties": acc["tie"], "differ_near_ties": acc["near"], "differ_otherwise": acc["far"],
            "max_relative_gap": acc["max_gap"], "kvpress_boundary_ties": acc["kvpress_boundary_ties"],
            "kvpress_verified": acc["verified"],
        })  # fmt: skip
    return out


def compare_answers(reference: dict, results: dict) -> dict[str, dict]:
    """Per variant (``dense`` and every press:ratio): kvstore's answers against kvpress's."""
    from kvstore.model.press.spec import parse_press

    out: dict[str, dict] = {}
    for i, row in enumerate(reference["rows"]):
        runs = [("dense", row["dense"])] + [(parse_press(f"{r['press']}:{r['ratio']}").name, r) for r in row["runs"]]
        for spec, run in runs:
            res = results[spec]
            mine = res.tokens[i, : res.lengths[i]].tolist()
            theirs = run["answer_ids"]
            acc = out.setdefault(spec, {"rows": 0, "answers_identical": 0, "tokens": 0, "tokens_agree": 0,
                                        "kvpress_matches_its_dense": 0, "differing_rows": []})  # fmt: skip
            acc["rows"] += 1
            acc["answers_identical"] += mine == theirs
            acc["tokens"] += len(theirs)
            acc["tokens_agree"] += sum(x == y for x, y in zip(mine, theirs))
            acc["kvpress_matches_its_dense"] += run.get("matches_dense", True)
            if mine != theirs:
                acc["differing_rows"].append(row["id"])
    return out


def replay(adapter, ctx: list[int], question: list[int], kept_sets: list[list[list[int]]], new_tokens: int) -> list:
    """The answer over ``ctx``'s dense prefill (the model's own forward into a ``DynamicCache``) with
    every (layer, head) keeping the positions ``kept_sets[layer][head]`` (position order), then the
    question at ``c + j`` and greedy decoding (``bench_press_sweep.answer``): whose choice of kept
    tokens gives which answer, with nothing else of either implementation involved."""
    import torch
    from bench_press_sweep import answer
    from transformers import DynamicCache

    cache_arg = adapter.handle.layout.cache_arg
    cache = DynamicCache()
    with torch.inference_mode():
        adapter.model.model(input_ids=torch.tensor([ctx]), use_cache=True, **{cache_arg: cache})
    for layer, heads in zip(cache.layers, kept_sets):
        idx = torch.tensor([sorted(h) for h in heads])  # [kv_heads, n]
        keys, values = layer.keys[0], layer.values[0]
        layer.keys = keys.gather(1, idx[..., None].expand(-1, -1, keys.shape[-1]))[None].contiguous()
        layer.values = values.gather(1, idx[..., None].expand(-1, -1, values.shape[-1]))[None].contiguous()
    return answer(adapter.model, cache, len(ctx), question, new_tokens, set(adapter.eos_ids), cache_arg)


def replay_differences(adapter, reference: dict, results: dict, mine: dict, new_tokens: int) -> list[dict]:
    """For every row whose answer differs from kvpress's: the answers :func:`replay` gives with
    kvpress's kept sets and with kvstore's, and which answer each equals."""
    from kvstore.model.press.spec import parse_press

    out = []
    for i, row in enumerate(reference["rows"]):
        for run in row["runs"]:
            spec = parse_press(f"{run['press']}:{run['ratio']}").name
            res = results[spec]
            kvstore_answer = res.tokens[i, : res.lengths[i]].tolist()
            if kvstore_answer == run["answer_ids"]:
                continue
            sets = mine[tuple(row["context_ids"])][spec][0]
            ctx, question = row["context_ids"], row["question_ids"]
            with_theirs = replay(adapter, ctx, question, run["kept"], new_tokens)
            with_mine = replay(adapter, ctx, question, [[sorted(h) for h in layer] for layer in sets], new_tokens)
            differ = [[layer, h] for layer, heads in enumerate(run["kept"]) for h, theirs in enumerate(heads)
                      if set(theirs) != sets[layer][h]]  # fmt: skip
            out.append({"id": row["id"], "variant": spec, "sets_differing": differ,
                        "kvpress_answer": run["answer_text"], "kvstore_answer": adapter.decode(kvstore_answer),
                        "replay_with_kvpress_sets_equals_kvpress": with_theirs == run["answer_ids"],
                        "replay_with_kvstore_sets_equals_kvstore": with_mine == kvstore_answer})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvpress-python", default=KVPRESS_PYTHON)
    ap.add_argument("--per-context", type=int, default=2, help="questions per long-set context")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--near", type=float, default=1e-4, help="a relative score gap below this is a near-tie")
    ap.add_argument("--reference", help="an earlier kvpress_reference.py output on the same rows (not run again)")
    ap.add_argument("--set", choices=("long", "ruler"), default="long", help="the long QA set or RULER's niah_single_1")
    ap.add_argument("--ruler-samples", type=int, default=4, help="niah_single_1 requests (--set ruler)")
    ap.add_argument("--stem", default=None, help="the result's name (default: press_kvpress[_ruler])")
    ap.add_argument("--threads", type=int, default=bl.THREADS)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.per_context, args.ruler_samples, args.presses, args.ratios = 1, 1, "knorm,snapkv", "0.5"
    new_tokens = RULER_NEW if args.set == "ruler" else N_NEW
    args.stem = args.stem or ("press_kvpress_ruler" if args.set == "ruler" else "press_kvpress")
    if not args.reference and not Path(args.kvpress_python).exists():
        print(
            f"skipped: no kvpress interpreter at {args.kvpress_python} (build the side venv as "
            "experiments/kvpress_reference.py says, or pass --kvpress-python); nothing written",
            flush=True,
        )
        sys.exit(0)
    bl.setup(args.threads)
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.load.gguf import convert_gguf
    from kvstore.model.load.loading import bundled_gguf_path
    from kvstore.model.press.spec import parse_press
    from kvstore.store.kvstore import KVStore

    WORK.mkdir(parents=True, exist_ok=True)
    model_dir = str(convert_gguf(bundled_gguf_path()))
    tag = ("_ruler" if args.set == "ruler" else "") + ("_quick" if args.quick else "")
    rows_path = WORK / f"rows{tag}.jsonl"
    if args.set == "ruler":
        questions = [{"id": i} for i in ruler_ids(model_dir, args.ruler_samples, rows_path)]
    else:
        long = bl.question_sets()["long"]
        questions = [q for c in dict.fromkeys(q["context"] for q in long)
                     for q in [q for q in long if q["context"] == c][: args.per_context]]  # fmt: skip
        questions = questions[:1] if args.quick else questions
        rows_file(questions, rows_path)
    ref_path = Path(args.reference) if args.reference else WORK / f"kvpress{tag}.json"
    kvpress_s = None if args.reference else run_kvpress(args, rows_path, ref_path, model_dir, new_tokens)
    reference = json.loads(ref_path.read_text())
    assert [r["id"] for r in reference["rows"]] == [q["id"] for q in questions], "the reference is of other rows"

    adapter = bl.load_adapter("float32")
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    same_ids = args.set == "ruler" or all(  # RULER's ids are the backend's own, captured
        r["context_ids"] == adapter.encode_context(fmt.context_part(q["context"]), special_tokens=False)
        and r["question_ids"] == adapter.encode_question(fmt.question_part(q["question"]))
        for r, q in zip(reference["rows"], questions)
    )  # the chat format: its text holds the special tokens
    specs = [parse_press(f"{p}:{r}").name for p in args.presses.split(",") for r in args.ratios.split(",")]
    contexts = [r["context_ids"] for r in reference["rows"]]
    asked = [r["question_ids"] for r in reference["rows"]]
    distinct = list(dict.fromkeys(map(tuple, contexts)))
    t0 = time.perf_counter()
    mine = {key: kvstore_kept(adapter, list(key), specs) for key in distinct}
    kept_s = time.perf_counter() - t0
    kept_rows = compare_kept(reference, mine, args.near)

    shutil.rmtree(WORK / "store", ignore_errors=True)
    with KVStore(str(WORK / "store")) as store:
        adapter.build([list(c) for c in distinct], store)
        results = adapter.sweep(contexts, asked, variants=["dense", *specs], store=store, num_new_tokens=new_tokens,
                                stop_at_eos=True, batch_size=8)  # fmt: skip
    answers = compare_answers(reference, results)
    replayed = replay_differences(adapter, reference, results, mine, new_tokens)
    rows = []
    for r in kept_rows:
        spec = parse_press(f"{r['press']}:{r['ratio']}").name
        a = answers[spec]
        rows.append(r | {"rows": a["rows"], "answers_identical": a["answers_identical"],
                         "answer_tokens_agree": a["tokens_agree"] / a["tokens"],
                         "kvpress_answers_equal_its_dense": a["kvpress_matches_its_dense"],
                         "differing_rows": a["differing_rows"]})  # fmt: skip
        print(f"  {spec:>20}: sets {r['sets_identical']}/{r['sets']} (ties {r['differ_at_ties']}, near "
              f"{r['differ_near_ties']}, other {r['differ_otherwise']}), jaccard {r['jaccard_mean']:.5f}, answers "
              f"{a['answers_identical']}/{a['rows']}", flush=True)  # fmt: skip
    d = answers["dense"]
    print(f"  dense answers identical {d['answers_identical']}/{d['rows']}", flush=True)
    meta = reference["meta"]
    notes = {
        "model": "SmolLM2-135M-Instruct (bundled GGUF converted to a Hugging Face directory), float32, CPU, sdpa",
        "kvpress_meta": {k: meta[k] for k in ("kvpress_version", "transformers_version", "torch_version",
                                              "attn_implementation", "presses", "pipeline")},  # fmt: skip
        "reference_file": str(ref_path),
        "kvpress_s": kvpress_s,  # this run's kvpress_reference.py (None: --reference given)
        "kvpress_pipeline_s": sum(x["seconds"] for r in reference["rows"] for x in [r["dense"], *r["runs"]]),
        "kvstore_kept_s": kept_s,
        "ids_equal_kvstore_prompt": same_ids,
        "context_tokens": [len(c) for c in distinct],
        "question_ids": [q["id"] for q in questions],
        "differing_answers_replayed": replayed,
        "dense": {"rows": d["rows"], "answers_identical": d["answers_identical"],
                  "answer_tokens_agree": d["tokens_agree"] / d["tokens"], "differing_rows": d["differing_rows"]},
        "answers": {"kvpress": {"dense": [r["dense"]["answer_text"] for r in reference["rows"]]},
                    "kvstore": {"dense": [adapter.decode(results["dense"].tokens[i]) for i in range(len(contexts))]}},
    }  # fmt: skip
    for spec in specs:
        press = parse_press(spec)
        theirs = [next(x for x in r["runs"] if parse_press(f"{x['press']}:{x['ratio']}") == press)["answer_text"]
                  for r in reference["rows"]]  # fmt: skip
        notes["answers"]["kvpress"][spec] = theirs
        notes["answers"]["kvstore"][spec] = [adapter.decode(results[spec].tokens[i]) for i in range(len(contexts))]
    params = vars(args) | {"new_tokens": new_tokens, "stop_at_eos": True}
    bl.write_result(
        args.stem,
        params=params,
        rows=rows,
        notes=notes,
        machine={"kvpress": meta["kvpress_version"], "kvpress_transformers": meta["transformers_version"]},
    )


if __name__ == "__main__":
    main()
