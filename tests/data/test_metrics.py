"""kvstore.data.metrics: SQuAD normalization, exact match, F1, the lenient prefix match, aggregation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.data.metrics import (
    answer_metrics,
    clean_prediction,
    exact_match,
    f1_score,
    lenient_match,
    normalize_answer,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Harrow Bridge", "harrow bridge"),
        ("  An apple a  day\tkeeps...  ", "apple day keeps"),
        ("Tanner's Hill!", "tanners hill"),
        ("6,200", "6200"),
        ("Hollis & Vane", "hollis vane"),
        ("theatre, another", "theatre another"),  # articles only as whole words
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" 1874\nQuestion: When was it built?", "1874"),
        ("\n\n  Matilda Crane  \n\nShe was 29.", "Matilda Crane"),
        ("Port Anselm.", "Port Anselm."),
        ("", ""),
        ("  \n  ", ""),
    ],
)
def test_clean_prediction(text: str, expected: str) -> None:
    assert clean_prediction(text) == expected


def test_exact_match_takes_the_best_answer() -> None:
    assert exact_match("the Silver Wheel.", ["Silver Wheel"]) == 1.0
    assert exact_match("Crane", ["Matilda Crane", "Crane"]) == 1.0
    assert exact_match("Crane", "Matilda Crane") == 0.0
    assert exact_match("1874 AD", ["1874"]) == 0.0


def test_f1_hand_computed() -> None:
    # 4 predicted tokens, 2 gold tokens, 2 shared: P = 1/2, R = 1, F1 = 2/3.
    assert f1_score("Matilda Crane designed it", ["Matilda Crane"]) == pytest.approx(2 / 3)
    # Counts are clipped: "y y" shared twice; P = R = 2/3.
    assert f1_score("x y y", "y y z") == pytest.approx(2 / 3)
    # Max over answers: 2/3 (P = 1, R = 1/2) vs 1 -> 1.
    assert f1_score("River Leddon", ["Leddon river crossing x", "the River Leddon"]) == pytest.approx(1.0)
    # P = 1/3 (1 of "in year 1874"), R = 1: F1 = 2 * (1/3) / (4/3) = 1/2.
    assert f1_score("in year 1874", ["1874"]) == pytest.approx(0.5)
    assert f1_score("Port Anselm", ["Kell"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalize to nothing


def test_lenient_match_is_a_normalized_prefix_match() -> None:
    assert lenient_match("1874 and it still stands", ["1874"])  # prediction starts with the answer
    assert lenient_match("Mirela", ["Mirela Voss"])  # the answer starts with the prediction
    assert lenient_match("The Lady Rowan.", ["Lady Rowan"])
    assert lenient_match("18", ["1874"])  # characters, not words: read beside exact match
    assert not lenient_match("", ["1874"])
    assert not lenient_match("In 1874", ["1874"])
    assert not lenient_match("1875", ["1874", "1876"])


def test_unanswerable_questions_expect_no_answer() -> None:
    assert exact_match("", []) == 1.0 and f1_score("", []) == 1.0 and lenient_match("", [])
    assert exact_match("Kell", []) == 0.0 and f1_score("Kell", []) == 0.0 and not lenient_match("Kell", [])


def test_score_hand_computed() -> None:
    predictions = ["1874", "Matilda Crane designed it", "Kell harbour", "Port"]
    answers = [["1874"], ["Matilda Crane", "Crane"], ["Port Anselm"], ["Port Anselm"]]
    result = answer_metrics(predictions, answers)
    # lenient: yes, yes, no, yes; contains: yes, yes, no, no; exact: yes, no, no, no;
    # f1: 1, 2/3, 0, 2 * (1 * 1/2) / (3/2) = 2/3.
    assert result == {
        "accuracy": pytest.approx(3 / 4),
        "contains": pytest.approx(2 / 4),
        "exact_match": pytest.approx(1 / 4),
        "f1": pytest.approx((1 + 2 / 3 + 0 + 2 / 3) / 4),
        "count": 4,
    }
    assert answer_metrics([], []) == {"accuracy": 0.0, "contains": 0.0, "exact_match": 0.0, "f1": 0.0, "count": 0}
    with pytest.raises(ValueError, match="2 predictions for 1 questions"):
        answer_metrics(["a", "b"], [["a"]])


text = st.text(alphabet=st.sampled_from("aAbthe ,.-!x19\n\t"), max_size=20)


@given(prediction=text, answers=st.lists(text, max_size=3))
def test_metric_properties(prediction: str, answers: list[str]) -> None:
    em, f1, lenient = (
        exact_match(prediction, answers),
        f1_score(prediction, answers),
        lenient_match(prediction, answers),
    )
    assert em in (0.0, 1.0) and 0.0 <= f1 <= 1.0
    if em:
        assert lenient and f1 == 1.0
    assert exact_match(prediction, [*answers, prediction]) == 1.0
    assert lenient_match(prediction, [*answers, prediction])


def test_contains_match_whole_words():
    from kvstore.data.metrics import answer_metrics, contains_match

    assert contains_match("The Harrow Bridge was completed in 1874.", ["1874"])
    assert contains_match("It crosses the River Leddon", ["the River Leddon"])
    assert not contains_match("It was 18745 years ago", ["1874"])  # word boundaries
    assert not contains_match("", ["1874"]) and not contains_match("anything", [])
    assert answer_metrics(["in 1874", "no idea"], [["1874"], ["Crane"]])["contains"] == 0.5
