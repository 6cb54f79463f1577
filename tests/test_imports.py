"""The library's shape: no import cycle in ``kvstore/`` or ``cli/``, no module over 500 lines, no
function over 8 parameters, one home per public name, layer kinds spelled in one table, options
declared once.

The import graph is read from the source with :mod:`ast` (nothing is imported): every ``import``
and ``from ... import`` counts, at module level, inside functions and under ``if TYPE_CHECKING:``
(an annotation-only import is still a dependency a reader follows). ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module, else to ``pkg``. Importing ``a.b.c`` also runs
``a/__init__`` and ``a/b/__init__``, but those implicit edges are left out: a package whose
``__init__`` re-exports a child would otherwise be in a "cycle" with every child that imports a
sibling, which is not the knot this check is for. The ``cli/`` folder installs as ``kvstore.cli``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.paths import REPO

ROOTS = {"kvstore": REPO / "kvstore", "kvstore.cli": REPO / "cli"}
MAX_LINES = 500

# Allowed import cycles, each the set of modules in one strongly connected component: none, and
# an entry that no longer exists fails the test, so the list cannot go stale.
KNOWN_CYCLES: set[frozenset[str]] = set()

# Modules allowed over MAX_LINES (none).
KNOWN_LONG: set[str] = set()


# No function in kvstore/ or cli/ (click commands included, counted by their Python parameters) takes
# more than MAX_PARAMS parameters: functions with many knobs take an options object. Exempt: the
# constructors of frozen options dataclasses (generated) and the public methods whose option keywords
# come from an options class (``takes_options``), counted without them. KNOWN_MANY_PARAMS: the
# exceptions, each with why; a stale entry fails.
MAX_PARAMS = 8
KNOWN_MANY_PARAMS: dict[str, str] = {}
# package facades whose __all__ re-exports what their modules define
FACADES = {"kvstore", "kvstore.store.codecs"}
# the layer kinds as written on disk: spelled only in kvstore/facts.py
KIND_NAMES = {"sliding", "chunked", "hybrid"}


def module_files() -> dict[str, Path]:
    """Every module name under the roots, mapped to its file."""
    out: dict[str, Path] = {}
    for root_name, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([root_name, *parts])] = path
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import node, ``if TYPE_CHECKING:`` blocks included."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies inside (``a.b.func`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of kvstore/cli it imports (any depth in the file, TYPE_CHECKING included)."""
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base_parts = package.split(".")
                    if node.level > 1:
                        base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts)
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                if base == "cli" or base.startswith("cli."):
                    base = "kvstore." + base  # the cli/ folder is the kvstore.cli package
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in component)
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges)


def test_cycle_finder_finds_every_component() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(sorted(c) for c in cycles(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_import_walk_counts_function_level_and_type_checking() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import x\nelse:\n    import y\n"
        "def f():\n    from . import z\n"
    )
    names = sorted(
        alias.name if isinstance(node, ast.Import) else f"{'.' * node.level}{node.module or ''}:{alias.name}"
        for node in _imports(tree)
        for alias in node.names
    )
    assert names == [".:z", "typing:TYPE_CHECKING", "x", "y"]


def test_graph_resolves_relative_submodule_and_cli_imports() -> None:
    graph = import_graph()
    # `from kvstore import dtypes` names a module: the edge goes to it, not to the package
    assert "kvstore.dtypes" in graph["kvstore.cli.flags"]
    assert "kvstore.store.backends.lmdb" in graph["kvstore.store.backends.tiered"]
    assert "kvstore.store.backends.tiered" in graph["kvstore.store.backends"]  # inside a function
    assert "kvstore.cli.common" in graph["kvstore.cli.workflow"]  # the cli/ folder is kvstore.cli


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    unexpected = [c for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(_describe(c, graph) for c in unexpected)
    stale = [c for c in KNOWN_CYCLES if c not in found]
    assert not stale, "allow-listed cycles that no longer exist (remove them): " + repr(stale)


@pytest.mark.parametrize("name", sorted(module_files()))
def test_module_size(name: str) -> None:
    lines = len(module_files()[name].read_text().splitlines())
    if name in KNOWN_LONG:
        return
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}): split it into cohesive modules"


