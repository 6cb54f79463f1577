"""The CLI's one table renderer (kvstore.cli.table): alignment, unit columns and blank rows, as
``kvstore ls`` / ``stats`` and ``kvstore size`` print them."""

from __future__ import annotations

from kvstore.cli import common, size
from kvstore.cli.table import render_table


def test_unit_columns_and_blank_rows():
    text = render_table(
        [["smollm2", "46,080", "(45.0 KiB)"], None, ["a-much-longer-name", "5", "(5 B)"]],
        ["model", "bytes/token", ""],
        "lrl",
    )
    assert text.split("\n") == [
        "model                     bytes/token",  # a number's title sits right, over number and unit
        "smollm2             46,080 (45.0 KiB)",
        "",
        "a-much-longer-name       5 (5 B)",
    ]


def test_a_title_wider_than_its_cells_widens_the_column():
    assert render_table([["1", "(1 B)"], ["22", "(2 B)"]], ["per example", ""], "rl").split("\n") == [
        "per example",
        "    1 (1 B)",
        "   22 (2 B)",
    ]


def test_default_alignment_follows_the_cells():
    assert render_table([["a", 1, 1.5], ["bb", None, None]], ["n", "count", "r"]).split("\n") == [
        "n   count     r",
        "a       1  1.50",
        "bb      -     -",
    ]


def test_one_renderer():
    assert common.render_table is render_table and size.render_table is render_table
