"""Presses on RULER at 4k tokens through lm-evaluation-harness, every press over one store.

lm-eval 0.4.13's RULER tasks ``niah_single_1``, ``niah_multikey_2`` and ``ruler_vt`` at 4096 tokens
(generated locally from the model's tokenizer: they need ``wonderwords`` and ``nltk``, the eval
extra; ``NLTK_DATA`` is pointed at a scratch folder holding an empty ``tokenizers/punkt_tab/``, else
lm-eval's RULER module tries a download when imported), the first ``--limit`` samples of each (every
task makes 500), the bundled SmolLM2-135M-Instruct converted to a Hugging Face directory (float32,
CPU, sdpa), through lm-eval's Python API: one ``lm_eval.simple_evaluate`` of the three tasks per
variant with a fresh ``KVStoreLM`` (closed after), ``dense`` first, then every press (``knorm``,
``streaming_llm``, ``random``, ``keydiff``, ``snapkv``, ``tova``; ``press=NAME:RATIO``, not question-aware:
in an lm-eval request the question is part of the context) at the ratios 0.25, 0.5 and 0.75, all
over **one store**: the dense invocation builds it, every later one loads it and computes no context
token (``context_tokens_computed`` per invocation, in the rows).

The tasks are loaded once (the data generated with lm-eval's default seeds, as ``lm_eval`` seeds
them, so these are the samples its command line makes) and reused. ``niah_*`` generate at most
``--niah-gen-toks`` (32) tokens instead of their 128 (their answer, a 7-digit number, comes in the
first ~8; the metric is whether it appears in the output), ``ruler_vt`` its own 30; greedy, no stop
strings, as the tasks say.

The dense row must equal a plain run: lm-eval's ``hf`` model (same directory, dtype, batch size) on
the first ``--hf-limit`` samples of each task, and every generation compared with dense kvstore's
(``notes.dense_vs_hf``). Per (variant, task) row: the task's score (its metric ``4096``, the mean
fraction of the needles each output holds), and the invocation's wall seconds, seconds inside
``generate_until`` and context tokens computed and loaded. The plot (``press_ruler.png``, in
docs/img/ through the suite): score against the ratio per press, one panel per task.

Command (from the repository root; the suite ``press_ruler``: ``python -m experiments run press_ruler
[ARGS]`` writes ``press_ruler.json`` into experiments/results/ and the plot into docs/img/; run by hand it
writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_press_ruler.py --limit 10
    .venv/bin/python experiments/bench_press_ruler.py --quick   # 1 sample of niah_single_1, dense and knorm:0.5
"""

from __future__ import annotations

import os
import random
import shutil

import benchlib as bl

WORK = bl.SCRATCH / "press_ruler"
# lm-eval's RULER module calls nltk.download("punkt_tab") at import unless nltk finds it: an empty
# folder satisfies the lookup (these tasks never split sentences), and nothing leaves the machine.
NLTK_DATA = WORK / "nltk"
os.environ["NLTK_DATA"] = str(NLTK_DATA)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TASKS = ("niah_single_1", "niah_multikey_2", "ruler_vt")
PRESSES = ("knorm", "streaming_llm", "random", "keydiff", "snapkv", "tova")
RATIOS = (0.25, 0.5, 0.75)
LENGTH = 4096


def load_tasks(names: list[str], model_dir: str, niah_gen_toks: int) -> dict:
    """The tasks, their data generated once with lm-eval's default seeds (``simple_evaluate`` sets the
    same ones before it loads tasks)."""
    import numpy as np
    import torch
    from lm_eval.tasks import TaskManager

    random.seed(0)
    np.random.seed(1234)
    torch.manual_seed(1234)
    manager = TaskManager(metadata={"max_seq_lengths": [LENGTH], "pretrained": model_dir})
    tasks = manager.load(names)["tasks"]
    for name, task in tasks.items():
        if name.startswith("niah"):
            task.set_config(key="generation_kwargs", value={"max_gen_toks": niah_gen_toks}, update=True)
    return tasks


def evaluate(lm, tasks: dict, limit: int) -> tuple[dict, float, float]:
    """``(results, wall seconds, seconds inside generate_until)`` of one ``simple_evaluate``."""
    import lm_eval

    spent = [0.0]
    method = lm.generate_until

    def timed(requests, *args, **kwargs):
        t = bl.timed()
        try:
            return method(requests, *args, **kwargs)
        finally:
            spent[0] += t.elapsed()

    lm.generate_until = timed
    with bl.timed() as t:
        out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks.values()), limit=limit, log_samples=True,
                                      verbosity="WARNING")  # fmt: skip
    return out, t.seconds, spent[0]


def per_sample(out: dict, task: str) -> list[dict]:
    """``[{doc_id, response, score}]`` of one task, by doc_id."""
    rows = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return [{"doc_id": s["doc_id"], "response": s["resps"][0][0], "score": s[str(LENGTH)]} for s in rows]


def plot(rows: list[dict], tasks: list[str], path) -> None:
    panels = []
    for task in tasks:
        mine = [r for r in rows if r["task"] == task]
        dense = next(r for r in mine if r["variant"] == "dense")
        lines: dict[str, tuple[list, list]] = {}
        for r in mine:
            if r["variant"] != "dense":
                xs, ys = lines.setdefault(r["press"], ([0.0], [dense["score"]]))
                xs.append(r["ratio"])
                ys.append(r["score"])
        panels.append((f"{task} score (4096 tokens, {dense['samples']} samples)", lines, dense["score"]))
    bl.ratio_plot(path, panels, "Presses on RULER through lm-eval, SmolLM2-135M-Instruct fp32, one store")