def _functions(tree: ast.AST):
    """``(class name or None, function node)`` for every function of a module."""
    owner: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                owner[id(item)] = node.name
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield owner.get(id(node)), node


def _is_options_taker(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``takes_options(...)``: its option keywords come from an options class."""
    for d in fn.decorator_list:
        call = d.func if isinstance(d, ast.Call) else d
        if getattr(call, "id", getattr(call, "attr", None)) == "takes_options":
            return True
    return False


def test_no_function_takes_more_than_eight_parameters() -> None:
    """Functions with many knobs take an options object; click commands take the objects their flags
    build (``cli/flags.py:receives``)."""
    long, seen = [], set()
    for name, path in module_files().items():
        for cls, fn in _functions(ast.parse(path.read_text())):
            a = fn.args
            params = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            n = len(params) + bool(a.vararg) + bool(a.kwarg)
            where = f"{name}:{cls + '.' if cls else ''}{fn.name}"
            public_taker = _is_options_taker(fn) and not fn.name.startswith("_")
            if n > MAX_PARAMS and not public_taker:
                if where in KNOWN_MANY_PARAMS:
                    seen.add(where)
                else:
                    long.append(f"{where} (line {fn.lineno}): {n}")
    assert not long, f"functions over {MAX_PARAMS} parameters (take an options object):\n" + "\n".join(long)
    stale = set(KNOWN_MANY_PARAMS) - seen
    assert not stale, f"allow-listed functions that no longer take over {MAX_PARAMS} parameters: {sorted(stale)}"


def test_the_parameter_count_sees_click_commands() -> None:
    """A click command counts by its Python parameters: the objects it receives."""
    tree = ast.parse((REPO / "cli" / "workflow.py").read_text())
    sample = next(fn for _, fn in _functions(tree) if fn.name == "sample")
    assert [a.arg for a in sample.args.args] == ["data", "model", "prompting", "options", "sweep", "store", "report"]


def test_every_public_name_is_exported_by_one_module() -> None:
    """A name in two modules' ``__all__`` would have two homes (package facades aside)."""
    homes: dict[str, list[str]] = {}
    for name, path in module_files().items():
        if name in FACADES:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                for exported in ast.literal_eval(node.value):
                    homes.setdefault(exported, []).append(name)
    twice = {n: ms for n, ms in homes.items() if len(ms) > 1}
    assert not twice, f"names exported by more than one module: {twice}"


def test_layer_kind_names_are_spelled_only_in_the_facts_table() -> None:
    found = []
    for name, path in module_files().items():
        if name == "kvstore.facts":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in KIND_NAMES:
                found.append(f"{name}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Compare):  # kind == "attn" / "state"
                sides = [node.left, *node.comparators]
                kinds = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "kind"]
                words = [s for s in sides if isinstance(s, ast.Constant) and s.value in ("attn", "state")]
                if kinds and words:
                    found.append(f"{name}:{node.lineno} kind compared with {words[0].value!r}")
    assert not found, "layer kinds spelled outside kvstore/facts.py:\n" + "\n".join(found)


def test_the_dense_variant_is_recognised_by_one_parser() -> None:
    """``dense`` is one word of the decode-attention parser (``variants/sparse.py``): every other
    reader (the variant parser, lm-eval's ``press`` arg) asks that parser, none compares a spec with
    the word itself."""
    found = []
    for name, path in module_files().items():
        if name == "kvstore.model.variants.sparse":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                words = [s for s in sides if ast.unparse(s) == "'dense'" or ast.unparse(s).endswith("DENSE_NAME")]
                if words:
                    found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not found, "specs compared with 'dense' outside the attention parser:\n" + "\n".join(found)


def _takers():
    """Every public method of the Adapter (and lm-eval's model) that takes an options class."""
    from kvstore.model.adapter import Adapter

    out = [getattr(Adapter, m) for m in dir(Adapter) if not m.startswith("_")]
    out = [fn for fn in out if getattr(fn, "__options__", None) is not None]
    assert {fn.__name__ for fn in out} >= {"build", "sample", "sweep", "greedy_sample", "score", "score_sweep",
                                           "score_rolling"}  # fmt: skip
    return out


def test_every_options_field_is_a_visible_keyword_of_each_method_that_takes_it() -> None:
    """``inspect.signature`` and ``help()`` show every field of the options class as a keyword (with
    its default, which lives in the options class only) and its line of doc; no ``**kwargs``."""
    import dataclasses
    import inspect

    for fn in _takers():
        cls = fn.__options__
        params = inspect.signature(fn).parameters
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), fn.__name__
        for f in dataclasses.fields(cls):
            assert f.name in params and params[f.name].default == f.default, (fn.__name__, f.name)
            assert f"``{f.name}``" in fn.__doc__ and f.metadata["doc"] in fn.__doc__, (fn.__name__, f.name)
        assert params["options"].default is None, fn.__name__
    from kvstore.model.adapter import Adapter

    assert list(inspect.signature(Adapter.greedy_sample).parameters)[:4] == [
        "self", "contexts", "questions", "num_new_tokens"
    ]  # greedy_sample(contexts, questions, 20, ...), as the research code calls it  # fmt: skip


