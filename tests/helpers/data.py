"""Dataset files for tests: rows of the demo set, and JSON Lines files written from rows."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.paths import DEMO


def padded_demo_rows(n_contexts: int = 8) -> list[dict]:
    """Rows of the demo set over ``n_contexts`` distinct contexts whose token lengths differ by
    more than 2x: every other context is cut to its first paragraph (~100 vs ~330 SmolLM2 tokens),
    so batches of them need real left padding. Two questions per context, the first one repeated
    on the cut contexts too (the answer may no longer be in the text; exactness does not care)."""
    rows = [json.loads(line) for line in DEMO.read_text().splitlines() if line.strip()]
    by_context: dict[str, list[dict]] = {}
    for r in rows:
        by_context.setdefault(r["context"], []).append(r)
    out = []
    for i, (context, qs) in enumerate(list(by_context.items())[:n_contexts]):
        text = context.split("\n\n")[0] if i % 2 else context
        for j, r in enumerate(qs[:2]):
            out.append({"id": f"{r['id']}-{'cut' if i % 2 else 'full'}-{j}", "context": text, "question": r["question"],
                        "answers": r["answers"]})  # fmt: skip
    return out


def write_rows(path: Path, rows: list[dict | str]) -> Path:
    """A JSON Lines file of ``rows``, one per line; a string row is written as it is (a broken
    line, on purpose)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path