def main() -> None:
    ap = bl.parser(__doc__, batch_size=8)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--limit", type=int, default=10, help="samples per task")
    ap.add_argument("--hf-limit", type=int, default=None, help="samples per task compared with hf (default: all)")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--niah-gen-toks", type=int, default=32, help="max_gen_toks of the niah tasks (theirs: 128)")
    ap.add_argument("--codec", default=None, help="the store's codec for every variant (default: the store's)")
    ap.add_argument("--stem", default="press_ruler", help="the result's name")
    quick = dict(tasks="niah_single_1", limit=1, presses="knorm", ratios="0.5")
    args = bl.start(ap, quick=quick, wait=False)  # waits for a quiet machine once the tasks are loaded
    args.hf_limit = args.limit if args.hf_limit is None else min(args.hf_limit, args.limit)
    (NLTK_DATA / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
    import lm_eval.models.huggingface  # noqa: F401 - registers "hf"
    from lm_eval.models.huggingface import HFLM

    from kvstore.lm_eval import KVStoreLM
    from kvstore.model.load.gguf import convert_gguf
    from kvstore.model.load.loading import bundled_gguf_path
    from kvstore.model.press.spec import parse_press

    model_dir = str(convert_gguf(bundled_gguf_path()))
    names = args.tasks.split(",")
    with bl.timed() as t:
        tasks = load_tasks(names, model_dir, args.niah_gen_toks)
    tasks_s = t.seconds
    variants = ["dense"] + [bl.press_spec(p, float(r)) for p in args.presses.split(",")
                            for r in args.ratios.split(",")]  # fmt: skip
    store = WORK / "store"
    shutil.rmtree(store, ignore_errors=True)
    bl.wait_for_quiet(max_wait_s=args.wait)
    rows: list[dict] = []
    samples: dict[str, dict] = {}
    notes: dict = {
        "model": "SmolLM2-135M-Instruct (bundled GGUF converted to a Hugging Face directory), float32, CPU, sdpa",
        "tasks_load_s": tasks_s,
        "gen_kwargs": {n: dict(tasks[n].config.generation_kwargs) for n in names},
        "store": str(store),
        "invocations": [],
        "samples": samples,
    }
    params = vars(args) | {"length": LENGTH, "variants": variants}

    def save():
        bl.write_result(args.stem, params=params, rows=rows, notes=notes)

    for v in variants:
        lm = KVStoreLM(pretrained=model_dir, store=str(store), dtype="float32", batch_size=args.batch_size,
                       press=None if v == "dense" else v, codec=args.codec)  # fmt: skip
        try:
            before = bl.loadavg()
            out, wall, inside = evaluate(lm, tasks, args.limit)
            computed, loaded = lm.context_tokens_computed, lm.context_tokens_loaded
        finally:
            lm.close()
        press = parse_press(v) if v != "dense" else None
        method, ratio = (bl.press_label(v), press.ratio) if press else ("dense", 0.0)
        inv = {"variant": v, "wall_s": wall, "generate_s": inside, "context_tokens_computed": computed,
               "context_tokens_loaded": loaded, "load_before": before, "load_after": bl.loadavg()}  # fmt: skip
        notes["invocations"].append(inv)
        samples[v] = {n: per_sample(out, n) for n in names}
        for n in names:
            score = out["results"][n][f"{LENGTH},none"]
            rows.append({"variant": v, "press": method, "ratio": ratio, "task": n, "samples": len(samples[v][n]),
                         "score": score, "invocation_wall_s": wall, "invocation_generate_s": inside,
                         "context_tokens_computed": computed, "context_tokens_loaded": loaded})  # fmt: skip
        print(f"  {v:>20}: " + ", ".join(f"{n} {out['results'][n][f'{LENGTH},none']:.3f}" for n in names)
              + f"  ({wall:.0f} s, context tokens computed {computed}, loaded {loaded})", flush=True)  # fmt: skip
        save()

    hf = HFLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=args.batch_size)
    out, wall, inside = evaluate(hf, tasks, args.hf_limit)
    hf_samples = {n: per_sample(out, n) for n in names}
    compared = {}
    for n in names:
        pairs = list(zip(samples["dense"][n][: args.hf_limit], hf_samples[n]))
        assert all(a["doc_id"] == b["doc_id"] for a, b in pairs)
        differ = [a["doc_id"] for a, b in pairs if a["response"] != b["response"]]
        compared[n] = {"samples": len(pairs), "identical": len(pairs) - len(differ),
                       "hf_score": out["results"][n][f"{LENGTH},none"], "differing_doc_ids": differ}  # fmt: skip
    notes["dense_vs_hf"] = compared | {"hf_wall_s": wall, "hf_generate_s": inside}
    notes["hf_samples"] = hf_samples
    notes["dense_equals_hf"] = all(c["identical"] == c["samples"] for c in compared.values())
    print(f"dense against hf: {compared}", flush=True)
    save()
    plot(rows, names, bl.RESULTS / f"{args.stem}.png")


if __name__ == "__main__":
    main()