def test_each_method_types_its_option_keywords_for_the_type_checker() -> None:
    """Each method that takes an options class declares ``**fields: Unpack[K]`` (PEP 692), ``K`` a
    ``TypedDict`` naming exactly the class's fields (less the one it takes positionally), so mypy
    checks every keyword of every call and the two declarations cannot drift apart."""
    import dataclasses
    import importlib
    import inspect
    import typing

    for fn in _takers():
        written = inspect.signature(fn.__wrapped__)
        var = [p for p in written.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert len(var) == 1 and var[0].annotation.startswith("Unpack["), (fn.__name__, var)
        name = var[0].annotation.removeprefix("Unpack[").removesuffix("]")
        keywords = getattr(importlib.import_module(fn.__module__), name)
        assert typing.is_typeddict(keywords) and not keywords.__required_keys__, name
        fields = {f.name for f in dataclasses.fields(fn.__options__)}
        positional = {p for p in fields if p in written.parameters}
        assert set(keywords.__optional_keys__) == fields - positional, (fn.__name__, name)


def _mypy_errors(code: str, tmp_path) -> str:
    """mypy's report on ``code`` calling this checkout's kvstore (skipped without mypy)."""
    import subprocess
    import sys

    pytest.importorskip("mypy")
    (tmp_path / "snippet.py").write_text(code)
    env = {**__import__("os").environ, "MYPYPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-version", "3.10", "--ignore-missing-imports",
         "--follow-imports=silent", "--no-site-packages", "--cache-dir", str(tmp_path / "cache"), "snippet.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return run.stdout + run.stderr


def test_mypy_finds_a_misspelt_or_mistyped_option_keyword(tmp_path) -> None:
    """The type checker sees the methods' option keywords: a misspelt one and a wrongly typed one
    are errors naming them; well-formed calls (the positional ``greedy_sample(..., 5)`` too) pass."""
    out = _mypy_errors(
        "from kvstore import Adapter, KVStore\n\n\n"
        "def f(a: Adapter, s: KVStore) -> None:\n"
        "    a.sample(['c'], ['q'], store=s, max_new_tokns=3)\n"
        "    a.score(['c'], ['x'], token_logprobs='yes')\n"
        "    a.greedy_sample(['c'], ['q'], 5, store=s, batch_size=2)\n"
        "    a.build(['c'], s, presses=['kvzip:0.5'], dense=False)\n"
        "    a.sample(['c'], ['q'], num_new_tokens=3, press='snapkv:0.5')\n",
        tmp_path,
    )
    assert 'snippet.py:5: error: Unexpected keyword argument "max_new_tokns"' in out, out
    assert 'snippet.py:6: error: Argument "token_logprobs"' in out, out
    assert "Found 2 errors" in out, out


def test_options_fields_are_written_once() -> None:
    """No function in kvstore/ or cli/ declares a parameter named like an options field with a
    literal default of its own (the options class holds it; the one field a method takes
    positionally, ``takes_options(first=...)``, is declared where it comes with a default of None),
    and no options class is built field by field from loose values in the Adapter (``_given(...)``)."""
    import dataclasses

    from kvstore.model.options import BuildOptions, SampleOptions, ScoreOptions

    names = {f.name for cls in (BuildOptions, SampleOptions, ScoreOptions) for f in dataclasses.fields(cls)}
    found = []
    adapter = (REPO / "kvstore" / "model" / "adapter.py").read_text()
    for fn in (f for _, f in _functions(ast.parse(adapter))):
        a = fn.args
        declared = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        firsts = {k.value.value for d in fn.decorator_list if isinstance(d, ast.Call) for k in d.keywords
                  if k.arg == "first" and isinstance(k.value, ast.Constant)}  # fmt: skip
        positional = dict(zip([x.arg for x in a.posonlyargs + a.args][::-1], a.defaults[::-1]))
        firsts = {n for n in firsts if isinstance(positional.get(n), ast.Constant) and positional[n].value is None}
        found += [f"adapter.py:{fn.name} declares {n}" for n in sorted(declared & names - firsts)]
    assert "_given(" not in adapter
    for name, path in module_files().items():
        if name == "kvstore.model.options":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") in {"SampleOptions", "ScoreOptions", "BuildOptions"}
                and node.args
            ):
                found.append(f"{name}:{node.lineno} builds {node.func.id} positionally")  # type: ignore[attr-defined]
    assert not found, "\n".join(found)


def test_the_cli_passes_no_call_more_than_ten_positional_arguments() -> None:
    """The CLI builds its values by name (``RunOptions(dataset, context_field, ...)`` with 20
    positional arguments could be read by position only)."""
    found = []
    for name, path in module_files().items():
        if not name.startswith("kvstore.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and len(node.args) > 10:
                found.append(f"{name}:{node.lineno} ({len(node.args)} positional arguments)")
    assert not found, "\n".join(found)


MAX_POSITIONAL = 8


def test_the_library_passes_no_call_more_than_eight_positional_arguments() -> None:
    """Results, plans and infos are built by keyword in kvstore/ (``SampleResult(tokens, lengths,
    ...)`` with 15 positional arguments, ``DerivedInfo(`` with 18, could be read by position only:
    a field added in the middle shifts every one after it without an error)."""
    found = []
    for path in ROOTS["kvstore"].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} ({len(node.args)} positional arguments)")
    assert not found, "\n".join(found)


def test_cache_paths_narrow_no_type_at_run_time() -> None:
    """A cache path's prepared batch has its type (``CachePath`` is generic in what ``prepare``
    returns): no ``assert isinstance`` in kvstore/model/paths/ to recover it."""
    found = []
    for path in (ROOTS["kvstore"] / "model" / "paths").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Assert)
                and isinstance(node.test, ast.Call | ast.BoolOp)
                and "isinstance(" in ast.unparse(node.test)
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


