"""Where things are, for every test module wherever it sits under tests/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout
TESTS = REPO / "tests"
GOLDEN = TESTS / "golden"  # files pinning the entry format and keys (never edited by hand)
FIXTURES = TESTS / "fixtures"  # small dataset files
DEMO = REPO / "experiments" / "data" / "demo.jsonl"  # the demo dataset (make demo)

__all__ = ["DEMO", "FIXTURES", "GOLDEN", "REPO", "TESTS"]
