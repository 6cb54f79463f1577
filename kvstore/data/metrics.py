"""Scoring generated answers against the accepted ones.

Every metric compares *normalized* text, as the SQuAD evaluation does: lowercase, punctuation
removed, the articles a/an/the removed, whitespace collapsed. A question counts against its best
accepted answer (the maximum over ``answers``). A question with no accepted answers is
unanswerable and is scored against the empty answer, as SQuAD 2.0 does: only an empty
prediction is right.

Three numbers, each a fraction in [0, 1]:

``exact_match``
    normalized prediction equals a normalized answer.
``f1``
    token-level F1 between the normalized prediction and answer (bag of words).
``accuracy``
    :func:`lenient_match`, a *normalized prefix match*: the normalized prediction starts with a
    normalized answer, or a normalized answer starts with the (non-empty) normalized prediction.
    It forgives a model that keeps talking after the answer ("1874 and was ...") or stops short
    of a long one ("Mirela" for "Mirela Voss"). It compares characters, not words, so
    "18" matches "1874": read it beside exact match, not instead of it.

Generated text usually goes through :func:`clean_prediction` first.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

__all__ = [
    "clean_prediction",
    "contains_match",
    "exact_match",
    "f1_score",
    "lenient_match",
    "normalize_answer",
    "answer_metrics",
]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, drop ASCII punctuation and a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def clean_prediction(text: str) -> str:
    """The answer part of generated text: up to the first line break, without surrounding spaces.

    Leading whitespace goes first, so an answer that starts on a new line survives; whatever the
    model writes after the first line of its answer is dropped.
    """
    return text.lstrip().split("\n", 1)[0].strip()


def exact_match(prediction: str, answers: str | Sequence[str]) -> float:
    """1.0 when the normalized prediction equals some normalized answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(answer) for answer in _accepted(answers)))


def f1_score(prediction: str, answers: str | Sequence[str]) -> float:
    """Best token-level F1 (harmonic mean of word precision and recall) over the answers."""
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(answer).split()) for answer in _accepted(answers))


def lenient_match(prediction: str, answers: str | Sequence[str]) -> bool:
    """Normalized prefix match: one of prediction and answer starts with the other.

    Precisely: after normalization, the prediction equals an answer, starts with a non-empty
    answer, or is non-empty and an answer starts with it.
    """
    pred = normalize_answer(prediction)
    for answer in _accepted(answers):
        gold = normalize_answer(answer)
        if pred == gold or (gold and pred.startswith(gold)) or (pred and gold.startswith(pred)):
            return True
    return False


def contains_match(prediction: str, answers: str | Sequence[str]) -> bool:
    """Normalized containment: some non-empty answer appears, on word boundaries, in the
    prediction (TriviaQA-style; credits "The bridge was completed in 1874." for "1874")."""
    pred = f" {normalize_answer(prediction)} "
    return any(gold and f" {gold} " in pred for gold in (normalize_answer(a) for a in _accepted(answers)))


def answer_metrics(predictions: Sequence[str], answers_list: Sequence[str | Sequence[str]]) -> dict[str, float]:
    """Average the metrics over questions: ``accuracy`` (lenient), ``contains``, ``exact_match``,
    ``f1`` and ``count``.

    ``predictions[i]`` is scored against ``answers_list[i]``; the three metrics are fractions in
    [0, 1] and ``count`` is the number of questions (all metrics are 0.0 when it is 0).
    Predictions are scored as given: apply :func:`clean_prediction` to raw generations first.
    Raises ValueError when the two sequences differ in length.
    """
    if len(predictions) != len(answers_list):
        raise ValueError(f"{len(predictions)} predictions for {len(answers_list)} questions")
    count = len(predictions)
    if count == 0:
        return {"accuracy": 0.0, "contains": 0.0, "exact_match": 0.0, "f1": 0.0, "count": 0}
    pairs = list(zip(predictions, answers_list))
    return {
        "accuracy": sum(lenient_match(p, a) for p, a in pairs) / count,
        "contains": sum(contains_match(p, a) for p, a in pairs) / count,
        "exact_match": sum(exact_match(p, a) for p, a in pairs) / count,
        "f1": sum(f1_score(p, a) for p, a in pairs) / count,
        "count": count,
    }


def _accepted(answers: str | Sequence[str]) -> Sequence[str]:
    if isinstance(answers, str):
        return [answers]
    return answers if len(answers) else [""]


def _f1(pred: list[str], gold: list[str]) -> float:
    if not pred or not gold:
        return float(pred == gold)  # both empty: agreement on "no answer"
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)
