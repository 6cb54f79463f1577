"""The main job on the embedded defaults: ``make demo``.

Builds the KV caches of the demo dataset with the bundled SmolLM2-135M-Instruct into the default
LMDB store under cache/, answers its questions from the store, answers them again without any
cache (the reference), and prints the accuracy, how much faster the cached run was, and whether
every row's generated text is identical.

The prompt is a plain (not chat) template with two worked examples before the document, and
answers stop at the first line break: the 135M model answers a chat prompt in full sentences,
which the prefix-match accuracy does not credit (3.9% vs 65% with this prompt, measured by
``experiments/bench_demo_prompt.py``). The examples are the prompt's shared head, stored once.

Command: ``make demo`` (or ``.venv/bin/python experiments/demo.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "experiments" / "data" / "demo.jsonl"
# two worked examples (not from the demo set) before the document: a shared head, stored once
FEW_SHOT = (
    "Answer each question with a few words from its passage.\n\n"
    "Passage: The Millbrook lighthouse was built in 1902 by the engineer Clara Voss. It stands 31 metres tall.\n"
    "Question: Who built the Millbrook lighthouse?\nAnswer: Clara Voss\n\n"
    "Passage: The river Arden flows through four towns before it reaches the sea at Porthaven.\n"
    "Question: Where does the river Arden reach the sea?\nAnswer: Porthaven\n\n"
    "Passage: {context}\nQuestion: {question}\nAnswer:"
)

PROMPT = ["--no-chat", "--template", FEW_SHOT]


def kvstore(*args: str) -> dict:
    """Run one ``kvstore`` command as a user would, echo it, and return its JSON summary."""
    cmd = [sys.executable, "-m", "kvstore.cli.main", *args, "--format", "json"]
    shown = ['"$FEW_SHOT"' if a == FEW_SHOT else a for a in args]
    print("$ kvstore " + " ".join(shown), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    summary = json.loads(proc.stdout)
    summary["wall_seconds"] = time.perf_counter() - t0
    return summary


def main() -> None:
    data = str(DATA.relative_to(ROOT))
    preds = ROOT / "cache" / "demo_predictions.jsonl"
    built = kvstore("build", data, *PROMPT)
    print(
        f"  built {built['built']} contexts, skipped {built['skipped']} already stored; "
        f"{built['tokens_computed']} tokens computed, {built['tokens_reused']} reused (the shared examples), "
        f"{built['stored_bytes'] / 2**20:.1f} MiB stored (ratio {built['ratio']:.2f})\n"
    )
    answer = [*PROMPT, "--stop", "\\n"]
    cached = kvstore("sample", data, *answer, "--output", str(preds.relative_to(ROOT)))
    print(
        f"  accuracy {cached['accuracy']:.1%}  contains {cached['contains']:.1%}  F1 {cached['f1']:.1%}  "
        f"hit rate {cached['cache_hit_rate']:.0%}  {cached['seconds']:.1f} s\n"
    )
    ref_preds = ROOT / "cache" / "demo_predictions_nocache.jsonl"
    ref = kvstore("sample", data, *answer, "--no-cache", "--output", str(ref_preds.relative_to(ROOT)))
    print(f"  accuracy {ref['accuracy']:.1%}  {ref['seconds']:.1f} s\n")
    a = [json.loads(line)["raw_output"] for line in preds.open()]
    b = [json.loads(line)["raw_output"] for line in ref_preds.open()]
    same = sum(x == y for x, y in zip(a, b))
    print("Summary")
    print(f"  questions            {cached['questions']}")
    print(
        f"  accuracy             {cached['accuracy']:.1%} (answer is a prefix)   {cached['contains']:.1%} (answer "
        "contained)"
    )
    print(f"  exact match / F1     {cached['exact_match']:.1%} / {cached['f1']:.1%}")
    print(
        f"  answering time       {cached['seconds']:.1f} s from the store vs {ref['seconds']:.1f} s without cache "
        f"-> {ref['seconds'] / cached['seconds']:.1f}x faster"
    )
    print(
        f"  prefill tokens       {cached['prefill_tokens_saved']} read from the store instead of computed; "
        "both runs decode the same answers (short here: they stop at a line break), which no cache saves"
    )
    print(f"  identical generated text with and without the cache: {same}/{len(a)} rows")
    print(f"  predictions          {preds.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
