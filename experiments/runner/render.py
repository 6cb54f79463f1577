"""Render every committed result into one markdown page (``docs/results.md``).

The page is generated: ``python -m experiments report`` writes it and ``report --check`` (run by
``tests/test_docs.py``) fails when it differs from what the committed results give. Cells are
rounded for reading (4 significant digits); the JSON files keep every number as measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import schema
from .suites import SUITES, Suite

PAGE = schema.ROOT / "docs" / "results.md"
MAX_TABLE_ROWS = 80  # longer lists are counted, not printed (the JSON has them)
MAX_CELL = 70


def fmt(v: Any) -> str:
    """One table cell."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        if len(v) > 8:
            return f"{len(v)} values"
        return ", ".join(fmt(x) for x in v)
    if isinstance(v, dict):
        return "; ".join(f"{k}: {fmt(x)}" for k, x in v.items())
    s = str(v).replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= MAX_CELL else s[: MAX_CELL - 1] + "…"


def table(rows: list[dict]) -> str:
    if len(rows) > MAX_TABLE_ROWS:
        return f"({len(rows)} rows: in the JSON file)"
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out += flatten(v, name + ".")
        else:
            out.append((name, v))
    return out


def fields(d: dict) -> str:
    """A ``field | value`` table of an object; lists of objects become their own tables."""
    plain, tables = [], []
    for name, v in flatten(d):
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            tables.append(f"`{name}`:\n\n{table(v)}")
        else:
            plain.append((name, v))
    parts = []
    if plain:
        parts.append("| field | value |\n|---|---|\n" + "\n".join(f"| {n} | {fmt(v)} |" for n, v in plain))
    return "\n\n".join(parts + tables)


def machine_line(m: dict) -> str:
    known = [f"{k}: {fmt(m[k])}" for k in schema.MACHINE_KEYS if m.get(k) is not None]
    extra = [f"{k}: {fmt(v)}" for k, v in m.items() if k not in schema.MACHINE_KEYS and v is not None]
    return "; ".join(known + extra)


def result_section(path: Path, doc: dict) -> str:
    rel = path.relative_to(schema.ROOT).as_posix()
    title = f"`{doc['suite']}`" + (f" part `{doc['part']}`" if doc["part"] else "")
    out = [
        f"### {title}: [{rel}](../{rel})",
        "",
        f"- command: `{doc['command']}`",
        f"- commit: `{doc['git_sha']}`",
        f"- machine: {machine_line(doc['machine'])}",
    ]
    if doc["params"]:
        out.append("- params: " + fmt(doc["params"]))
    out.append("")
    if doc["rows"]:
        out += [table(doc["rows"]), ""]
    if doc["notes"]:
        out += ["Notes:", "", fields(doc["notes"]), ""]
    return "\n".join(out)


def suite_section(suite: Suite, results: Path) -> str:
    head = [f"## {suite.name}: {suite.title}", "", f"Script: `{suite.script}`."]
    if suite.needs:
        head[-1] += f" Needs {suite.needs}."
    head.append("")
    paths = [results / f"{o}.json" for o in suite.outputs]
    present = [p for p in paths if p.exists()]
    if not present:
        head += ["No committed result.", ""]
    for p in present:
        head.append(result_section(p, schema.load(p)))
    return "\n".join(head)


def page(results: Path = schema.RESULTS) -> str:
    out = [
        "# Benchmark results (generated)",
        "",
        "Every committed result in `experiments/results/`, suite by suite, as `python -m experiments report`",
        "renders it (do not edit this page: re-run that command). Cells are rounded to 4 significant",
        "digits; the JSON files hold every number as measured. What the figures mean, and the goals they",
        "were measured against, is in [benchmarks.md](benchmarks.md).",
        "",
    ]
    out += [suite_section(s, results) for s in SUITES]
    return "\n".join(out).rstrip("\n") + "\n"
