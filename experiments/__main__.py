"""The benchmark runner: ``python -m experiments list | run SUITE [--quick] [ARGS...] | report | adopt``.

From the repository root::

    .venv/bin/python -m experiments list                        # suites, their scripts and results
    .venv/bin/python -m experiments run ttft --quick            # smoke run -> cache/bench/quick/ttft.json
    .venv/bin/python -m experiments run ttft --repeats 7        # full run -> experiments/results/ttft.json
    .venv/bin/python -m experiments run e2e --parts sweep       # one part: only e2e_sweep.json changes
    .venv/bin/python -m experiments report                      # docs/results.md from every committed result
    .venv/bin/python -m experiments report --check              # exit 1 if docs/results.md is stale
    .venv/bin/python -m experiments adopt ttft old/ttft.json    # convert a script's own output file

Arguments after the suite name go to its script unchanged (see ``python experiments/SCRIPT.py
--help``). A run writes its results only when the script exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .runner import render, schema
from .runner.suites import SUITES, Suite, by_name, read_raw

RAW = schema.ROOT / "cache" / "bench" / "raw"
QUICK = schema.ROOT / "cache" / "bench" / "quick"


def cmd_list(_: argparse.Namespace) -> int:
    width = max(len(s.name) for s in SUITES)
    for s in SUITES:
        have = [o for o in s.outputs if (schema.RESULTS / f"{o}.json").exists()]
        state = f"{len(have)}/{len(s.outputs)} committed" if s.outputs else ""
        quick = "" if s.quick is not None else "; no --quick"
        needs = f"; needs {s.needs}" if s.needs else ""
        print(f"{s.name:<{width}}  {s.title} [{s.script}; {state}{quick}{needs}]")
    return 0


def raw_outputs(raw_dir: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """The files in ``raw_dir`` that are one of ``names``, with ``_quick`` taken out of their names
    (scripts mark smoke runs so: ``ttft_quick.json``, ``classic_quick_compile.json``)."""
    found = {f.name.replace("_quick", ""): f for f in sorted(raw_dir.iterdir()) if f.is_file()}
    return {name: found[name] for name in names if name in found}


def convert(suite: Suite, raw_dir: Path) -> dict[str, dict]:
    """The suite's raw files in ``raw_dir`` -> output stem -> fields."""
    out: dict[str, dict] = {}
    for name, path in raw_outputs(raw_dir, suite.raw_files).items():
        raw = read_raw(path)
        if isinstance(raw, dict) and tuple(raw) == schema.KEYS:  # written by benchlib.write_result
            out[name.rsplit(".", 1)[0]] = raw
        else:
            out |= suite.convert(name.rsplit(".", 1)[0], raw)
    return out


def document(suite: Suite, stem: str, fields: dict, command: str, sha: str, machine: dict) -> dict:
    m = dict(fields["machine"]) or dict(machine)
    for k in ("load_before", "load_after"):  # the runner's own reading where the script took none
        if m.get(k) is None and machine.get(k) is not None:
            m[k] = machine[k]
    return schema.make(suite.name, suite.part(stem), fields.get("command", command), fields["params"], m,
                       fields["rows"], fields["notes"], sha)  # fmt: skip


def merge(suite: Suite, doc: dict, old_path: Path) -> dict:
    """Keep the committed rows of the parts this run did not measure (``merge_rows_by``)."""
    key = suite.merge_rows_by
    if key is None or not old_path.exists():
        return doc
    old = schema.load(old_path)
    ran = {r.get(key) for r in doc["rows"]}
    kept = [r for r in old["rows"] if r.get(key) not in ran]
    if kept:
        doc["rows"] = kept + doc["rows"]
        doc["notes"]["earlier_parts"] = {
            "parts": sorted({str(r.get(key)) for r in kept}),
            "git_sha": old["git_sha"],
            "machine": old["machine"],
        }
    return doc


