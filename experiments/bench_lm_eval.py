"""lm-evaluation-harness: ``--model kvstore`` against ``--model hf`` on local tasks over real text.

Two tasks of our own (experiments/data/lm_eval/: 12 documents of 1.2-1.4k SmolLM2 tokens, each
four of kvstore's demo articles, one question about the last article):

* ``kv_bench_mc``: multiple choice, 4 options per question (48 log-likelihood requests);
* ``kv_bench_gen``: the same questions answered by greedy generation (until a newline, at most 16
  tokens).

``--documents N`` uses the first N documents (on a busy 2-core machine ``hf`` needs minutes per
document). Same model directory for both backends (the bundled SmolLM2-135M-Instruct converted to a plain
Hugging Face directory), float32, CPU, the same batch size. Per task and repetition: ``kvstore`` on
an empty store (cold), ``kvstore`` again on that store (warm; a new model object, the store
reopened), then ``hf``. Models are loaded before the clock starts; each timing is one
``lm_eval.simple_evaluate`` call (building the task's requests included) and, separately, the
time spent inside the model's request method. Checked on every run: metrics identical,
per-request log-likelihoods within 1e-4 of ``hf`` and ``is_greedy`` identical, generations
identical, and context tokens computed (warm: none).

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python experiments/bench_lm_eval.py --documents 8 --repeats 1

Writes ``lm_eval.json`` after every run (so an interrupted benchmark keeps what it measured): through
the suite ``lm_eval`` (``python -m experiments run lm_eval [ARGS]``) into experiments/results/, run
by hand into cache/bench/raw/. The summary has min / median / max per backend and the speed-ups of
the medians.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from pathlib import Path

import benchlib as bl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TASKS_DIR = Path(__file__).resolve().parent / "data" / "lm_eval"
TASKS = {"mc": "kv_bench_mc", "gen": "kv_bench_gen"}
TOLERANCE = 1e-4


def model_dir() -> Path:
    from kvstore.model.load.gguf import convert_gguf
    from kvstore.model.load.loading import bundled_gguf_path

    return convert_gguf(bundled_gguf_path())


def timed_requests(lm) -> dict[str, float]:
    """Wrap the model's request methods so the time spent inside them is recorded."""
    spent = {"s": 0.0}
    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        method = getattr(lm, name)

        def wrapped(requests, *args, _method=method, **kwargs):
            t = bl.timed()
            try:
                return _method(requests, *args, **kwargs)
            finally:
                spent["s"] += t.elapsed()

        setattr(lm, name, wrapped)
    return spent


def evaluate(lm, task: str, task_manager, limit: int | None = None) -> tuple[dict, float, float, list[float]]:
    """``(results, wall seconds, seconds inside the model, load average before)``."""
    import lm_eval

    spent = timed_requests(lm)
    before = bl.loadavg()
    with bl.timed() as t:
        out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager, log_samples=True, limit=limit)
    return out, t.seconds, spent["s"], before


def metrics(out: dict, task: str) -> dict:
    return {k: v for k, v in out["results"][task].items() if "," in k and "stderr" not in k}


def compare(ref: dict, got: dict, task: str) -> dict:
    """Per-request agreement of ``got`` with ``ref`` (``hf``)."""
    a = sorted(ref["samples"][task], key=lambda s: s["doc_id"])
    b = sorted(got["samples"][task], key=lambda s: s["doc_id"])
    max_diff, greedy_mismatch, gen_mismatch, n = 0.0, 0, 0, 0
    for sa, sb in zip(a, b):
        for ra, rb in zip(sa["resps"], sb["resps"]):
            n += 1
            if isinstance(ra[0], str):
                gen_mismatch += ra[0] != rb[0]
            else:
                max_diff = max(max_diff, abs(float(ra[0][0]) - float(rb[0][0])))
                greedy_mismatch += bool(ra[0][1]) != bool(rb[0][1])
    ma, mb = metrics(ref, task), metrics(got, task)
    return {
        "requests": n,
        "metrics_identical": ma == mb,
        "max_abs_loglikelihood_diff": max_diff,
        "loglikelihoods_within_1e-4": max_diff <= TOLERANCE,
        "is_greedy_mismatches": greedy_mismatch,
        "generation_mismatches": gen_mismatch,
    }


def document_tokens(tokenizer, limit: int | None) -> dict:
    if str(TASKS_DIR) not in sys.path:  # the tasks' own data module
        sys.path.insert(0, str(TASKS_DIR))
    import kv_bench_data

    lengths = sorted(len(tokenizer(r["document"])["input_ids"]) for r in kv_bench_data.rows()[:limit])
    return {"documents": len(lengths), "min": lengths[0], "median": statistics.median(lengths), "max": lengths[-1]}


