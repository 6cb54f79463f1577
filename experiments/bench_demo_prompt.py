"""Prompting the bundled model for brief answers: what it does to the demo's accuracy.

SmolLM2-135M-Instruct answers in sentences ("The bridge was completed in 1874."), which the
research notebook's prefix-match accuracy does not credit. Each variant below answers the demo
set (78 questions, chat template, float32, 20 new tokens) through the CLI as a user runs it
(``kvstore sample`` from a store built for it), and the summary's metrics are recorded:
accuracy (prefix match), contains (an answer within the prediction), exact match and F1, and the
mean prediction length in words.

Command (from the repository root; the suite ``demo_prompt``: ``python -m experiments run demo_prompt [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_demo_prompt.py
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

from demo import FEW_SHOT  # the prompt make demo uses

import benchlib as bl

WORK = bl.SCRATCH / "demo_prompt"
BRIEF_SYSTEM = "Answer with the answer only: a name, a number, a date or a short phrase. Never a full sentence."
BRIEF_TEMPLATE = "{context}\n\nAnswer in as few words as possible.\nQuestion: {question}\nAnswer:"
VARIANTS = {
    "default chat prompt": [],
    "--system (brief)": ["--system", BRIEF_SYSTEM],
    "--template (brief instruction)": ["--template", BRIEF_TEMPLATE],
    "--no-chat": ["--no-chat"],
    "--no-chat, few-shot template": ["--no-chat", "--template", FEW_SHOT],
    "--chat, few-shot template": ["--template", FEW_SHOT],
}


def main() -> None:
    args = bl.start(bl.parser(__doc__, quick=False))
    data = bl.HERE / "data" / "demo.jsonl"
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows = []
    for name, extra in VARIANTS.items():
        out = WORK / f"{len(rows)}.jsonl"
        cmd = [sys.executable, "-m", "kvstore", "sample", str(data), "--store", str(WORK / "store"), "-q",
               "--format", "json", "-o", str(out), *extra]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(proc.stderr)
        s = json.loads(proc.stdout)
        preds = [json.loads(line)["prediction"] for line in out.open()]
        row = {"variant": name, "args": extra} | {
            k: s[k] for k in ("questions", "accuracy", "contains", "exact_match", "f1", "seconds")
        }
        row["mean_words"] = statistics.mean(len(p.split()) for p in preds)
        row["examples"] = preds[:3]
        rows.append(row)
        print(f"{name:<32} accuracy {row['accuracy']:.1%}  contains {row['contains']:.1%}  EM {row['exact_match']:.1%}"
              f"  F1 {row['f1']:.1%}  {row['mean_words']:.1f} words", flush=True)  # fmt: skip
    bl.write_result("demo_prompt", params={}, rows=rows)
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