def test_process_wide_state_lives_in_one_documented_place() -> None:
    """No ``global`` statement in kvstore/ or cli/: what is process-wide is a field of the objects in
    kvstore/process.py, whose docstring names each user (docs/architecture.md: no module-level
    switches besides those)."""
    found = []
    for root in ROOTS.values():
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Global):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} global {', '.join(node.names)}")
    assert not found, found
    doc = (REPO / "kvstore" / "process.py").read_text()
    for user in ("kvstore.model.compute.attention", "kvstore.model.variants.hooks", "kvstore.parallel",
                 "kvstore.store.backends.lmdb_env"):  # fmt: skip
        assert user in doc, user


# -- entry kinds are one table (issue 40) ------------------------------------------------------------
OWNED_KIND_NAMES = {"scores", "pressed"}  # the built-in kinds of entry a context owns, by name
OWNED_KIND_CONSTANTS = {"SCORES", "PRESSED"}


def _compared_words(node: ast.Compare) -> list[str]:
    out = []
    for side in [node.left, *node.comparators]:
        parts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        for p in parts:
            if isinstance(p, ast.Name) and p.id in OWNED_KIND_CONSTANTS:
                out.append(p.id)
            elif isinstance(p, ast.Constant) and p.value in OWNED_KIND_NAMES:
                out.append(repr(p.value))
    return out


