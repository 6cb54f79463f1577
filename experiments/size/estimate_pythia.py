"""Estimated KV bytes of the Pythia suite (``kvstore size``): the figures and the plot in docs/cli.md.

Runs ``kvstore size --dtype all --format json --plot`` (no weights are loaded: the estimate reads
each model's config; 8 Pythia models x 225 contexts x 2048 tokens by default) and writes what it
prints through benchlib: one row per model and dtype, the estimate's inputs (``seq_len``,
``examples``, ``dtypes``, ``codec``) as parameters, its formula and notes beside them. The plot
goes to ``size_pythia.png`` beside the result.

Command (from the repository root; the suite ``size_pythia``: ``python -m experiments run size_pythia``
writes experiments/results/size_pythia.{json,png}; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/size/estimate_pythia.py

Deterministic: the same configs give the same bytes on every run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # experiments/, for benchlib

import benchlib as bl  # noqa: E402


def main() -> None:
    bl.start(bl.parser(__doc__, quick=False))
    plot = bl.RESULTS / "size_pythia.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "kvstore.cli.main", "size", "--dtype", "all", "--format", "json", "--plot", str(plot)]
    estimate = json.loads(subprocess.run(cmd, cwd=bl.ROOT, capture_output=True, text=True, check=True).stdout)
    rows = estimate.pop("estimated")
    params = {k: estimate.pop(k) for k in ("seq_len", "examples", "dtypes", "codec")}
    bl.write_result("size_pythia", params=params, rows=rows, notes=estimate)


if __name__ == "__main__":
    main()
