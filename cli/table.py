"""The CLI's one table renderer: aligned plain text, used by every command that prints a table
(``ls``, ``stats``, ``gc`` plans, ``size``...)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def render_table(
    rows: Iterable[Sequence[Any] | None], columns: Sequence[str], align: str | Sequence[str] | None = None
) -> str:
    """An aligned plain-text table: a header line, then one line per row (no trailing newline).

    ``rows``: sequences of cells, in ``columns`` order (``None`` cells show as ``-``, floats with 2
    decimals); a row that is ``None`` is a blank line. A column titled ``""`` is the unit of the
    column before it (``46,080 (45.0 KiB)``): one space apart, under that column's title.
    ``align``: one ``"l"`` or ``"r"`` per column (a string like ``"llrr"`` works); by default a
    column of numbers aligns right and anything else left."""
    table = [None if r is None else list(r) for r in rows]
    body = [r for r in table if r is not None]
    n = len(columns)
    if align is None:
        align = []
        for i in range(n):
            values = [r[i] for r in body if r[i] is not None]
            align.append("r" if values and all(map(_is_number, values)) else "l")
    cells = [None if r is None else [_cell(c) for c in r] for r in table]
    filled = [r for r in cells if r is not None]
    has_unit = [j + 1 < n and columns[j + 1] == "" for j in range(n)]
    widths = [max((len(r[j]) for r in filled), default=0) for j in range(n)]

    def span(j: int) -> int:
        return widths[j] + (1 + widths[j + 1] if has_unit[j] else 0)

    for j, title in enumerate(columns):  # a title wider than its cells (and unit) widens the column
        widths[j] += max(0, len(title) - span(j))

    def pad(text: str, width: int, j: int) -> str:
        return text.rjust(width) if align[j] == "r" else text.ljust(width)

    lines = ["  ".join(pad(columns[j], span(j), j) for j in range(n) if columns[j]).rstrip()]
    for row in cells:
        if row is None:
            lines.append("")
            continue
        lines.append(
            "".join(
                ("" if j == 0 else " " if columns[j] == "" else "  ") + pad(c, widths[j], j) for j, c in enumerate(row)
            ).rstrip()
        )
    return "\n".join(lines)


__all__ = ["render_table"]
