"""The benchmark runner: ``python -m experiments list | run SUITE [--quick] [ARGS...] | report | adopt``.

From the repository root::

    .venv/bin/python -m experiments list                        # suites, their scripts and results
    .venv/bin/python -m experiments run ttft --quick            # smoke run -> cache/bench/quick/ttft.json
    .venv/bin/python -m experiments run ttft --repeats 7        # full run -> experiments/results/ttft.json
    .venv/bin/python -m experiments run e2e --parts sweep       # one part: only e2e_sweep.json changes
    .venv/bin/python -m experiments report                      # docs/results.md from every committed result
    .venv/bin/python -m experiments report --check              # exit 1 if docs/results.md is stale
    .venv/bin/python -m experiments adopt ttft old/ttft.json    # a result from a file in an older layout

Arguments after the suite name go to its script unchanged (see ``python experiments/SCRIPT.py
--help``). The script writes its results in the schema itself (``benchlib.write_result``) into a
scratch folder; the runner checks them and puts them in place, unchanged, only when the script
exits 0.
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
IMAGES = schema.ROOT / "docs" / "img"  # where a full run puts the plots the docs show (Suite.images)


def cmd_list(_: argparse.Namespace) -> int:
    width = max(len(s.name) for s in SUITES)
    for s in SUITES:
        have = [o for o in s.outputs if (schema.RESULTS / f"{o}.json").exists()]
        state = f"{len(have)}/{len(s.outputs)} committed" if s.outputs else ""
        quick = "" if s.quick is not None else "; no --quick"
        needs = f"; needs {s.needs}" if s.needs else ""
        print(f"{s.name:<{width}}  {s.title} [{s.script}; {state}{quick}{needs}]")
    return 0


def document(suite: Suite, stem: str, fields: dict, command: str, sha: str) -> dict:
    """An adopted file's fields as a result of ``suite``."""
    return schema.make(suite.name, suite.part(stem), fields.get("command", command), fields["params"],
                       fields["machine"], fields["rows"], fields["notes"], sha)  # fmt: skip


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


def check_output(suite: Suite, stem: str, doc: dict, where: str) -> None:
    """Raise :class:`schema.SchemaError` unless ``doc`` is a result, and the one of ``suite`` named ``stem``."""
    schema.check(doc, where)
    if stem not in suite.outputs or (doc["suite"], doc["part"]) != (suite.name, suite.part(stem)):
        raise schema.SchemaError(f"{where}: {stem} (suite {doc['suite']!r}, part {doc['part']!r}) is not an output "
                                 f"of the suite {suite.name} ({', '.join(suite.outputs)})")  # fmt: skip


def written(suite: Suite, raw_dir: Path) -> dict[str, dict]:
    """The results the suite's script wrote in ``raw_dir`` (benchlib.write_result), checked: output
    name -> result. Raises :class:`schema.SchemaError` for one that is not a result of this suite."""
    out = {}
    for stem in suite.outputs:
        path = raw_dir / f"{stem}.json"
        if path.exists():
            out[stem] = schema.load(path)
            check_output(suite, stem, out[stem], str(path))
    return out


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
    command = shlex.join(["python", "-m", "experiments", "run", suite.name, *(["--quick"] if args.quick else []),
                          *args.args])  # fmt: skip
    # benchlib.write_result writes into KVSTORE_BENCH_RAW and records KVSTORE_BENCH_COMMAND as the command
    env = os.environ | {"KVSTORE_BENCH_RAW": str(raw_dir), "KVSTORE_BENCH_COMMAND": command}
    argv = [*suite.argv, *extra]
    print(f"running {shlex.join(argv)} (results first in {raw_dir})", flush=True)
    rc = subprocess.run([sys.executable, *argv], cwd=schema.ROOT, env=env).returncode
    if rc != 0:
        print(f"experiments: {suite.name} exited with {rc}; no result written", file=sys.stderr)
        return rc
    try:
        results = written(suite, raw_dir)
    except schema.SchemaError as e:
        print(f"experiments: {e}; no result written", file=sys.stderr)
        return 1
    if not results:
        names = ", ".join(f"{o}.json" for o in suite.outputs)
        print(f"experiments: {suite.name} wrote none of {names} in {raw_dir}", file=sys.stderr)
        return 1
    out_dir = Path(args.out) if args.out else (QUICK if args.quick else schema.RESULTS)
    for stem, doc in results.items():
        path = out_dir / f"{stem}.json"
        schema.write(path, merge(suite, doc, path))
        print(f"wrote {path}")
    for name in suite.artifacts:
        if (raw_dir / name).exists():
            shutil.copyfile(raw_dir / name, out_dir / name)
            print(f"wrote {out_dir / name}")
    img_dir = IMAGES if out_dir == schema.RESULTS else out_dir  # a smoke run's plots stay beside its results
    for name in suite.images:
        if (raw_dir / name).exists():
            img_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(raw_dir / name, img_dir / name)
            print(f"wrote {img_dir / name}")
    if out_dir == schema.RESULTS:
        print("now run: python -m experiments report")
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    """Results from files in an older layout (what scripts wrote before they wrote the schema), or
    from a result a script run by hand wrote (checked and copied as it is)."""
    suite = by_name(args.suite)
    out_dir = Path(args.out) if args.out else schema.RESULTS
    for f in map(Path, args.files):
        raw = read_raw(f)
        if isinstance(raw, dict) and tuple(raw) == schema.KEYS:  # already a result
            docs = {f.stem: raw}
        else:
            # a suite with one output names it; a multi-output suite's old file is named like its output
            stem = suite.outputs[0] if len(suite.outputs) == 1 else f.stem.removesuffix("_quick")
            raw_command = raw.get("command") if isinstance(raw, dict) else None
            command = raw_command if isinstance(raw_command, str) else f"python {suite.script}"
            sha = schema.last_commit(f)
            docs = {}
            for out_stem, fields in suite.adopt(stem, raw).items():
                fields["notes"]["converted_from"] = f"{f.as_posix()} at {sha}"
                docs[out_stem] = document(suite, out_stem, fields, command, sha)
        for out_stem, doc in docs.items():
            try:
                check_output(suite, out_stem, doc, str(f))
            except schema.SchemaError as e:
                print(f"experiments: {e}", file=sys.stderr)
                return 1
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
    produced |= {a for s in SUITES for a in s.artifacts}
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
