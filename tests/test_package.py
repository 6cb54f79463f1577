"""Package-level promises: a light import, the public names, a fast `kvstore --help`."""

from __future__ import annotations

import subprocess
import sys

import kvstore


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_import_kvstore_pulls_in_no_cli_or_heavy_modules():
    loaded = _modules_after("import kvstore")
    assert not {"click", "tqdm", "matplotlib", "torch", "transformers"} & loaded


def test_library_never_imports_click_even_when_used():
    loaded = _modules_after(
        "import kvstore; kvstore.KVStore; kvstore.Adapter; kvstore.load_dataset; kvstore.estimate_size"
    )
    # (tqdm arrives with transformers' own imports, so it is checked in the source below)
    assert "torch" in loaded and not {"click", "matplotlib"} & loaded


def test_library_source_has_no_cli_imports():
    """No kvstore module imports click or tqdm; matplotlib only inside the plot function."""
    import ast
    from pathlib import Path

    for path in Path(kvstore.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    root = name.split(".")[0]
                    assert root not in ("click", "tqdm"), f"{path.name} imports {name}"
                    if root == "matplotlib":
                        assert node.col_offset > 0, f"{path.name} imports matplotlib at module level"


def test_help_lists_commands_without_torch():
    loaded = _modules_after("import kvstore.cli.main; kvstore.cli.main.app.main(['--help'], standalone_mode=False)")
    assert "torch" not in loaded and "transformers" not in loaded
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("build", "sample", "ls", "stats", "verify", "rm", "gc", "size"):
        assert f"  {command} " in out


def test_public_names_resolve():
    for name in kvstore.__all__:
        assert getattr(kvstore, name) is not None


def test_setup_cfg_lists_every_package():
    """setup.cfg names its packages one by one (cli/ installs as kvstore.cli): a new subpackage
    that is not listed would be missing from a non-editable install."""
    import configparser
    from pathlib import Path

    root = Path(kvstore.__file__).parent
    cfg = configparser.ConfigParser()
    cfg.read(root.parent / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {"kvstore." + ".".join(p.parent.relative_to(root).parts) for p in root.rglob("__init__.py")}
    found = {name.rstrip(".") for name in found} | {"kvstore.cli"}
    assert listed == found
    assert cfg["options"]["package_dir"].split() == ["kvstore.cli", "=", "cli"]
    assert cfg["options.entry_points"]["console_scripts"].strip() == "kvstore = kvstore.cli.main:main"


def test_python_dash_m_kvstore_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "kvstore", "--help"], capture_output=True, text=True, check=True).stdout
    assert "build" in out and "sample" in out


def test_every_module_all_names_exist():
    """``from kvstore.X import *`` works for every library module: ``__all__`` names only what exists."""
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(kvstore.__path__, "kvstore."):
        if info.name.startswith("kvstore.cli") or info.name == "kvstore.__main__":
            continue
        module = importlib.import_module(info.name)
        missing = [n for n in getattr(module, "__all__", []) if not hasattr(module, n)]
        assert not missing, (info.name, missing)