def test_no_code_branches_on_a_kind_of_owned_entry() -> None:
    """What differs between kinds of entry is each kind's (kvstore/store/kinds.py and its row's
    module): no comparison with ``SCORES``/``PRESSED`` or their names anywhere in kvstore/ or cli/,
    so that a new kind is one module and one table row."""
    found = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and (words := _compared_words(node)):
                found.append(f"{name}:{node.lineno} compares with {', '.join(words)}")
    assert not found, "kind branches (ask the kind object instead):\n" + "\n".join(found)


# The names store/ had for the entries a context owns when they were "derived entries", kept as
# deprecated aliases for one release (then deleted, and this list with them); DERIVED_FORMAT is
# frame.py's constant. What users read (messages, the CLI's --derived, JSON keys) keeps its words.
DEPRECATED_DERIVED_NAMES = {
    "DERIVED", "DERIVED_FORMAT", "DerivedFacts", "DerivedHeader", "DerivedInfo", "DerivedLayer",
    "DerivedStats", "DerivedView", "all_derived", "copied_derived", "decode_derived", "derived", "derived_bad",
    "derived_bytes", "derived_corrupt", "derived_entry_key", "derived_key_of", "derived_keys", "derived_local",
    "derived_of", "derived_prefix", "derived_totals", "has_derived", "open_derived", "orphan_derived",
    "put_derived", "read_derived_header",
}  # fmt: skip
DEPRECATED_DERIVED_MODULES = {"derived.py", "derived_header.py"}  # kvstore.store.owned, owned_header