def cmd_run(args: argparse.Namespace) -> int:
    suite = by_name(args.suite)
    while args.args and args.args[0] in ("--quick", "--out"):  # runner options given after the suite
        if args.args.pop(0) == "--quick":
            args.quick = True
        else:
            args.out = args.args.pop(0)
    extra = list(args.args)
    if args.quick:
        if suite.quick is None:
            print(f"experiments: suite {suite.name} has no quick mode; run it without --quick", file=sys.stderr)
            return 2
        extra = list(suite.quick) + extra
    raw_dir = RAW / suite.name
    shutil.rmtree(raw_dir, ignore_errors=True)
    raw_dir.mkdir(parents=True)
    env = os.environ | {"KVSTORE_BENCH_RAW": str(raw_dir)}
    env |= {k: v.replace("{raw}", str(raw_dir)) for k, v in suite.env.items()}
    argv = [a.replace("{raw}", str(raw_dir)) for a in suite.argv]
    if suite.args_env:
        env[suite.args_env] = " ".join([env.get(suite.args_env, ""), *map(shlex.quote, extra)]).strip()
    else:
        argv += extra
    command = shlex.join(["python", "-m", "experiments", "run", suite.name, *(["--quick"] if args.quick else []),
                          *args.args])  # fmt: skip
    env["KVSTORE_BENCH_COMMAND"] = command  # what benchlib.write_result records as the result's command
    sha, machine = schema.git_sha(), schema.machine()
    print(f"running {shlex.join(argv)} (raw output in {raw_dir})", flush=True)
    stdout = (raw_dir / suite.stdout).open("w") if suite.stdout else None
    try:
        rc = subprocess.run([sys.executable, *argv], cwd=schema.ROOT, env=env, stdout=stdout).returncode
    finally:
        if stdout:
            stdout.close()
    if rc != 0:
        print(f"experiments: {suite.name} exited with {rc}; no result written", file=sys.stderr)
        return rc
    machine["load_after"] = schema.loadavg()
    converted = convert(suite, raw_dir)
    if not converted:
        print(f"experiments: {suite.name} wrote none of {', '.join(suite.raw_files)} in {raw_dir}", file=sys.stderr)
        return 1
    out_dir = Path(args.out) if args.out else (QUICK if args.quick else schema.RESULTS)
    for stem, fields in converted.items():
        path = out_dir / f"{stem}.json"
        doc = fields if tuple(fields) == schema.KEYS else document(suite, stem, fields, command, sha, machine)
        doc = merge(suite, doc, path)
        schema.write(path, doc)
        print(f"wrote {path}")
    for name, path in raw_outputs(raw_dir, suite.artifacts).items():
        target = out_dir / f"{suite.outputs[0]}.{name.rsplit('.', 1)[1]}"
        shutil.copyfile(path, target)
        print(f"wrote {target}")
    if out_dir == schema.RESULTS:
        print("now run: python -m experiments report")
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    """Convert output files a script wrote itself (the old layout) into results."""
    suite = by_name(args.suite)
    out_dir = Path(args.out) if args.out else schema.RESULTS
    for f in map(Path, args.files):
        stem = f.stem[: -len("_quick")] if f.stem.endswith("_quick") else f.stem
        raw = read_raw(f)
        command = raw.get("command") if isinstance(raw, dict) and isinstance(raw.get("command"), str) else None
        sha = schema.last_commit(f)
        for out_stem, fields in suite.convert(stem, raw).items():
            fields["notes"]["converted_from"] = f"{f.as_posix()} at {sha}"
            doc = document(suite, out_stem, fields, command or f"python {suite.script}", sha, {})
            schema.write(out_dir / f"{out_stem}.json", doc)
            print(f"wrote {out_dir / out_stem}.json")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    text = render.page()
    if args.check:
        current = render.PAGE.read_text() if render.PAGE.exists() else ""
        if current != text:
            print(f"experiments: {render.PAGE} is stale; run: python -m experiments report", file=sys.stderr)
            return 1
        print(f"{render.PAGE} is up to date")
        return 0
    render.PAGE.parent.mkdir(parents=True, exist_ok=True)
    render.PAGE.write_text(text)
    print(f"wrote {render.PAGE}")
    return 0


def cmd_check(_: argparse.Namespace) -> int:
    """Every committed result file is in the schema and produced by a suite."""
    produced = {f"{o}.json" for s in SUITES for o in s.outputs}
    produced |= {f"{s.outputs[0]}.{a.rsplit('.', 1)[1]}" for s in SUITES for a in s.artifacts}
    bad = 0
    for path in sorted(schema.RESULTS.iterdir()):
        if path.name not in produced:
            print(f"{path}: no suite produces it", file=sys.stderr)
            bad += 1
        elif path.suffix == ".json":
            try:
                schema.load(path)
            except schema.SchemaError as e:
                print(e, file=sys.stderr)
                bad += 1
    print(json.dumps({"files": len(list(schema.RESULTS.iterdir())), "problems": bad}))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the suites").set_defaults(fn=cmd_list)
    r = sub.add_parser("run", help="run one suite and write its results")
    r.add_argument("suite", choices=[s.name for s in SUITES])
    r.add_argument("--quick", action="store_true", help="the suite's smoke run; results to cache/bench/quick/")
    r.add_argument("--out", help="write results here instead")
    r.add_argument("args", nargs=argparse.REMAINDER, help="passed to the suite's script")
    r.set_defaults(fn=cmd_run)
    rep = sub.add_parser("report", help="render docs/results.md from the committed results")
    rep.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is not what report writes")
    rep.set_defaults(fn=cmd_report)
    c = sub.add_parser("check", help="every committed result file is in the schema and produced by a suite")
    c.set_defaults(fn=cmd_check)
    a = sub.add_parser("adopt", help="convert output files a script wrote itself into results")
    a.add_argument("suite", choices=[s.name for s in SUITES])
    a.add_argument("files", nargs="+")
    a.add_argument("--out", help="write results here instead of experiments/results/")
    a.set_defaults(fn=cmd_adopt)
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