def summary(runs: list[dict]) -> dict:
    out: dict = {}
    for key in TASKS.values():
        mine = [r for r in runs if r["task"] == key]
        if not mine:
            continue
        row: dict = {"repeats": len(mine)}
        for backend in ("hf", "kvstore_cold", "kvstore_warm"):
            walls = [r[backend]["wall_s"] for r in mine]
            inside = [r[backend]["model_s"] for r in mine]
            row[backend] = {
                "wall_s": {"min": min(walls), "median": statistics.median(walls), "max": max(walls)},
                "model_s": {"min": min(inside), "median": statistics.median(inside), "max": max(inside)},
            }
        for backend in ("kvstore_cold", "kvstore_warm"):
            row[f"speedup_{backend.split('_')[1]}_wall"] = (
                row["hf"]["wall_s"]["median"] / row[backend]["wall_s"]["median"]
            )
            row[f"speedup_{backend.split('_')[1]}_model"] = (
                row["hf"]["model_s"]["median"] / row[backend]["model_s"]["median"]
            )
        row["all_exact"] = all(
            r[b]["check"]["metrics_identical"]
            and r[b]["check"]["loglikelihoods_within_1e-4"]
            and not r[b]["check"]["is_greedy_mismatches"]
            and not r[b]["check"]["generation_mismatches"]
            for r in mine
            for b in ("kvstore_cold", "kvstore_warm")
        )
        row["warm_context_tokens_computed"] = [r["kvstore_warm"]["context_tokens_computed"] for r in mine]
        out[key] = row
    return out


def main() -> None:
    parser = bl.parser(__doc__, batch_size=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", default="mc,gen", help="comma-separated: mc, gen")
    parser.add_argument("--documents", type=int, default=None, help="use the first N documents (default all 12)")
    args = bl.start(parser, quick=dict(documents=2, repeats=1))  # a smoke run: 2 documents, 1 repeat
    limit = args.documents
    import lm_eval.models.huggingface  # noqa: F401 - registers "hf"
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kvstore.lm_eval import KVStoreLM

    directory = model_dir()
    task_manager = TaskManager(include_path=str(TASKS_DIR))
    hf = HFLM(pretrained=str(directory), dtype="float32", device="cpu", batch_size=args.batch_size)
    params = vars(args) | {"limit": limit}
    notes: dict = {
        "model": "SmolLM2-135M-Instruct (bundled GGUF converted to a Hugging Face directory), float32, CPU, sdpa",
        "document_tokens": document_tokens(hf.tokenizer, limit),
    }
    runs: list[dict] = []
    wanted = [TASKS[t.strip()] for t in args.tasks.split(",") if t.strip()]
    for rep in range(args.repeats):
        for task in wanted:
            run: dict = {"task": task, "repeat": rep}
            store = bl.SCRATCH / f"lm_eval_{task}"
            shutil.rmtree(store, ignore_errors=True)
            kv_results = {}
            for phase in ("cold", "warm"):  # kvstore first: a failure shows before hf's long run
                print(f"repeat {rep + 1}/{args.repeats}, {task}: kvstore {phase} ...", flush=True)
                kv = KVStoreLM(pretrained=str(directory), store=str(store), dtype="float32", batch_size=args.batch_size)
                got, wall, inside, la = evaluate(kv, task, task_manager, limit)
                kv_results[phase] = got
                run[f"kvstore_{phase}"] = {
                    "wall_s": wall,
                    "model_s": inside,
                    "load_before": la,
                    "context_tokens_computed": kv.context_tokens_computed,
                    "context_tokens_loaded": kv.context_tokens_loaded,
                    "metrics": metrics(got, task),
                }
                kv.close()
                print(f"  {wall:.1f}s (model {inside:.1f}s)", flush=True)
            shutil.rmtree(store, ignore_errors=True)
            print(f"repeat {rep + 1}/{args.repeats}, {task}: hf ...", flush=True)
            ref, wall, inside, la = evaluate(hf, task, task_manager, limit)
            run["hf"] = {"wall_s": wall, "model_s": inside, "load_before": la, "metrics": metrics(ref, task)}
            for phase in ("cold", "warm"):
                run[f"kvstore_{phase}"]["check"] = compare(ref, kv_results[phase], task)
            run["load_after"] = bl.loadavg()
            runs.append(run)
            bl.write_result("lm_eval", params=params, rows=runs, notes=notes | {"summary": summary(runs)})
            print(
                f"  hf {run['hf']['wall_s']:.1f}s  cold {run['kvstore_cold']['wall_s']:.1f}s  "
                f"warm {run['kvstore_warm']['wall_s']:.1f}s  checks {run['kvstore_cold']['check']} "
                f"{run['kvstore_warm']['check']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
