"""The reliability soak (``tests/reliability/test_soak.py``) as a suite: its figures as a result.

Runs the soak as CI would run it by hand (``KVSTORE_SOAK=1 python -m pytest -q -s
tests/reliability/test_soak.py``), its options being the arguments given here (the soak's own,
passed in ``KVSTORE_SOAK_ARGS``; ``--out`` is a scratch folder) and writes its ``results.json``
through benchlib: the soak's options as parameters, the platform and LMDB version beside the
machine, and every claim's trials in ``notes`` (``fuzz``, ``corruption``, ``kill``, ``sigint``,
``concurrency``). What the soak checks: docs/reliability.md. Exits with pytest's status (the
result is written either way; the runner keeps it only when every claim held).

Command (from the repository root; the suite ``reliability``: ``python -m experiments run reliability
[ARGS]`` writes experiments/results/reliability.json; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/reliability_soak.py       # ~10-15 min on 2 busy cores
    .venv/bin/python experiments/reliability_soak.py --kill-trials 8 --corruptions 100 --fuzz-cases 500 \\
        --concurrency-runs 1 --sigint-trials 2 --real-trials 1      # smoke test, ~1.5 min
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib as bl

bl.use_test_helpers()  # the soak's own option parser, and the helpers it imports

from reliability.test_soak import parse_args  # noqa: E402


def main() -> None:
    args = bl.start(bl.parser(__doc__, quick=False), rest=True)  # every other argument is the soak's
    soak_args = args.rest
    options = vars(parse_args(soak_args))  # a wrong option stops here, not ten minutes in
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as out:
        env = os.environ | {"KVSTORE_SOAK": "1", "KVSTORE_SOAK_ARGS": shlex.join([*soak_args, "--out", out]),
                            "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
        test = bl.ROOT / "tests" / "reliability" / "test_soak.py"
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", str(test)], cwd=bl.ROOT, env=env).returncode
        results = Path(out) / "results.json"
        if results.exists():
            res = json.loads(results.read_text())
            soak_machine = res.pop("machine")
            res.pop("command")
            params = {k: v for k, v in options.items() if k not in ("out", "workdir")} | {"seed": res.pop("seed")}
            extra = {k: soak_machine[k] for k in ("platform", "lmdb") if k in soak_machine}
            bl.write_result("reliability", params=params, rows=[], notes=res, machine=extra)
    sys.exit(rc)


if __name__ == "__main__":
    main()
