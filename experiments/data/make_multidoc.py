"""Writes multidoc.jsonl: the demo's questions as multi-document rows (HotpotQA's distractor protocol).

    .venv/bin/python experiments/data/make_multidoc.py

Each of the demo's 22 articles (make_demo.py, 317-347 SmolLM2 tokens each) is one passage. Every
demo question becomes one row whose context is a list of passages: its own article (the gold
passage) among ``DISTRACTORS`` other articles drawn at random, in a shuffled order, so the same
passage appears in many rows at different positions (what a prefix-chain store keeps once per
order and a composed context once in all). Fixed seed: rerunning writes the same file; a test
(tests/data/test_multidoc_data.py) checks it is this script's output.

Fields: ``id``, ``context`` (the list of passages), ``question``, ``answers``, and ``gold`` (the
gold passage's index in ``context``).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "multidoc.jsonl"
DISTRACTORS = 3  # 4 passages a row: ~1,300 SmolLM2 tokens, a CPU prefill of a few seconds
SEED = 50


def _demo():
    spec = importlib.util.spec_from_file_location("make_demo", HERE / "make_demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(distractors: int = DISTRACTORS, seed: int = SEED) -> list[dict]:
    """One row per demo question: its article among ``distractors`` others, shuffled."""
    demo = _demo()
    articles = {slug: "\n\n".join(paragraphs) for slug, paragraphs, _ in demo.ARTICLES}
    slugs = list(articles)
    rng = random.Random(seed)
    out = []
    for row in demo.rows():
        gold = next(s for s in slugs if row["id"].startswith(s + "-") and row["context"] == articles[s])
        chosen = [gold, *rng.sample([s for s in slugs if s != gold], distractors)]
        rng.shuffle(chosen)
        out.append(
            {
                "id": row["id"],
                "context": [articles[s] for s in chosen],
                "question": row["question"],
                "answers": row["answers"],
                "gold": chosen.index(gold),
            }
        )
    return out


def main() -> None:
    data = rows()
    with OUT.open("w", encoding="utf-8") as handle:
        for row in data:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({len(data)} rows of {DISTRACTORS + 1} passages)")


if __name__ == "__main__":
    main()
