"""Documents of the lm-eval benchmark tasks (experiments/bench_lm_eval.py), built from kvstore's
own demo articles (../demo.jsonl) and loaded through ``custom_dataset`` (no hub, no absolute path).

Document ``i`` (``i = 0 .. 11``) is four consecutive articles, starting at article ``3 * i``
(wrapping around the 22 articles): 1.2-1.4k SmolLM2 tokens. Its question is the first question
about its last article, so the answer sits ~1k tokens into the document. The four options are
that question's answer and the first answers of three other questions about the document's
articles, in an order fixed by ``i``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parent.parent / "demo.jsonl"
N_DOCUMENTS = 12
ARTICLES_PER_DOCUMENT = 4


def rows() -> list[dict[str, Any]]:
    """The benchmark rows: ``document``, ``question``, ``choices`` (4), ``label``, ``answer``."""
    articles: dict[str, list[dict[str, Any]]] = {}
    with DEMO.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            articles.setdefault(row["context"], []).append(row)
    texts = list(articles)
    out = []
    for i in range(N_DOCUMENTS):
        picked = [texts[(3 * i + k) % len(texts)] for k in range(ARTICLES_PER_DOCUMENT)]
        asked = articles[picked[-1]][0]
        answer = asked["answers"][0]
        others = [r["answers"][0] for t in picked for r in articles[t] if r["answers"][0] != answer]
        rng = random.Random(i)
        distractors = rng.sample(sorted(set(others)), 3)
        choices = [answer, *distractors]
        rng.shuffle(choices)
        out.append(
            {
                "document": "\n\n".join(picked),
                "question": asked["question"],
                "choices": choices,
                "label": choices.index(answer),
                "answer": answer,
            }
        )
    return out


def load(**kwargs: Any):
    """The rows as a ``datasets.DatasetDict`` with one ``test`` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows())})
