"""kvstore's public names are listed once (``kvstore._LAZY``); ``__all__`` is built from it and the
TYPE_CHECKING imports that type checkers read mirror it exactly."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstore

INIT = Path(kvstore.__file__)


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(INIT.read_text())
    [block] = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"]
    out = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            assert alias.asname == alias.name, "re-export as `X as X` so linters see a public name"
            out[alias.name] = node.module
    return out


def test_type_checking_imports_mirror_the_one_list():
    assert _type_checking_imports() == kvstore._LAZY


def test_all_is_the_one_list():
    assert kvstore.__all__ == ["__version__", *kvstore._LAZY]
    assert set(dir(kvstore)) >= set(kvstore.__all__)


def test_the_names_the_docs_use_to_redefine_a_press_are_public():
    from kvstore import register_press, unregister_press  # docs/presses.md names both

    assert callable(register_press) and callable(unregister_press)