def _identifiers(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg
        elif isinstance(node, ast.alias):
            yield from (node.name.rpartition(".")[2], node.asname or "")


def test_the_store_says_owned_for_what_a_context_owns() -> None:
    """One word per concept: no name in kvstore/store/ says "derived" (modules, functions, classes,
    attributes, variables) but the deprecated aliases (DEPRECATED_DERIVED_NAMES, each still
    defined: a stale entry fails)."""
    found, modules = set(), set()
    for path in (REPO / "kvstore" / "store").rglob("*.py"):
        if "derived" in path.name:
            modules.add(path.name)
        found |= {n for n in _identifiers(ast.parse(path.read_text())) if "derived" in n.lower()}
    assert found - DEPRECATED_DERIVED_NAMES == set(), "say owned (the word store/ uses for what a context owns)"
    assert DEPRECATED_DERIVED_NAMES - found == set(), "stale DEPRECATED_DERIVED_NAMES entries"
    assert modules == DEPRECATED_DERIVED_MODULES


def test_the_deprecated_names_are_the_new_ones() -> None:
    """The old names (one release) read the same objects as the new."""
    from kvstore.store import derived, derived_header, kind_pressed, owned, owned_header
    from kvstore.store.infos import DerivedInfo, OwnedInfo
    from kvstore.store.kvstore import KVStore
    from kvstore.store.removal import GcPlan, Planned

    assert derived.DerivedView is owned.OwnedView and derived.decode_derived is owned.decode_owned
    assert derived.DerivedFacts is owned_header.OwnedFacts is derived_header.DerivedFacts
    assert derived.encode_pressed is kind_pressed.encode_pressed and DerivedInfo is OwnedInfo
    assert KVStore.derived_keys is KVStore.owned_keys
    plan = GcPlan((Planned("b", "corrupt: x", 3, "c", ""), Planned("k", "asked for", 2)), 0,
                  tier_copies=(Planned("t", "bad", 1),))  # fmt: skip
    assert plan.remove == (("k", "asked for", 2),) and plan.derived == (("c", "b", "corrupt: x", 3),)
    assert plan.local == (("t", "bad", 1),) and not plan.derived_local
    assert plan.derived_corrupt == {"b"} and not plan.corrupt and plan.freed_bytes == 5 and plan.n == 2


KIND_WORDS = ("derived", "scores", "pressed", "chunk")  # words that name one kind of entry


def test_a_removal_plan_has_no_field_named_for_one_kind() -> None:
    """``GcPlan`` holds rows of every kind (``Planned``: the kind a field of the row), not one
    field per kind (``derived``, ``derived_local``, ``pressed_only``... are read-only aliases)."""
    import dataclasses

    from kvstore.store.removal import GcPlan, Planned

    for cls in (GcPlan, Planned):
        named = [f.name for f in dataclasses.fields(cls) if any(w in f.name for w in KIND_WORDS)]
        assert not named, f"{cls.__name__} fields named for one kind: {named}"


def test_the_kind_table_rows_name_their_kinds() -> None:
    """Each row of the kind table resolves to an object of that name (the table is not imported
    by its modules: it names them)."""
    from kvstore.store.kinds import BUILTIN_KINDS, find_kind

    for name in BUILTIN_KINDS:
        kind = find_kind(name)
        assert kind is not None and kind.name == name


MAX_FUNCTION_LINES = 70


def test_no_function_is_over_seventy_lines() -> None:
    """No function in kvstore/ or cli/ over MAX_FUNCTION_LINES lines (its ``def`` to its last line,
    docstring included): a longer one is several steps, each worth a name (``plan_gc`` is one
    function per criterion, merged at the end)."""
    found = []
    for root in ROOTS.values():
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not found, "\n".join(found)


# The floors of kvstore/model, bottom to top, as docs/architecture.md orders them: a module imports
# from its own floor or below. Packages not named here (options, variants, press, scoring, compose)
# are data or side rooms the floors above compute/ may take, and are not counted.
MODEL_FLOORS = (
    ("handle", "family", "load"),
    ("compute", "io"),
    ("plan",),
    ("stages",),
    ("paths",),
    ("pipelines",),
    ("adapter",),
)
# The arrows that still run back up a floor, each with why (at most two): the handle installs
# grouped-KV attention when it is made, and declares the staging ring it keeps (a type only).
KNOWN_UPWARD = {
    ("kvstore.model.handle", "kvstore.model.compute.attention"),
    ("kvstore.model.handle", "kvstore.model.io.ring"),
}


def model_floor(module: str) -> int | None:
    """The floor of a module of kvstore/model (0 at the bottom), None for one on no floor."""
    parts = module.split(".")
    if parts[:2] != ["kvstore", "model"] or len(parts) < 3:
        return None
    return next((i for i, names in enumerate(MODEL_FLOORS) if parts[2] in names), None)


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The imports (``(importer, imported)``) that run from a floor of kvstore/model to a higher one."""
    found = set()
    for a, targets in graph.items():
        fa = model_floor(a)
        for b in targets:
            fb = model_floor(b)
            if fa is not None and fb is not None and fb > fa:
                found.add((a, b))
    return found


def test_the_floor_count_sees_an_import_back_up() -> None:
    graph = {"kvstore.model.io.writer": {"kvstore.model.plan.batch", "kvstore.model.compute.cache"}}
    assert upward_imports(graph) == {("kvstore.model.io.writer", "kvstore.model.plan.batch")}


def test_imports_inside_the_model_run_down_the_floors() -> None:
    """At most two imports inside kvstore/model run back up a floor, and those are the known ones."""
    found = upward_imports(import_graph())
    assert len(KNOWN_UPWARD) <= 2
    assert found == KNOWN_UPWARD, (
        f"imports back up a floor: {sorted(found - KNOWN_UPWARD)}; stale: {sorted(KNOWN_UPWARD - found)}"
    )


def test_staging_asks_a_stored_tensor_only_what_the_protocol_declares() -> None:
    """The staging ring and the load read a record through ``StoredTensor`` (``device_decode``,
    ``raw_bytes``, ``copy_into``): no ``getattr``/``hasattr`` probe of what it may have."""
    found = []
    for rel in ("kvstore/model/io/staging.py", "kvstore/model/stages/load.py"):
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"getattr", "hasattr"}
            ):
                found.append(f"{rel}:{node.lineno}")
    assert not found, found
