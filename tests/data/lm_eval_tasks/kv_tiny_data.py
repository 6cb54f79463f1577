"""Documents for the tiny lm-eval tasks of tests/test_lm_eval.py (loaded with ``custom_dataset``,
so the task files need no absolute path and no hub)."""

from __future__ import annotations

from typing import Any

DOCUMENTS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away to the river, "
    "and every morning the fox comes back to the same place.",
    "Once upon a time there was a small model that stored its keys and values on disk, and every "
    "question about the same context was answered from the stored cache.",
    "Paris is the capital of France. A spider has eight legs. The model answered each question "
    "about France and about spiders from its cache.",
)

QUESTIONS = (
    (0, "What jumps over the dog?", ["the fox", "the cat", "the model", "a spider"], 0),
    (0, "Where does the fox run?", ["to Paris", "to the river", "to the disk", "away home"], 1),
    (1, "Where were the keys stored?", ["in France", "on disk", "in the river", "nowhere"], 1),
    (2, "How many legs does a spider have?", ["two", "ten", "four", "eight"], 3),
    (2, "What is the capital of France?", ["Paris", "the fox", "the dog", "disk"], 0),
)


def _split(rows: list[dict[str, Any]]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def multiple_choice(**kwargs: Any):
    """Questions with 4 options each, several per document."""
    return _split(
        [
            {"context": DOCUMENTS[d], "question": q, "choices": choices, "label": label}
            for d, q, choices, label in QUESTIONS
        ]
    )


def documents(**kwargs: Any):
    """The documents alone (perplexity)."""
    return _split([{"text": text} for text in DOCUMENTS])


def generation(**kwargs: Any):
    """The questions, to answer by generation."""
    return _split(
        [{"context": DOCUMENTS[d], "question": q, "answer": choices[label]} for d, q, choices, label in QUESTIONS]
    )
