"""The one shape every committed benchmark result has (``experiments/results/*.json``).

A result is a JSON object with exactly these keys:

* ``suite``: the suite that produces it (``python -m experiments list``);
* ``part``: which of the suite's outputs it is (``null`` for a suite with one output);
* ``version``: the version of this schema (:data:`VERSION`);
* ``git_sha``: the commit the run was taken at (``+dirty`` when the tree had changes); for a result
  converted from an older file, the commit that last wrote that file (``notes.converted_from``);
* ``command``: the exact command that produced the numbers;
* ``params``: the options the run used (the script's arguments, as far as it recorded them);
* ``machine``: where and under what load it ran: ``cpu``, ``cores``, ``mem_gib``, ``gpu``, ``torch``,
  ``transformers``, ``load_before``, ``load_after`` (``null`` where a run did not record one), plus
  whatever else the script recorded (``date``, ``torch_threads``, ``python``...);
* ``rows``: the measurements, one object per row (``[]`` when a result is a set of totals);
* ``notes``: everything else the run recorded (totals, per-trial lists, texts), never dropped.

Nothing here imports torch: the report and the tests read results without it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

VERSION = 1
KEYS = ("suite", "part", "version", "git_sha", "command", "params", "machine", "rows", "notes")
MACHINE_KEYS = ("cpu", "cores", "mem_gib", "gpu", "torch", "transformers", "load_before", "load_after")

HERE = Path(__file__).resolve().parent.parent  # experiments/
ROOT = HERE.parent
RESULTS = HERE / "results"


class SchemaError(ValueError):
    """A result file that does not have the shape above."""


def make(
    suite: str,
    part: str | None,
    command: str,
    params: dict,
    machine: dict,
    rows: list,
    notes: dict,
    git_sha: str,
) -> dict:
    """A result in the schema, keys in their documented order (``machine`` completed with nulls)."""
    doc = {
        "suite": suite,
        "part": part,
        "version": VERSION,
        "git_sha": git_sha,
        "command": command,
        "params": params,
        "machine": {k: machine.get(k) for k in MACHINE_KEYS} | machine,
        "rows": rows,
        "notes": notes,
    }
    check(doc)
    return doc


def check(doc: Any, where: str = "result") -> None:
    """Raise :class:`SchemaError` unless ``doc`` is a result in the schema."""
    if not isinstance(doc, dict):
        raise SchemaError(f"{where}: not a JSON object")
    if tuple(doc) != KEYS:
        raise SchemaError(f"{where}: keys {list(doc)}, expected {list(KEYS)}")
    if doc["version"] != VERSION:
        raise SchemaError(f"{where}: schema version {doc['version']!r}, this code reads {VERSION}")
    for key in ("suite", "git_sha", "command"):
        if not isinstance(doc[key], str) or not doc[key]:
            raise SchemaError(f"{where}: {key} must be a non-empty string")
    if doc["part"] is not None and not isinstance(doc["part"], str):
        raise SchemaError(f"{where}: part must be a string or null")
    for key in ("params", "machine", "notes"):
        if not isinstance(doc[key], dict):
            raise SchemaError(f"{where}: {key} must be an object")
    missing = [k for k in MACHINE_KEYS if k not in doc["machine"]]
    if missing:
        raise SchemaError(f"{where}: machine lacks {missing}")
    if not isinstance(doc["rows"], list) or not all(isinstance(r, dict) for r in doc["rows"]):
        raise SchemaError(f"{where}: rows must be a list of objects")


def load(path: Path) -> dict:
    """Read and check one result file."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SchemaError(f"{path}: cannot read ({e})") from e
    check(doc, str(path))
    return doc


def write(path: Path, doc: dict) -> None:
    check(doc, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


# -- facts about the run, gathered without torch ----------------------------------------------------
def git_sha(root: Path = ROOT) -> str:
    """HEAD's commit, ``+dirty`` when tracked files differ from it; ``unknown`` outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def last_commit(path: Path, root: Path = ROOT) -> str:
    """The commit that last changed ``path`` (for results converted from older files)."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%H", "--", str(path)], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    return out or "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    """This machine as the runner sees it (no torch import: package versions from their metadata).
    ``load_after`` is filled in when the run ends."""
    cpu, mem = platform.processor() or platform.machine(), None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem,
        "gpu": None,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "load_before": loadavg(),
        "load_after": None,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
