"""Reliability soak: the CI reliability tests, hundreds of times, with the figures written down.

Skipped unless ``KVSTORE_SOAK=1``. Runs, on the tiny saved llama model (``tests/helpers/tiny.py``) and tiny
JSON Lines datasets, the trials of ``tests/helpers/trials.py``:

* **kill -9**: chains of ``kvstore build`` runs on one store, each killed at a random moment (half
  uniformly over a whole build - model loading, store creation, prefill, commits, exit - half
  shortly after a commit), then one run to completion. Counts the entries each killed build had
  committed before its kill (seen by a concurrent reader) and lost after it, entries failing
  verification, and checks that the last run builds exactly the missing contexts. A few of the
  kills hit real ``python -m kvstore`` processes, the rest processes forked from a preloaded zygote
  (same entry point, no 10 s of imports each); both are counted separately.
* **Ctrl-C**: builds interrupted with SIGINT after a commit: exit 130, one line, nothing lost.
* **corruption**: a 40-entry store (raw, zstd and zstd-shuffle entries, float64), rounds that
  damage 1-10 random entries through the backend (flipped bytes or truncation), check that
  verification names exactly those, and undo. Every few rounds the damage stays for the CLI:
  ``kvstore verify`` names exactly the damaged keys, ``kvstore sample --readonly-store`` warns once
  per damaged entry, misses exactly those and answers as ``--no-cache`` does, ``kvstore gc --corrupt``
  removes exactly those.
* **concurrency**: 4 builders on overlapping datasets and 2 samplers on one store at once.
* **fuzz**: ``tests/store/test_fuzz.py::test_fuzz_soak`` (hypothesis, random seed) with 10,000 cases.

Command (from the repository root; ~10-15 min on 2 busy cores; writes
experiments/reliability/results.{json,md}; options as for ``--help`` in ``KVSTORE_SOAK_ARGS``)::

    KVSTORE_SOAK=1 .venv/bin/python -m pytest -q -s tests/reliability/test_soak.py
    # smoke test:
    KVSTORE_SOAK=1 KVSTORE_SOAK_ARGS="--kill-trials 8 --corruptions 100 --fuzz-cases 500 --concurrency-runs 1 \\
        --sigint-trials 2 --real-trials 1 --out /tmp/soak-smoke" \\
        .venv/bin/python -m pytest -q -s tests/reliability/test_soak.py
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from helpers.cli import (
    REPO,
    WARNING_RE,
    SubprocessCli,
    build_argv,
    context_keys,
    context_text,
    nonblank_lines,
    read_predictions,
    run_main_quiet,
    start_cli,
    store_keys,
    verify_store,
    write_dataset,
)
from helpers.trials import concurrency_run, damage_entries, kill_trial, restore_entries

RESULTS = REPO / "experiments" / "reliability"


def parse_args(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kill-trials", type=int, default=100, help="kill -9 trials (at least this many kills sent)")
    p.add_argument("--chain", type=int, default=4, help="kills per store before a run to completion")
    p.add_argument(
        "--real-trials",
        type=int,
        default=5,
        help="of the kill trials, how many hit real `python -m kvstore` processes",
    )
    p.add_argument("--sigint-trials", type=int, default=20)
    p.add_argument(
        "--real-sigint-trials", type=int, default=2, help="of the Ctrl-C trials, how many hit real processes"
    )
    p.add_argument("--corruptions", type=int, default=1000, help="random corruptions (at least)")
    p.add_argument("--cli-rounds", type=int, default=5, help="corruption rounds also checked through verify/sample/gc")
    p.add_argument("--concurrency-runs", type=int, default=3)
    p.add_argument("--fuzz-cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument("--out", type=Path, default=RESULTS, help="where results.json/.md go")
    p.add_argument("--workdir", type=Path, default=None, help="scratch directory [default: a temporary one]")
    return p.parse_args(argv)


def kill_soak(args, work: Path, model: Path, rng, log) -> dict:
    import json
    import time

    n_contexts = 60
    words = (30, 90)
    dataset = write_dataset(work / "kill.jsonl", range(n_contexts), questions=1, words=words)
    expected = set(context_keys(model, [context_text(i, words=words) for i in range(n_contexts)]).values())

    # how long a whole build takes, for the uniform kill times (after the zygote has started)
    assert start_cli(["--help"], work / "logs", name="warm-up").wait()[0] == 0
    t0 = time.monotonic()
    code, out, err = start_cli(
        build_argv(dataset, model, work / "calibrate", "--batch-size", "1"), work / "logs", name="calibrate"
    ).wait()
    full = time.monotonic() - t0
    assert code == 0, err
    log(f"kill: a full build takes {full:.2f} s in a child")

    trials, chains = [], []
    real_left = args.real_trials
    chain_no = hits = 0
    while hits < args.kill_trials:  # count only kills that reached a running build
        store = work / f"kill-store-{chain_no}"
        argv = build_argv(dataset, model, store, "--batch-size", str(rng.choice([1, 1, 2, 4])))
        for k in range(args.chain):
            if hits >= args.kill_trials or (
                trials and trials[-1]["chain"] == chain_no and trials[-1]["after"] == n_contexts
            ):
                break  # nothing left to build in this store: finish the chain
            real = real_left > 0 and rng.random() < 0.2
            mode = rng.choice(["uniform", "after-write"])
            window = (full + (10.0 if real else 0.0)) * 1.1 if mode == "uniform" else rng.choice([0.0, 0.1, 0.3, 0.6])
            start = (
                (lambda a, w, name: SubprocessCli(a, w, name))
                if real
                else (lambda a, w, name: start_cli(a, w, name=name))
            )
            r = kill_trial(
                argv, store, work / "logs", rng, mode=mode, window=window, name=f"c{chain_no}k{k}", start=start
            )
            real_left -= real
            hits += r.killed
            row = {"chain": chain_no, "real_process": real, "mode": mode, "window": round(window, 3), **r.__dict__}
            if r.after:
                code, out, err = run_main_quiet("verify", "--store", store, "--quiet")
                row["cli_verify_exit"] = code
            row.pop("stderr_tail")
            trials.append(row)
        # finish the chain: the build completes with exactly one entry per distinct context
        present = store_keys(store, strict=False)
        code, out, err = run_main_quiet(*argv)
        summary = json.loads(out) if code == 0 else {}
        intact, corrupt = verify_store(store)
        chains.append(
            {
                "chain": chain_no,
                "present_before_finish": len(present),
                "finish_exit": code,
                "skipped": summary.get("skipped"),
                "built": summary.get("built"),
                # a build killed between a context's chunks and its record leaves a context that the
                # finishing build skips (its chain is stored whole) and records: skipped >= present
                "skipped_equals_present": summary.get("skipped", -1) >= len(present)
                and summary.get("skipped", 0) + summary.get("built", 0) == len(expected),
                "entries": len(intact),
                "corrupt": len(corrupt),
                "exactly_the_contexts": intact == expected,
            }
        )
        log(
            f"kill: chain {chain_no}: {[t['seen'] for t in trials if t['chain'] == chain_no]} seen at the kills, "
            f"{len(present)} present, finish exit {code}, {len(intact)} entries, exact {intact == expected}"
        )
        chain_no += 1
    killed = [t for t in trials if t["killed"]]
    return {
        "full_build_seconds": round(full, 3),
        "builds_started": len(trials),
        "finished_before_the_kill": len(trials) - len(killed),
        "trials": len(killed),  # kill -9 delivered to a running build
        "kills_before_its_first_commit": sum(1 for t in killed if t["seen"] == t["before"] and t["after"] < n_contexts),
        "kills_before_the_store_existed": sum(1 for t in killed if t["after"] == 0),
        "kills_mid_build": sum(1 for t in killed if t["seen"] > t["before"] and t["after"] < n_contexts),
        "kills_after_its_last_commit": sum(1 for t in killed if t["after"] == n_contexts),
        "real_process_kills": sum(t["real_process"] for t in killed),
        # entries the killed builds themselves committed before the kill (not those of earlier runs)
        "entries_committed_by_killed_builds": sum(t["seen"] - t["before"] for t in killed),
        "lost": sum(t["lost"] for t in trials),
        "corrupt_after_kill": sum(t["corrupt"] for t in trials),
        "cli_verify_failures": sum(1 for t in trials if t.get("cli_verify_exit", 0) != 0),
        "unexpected_exit_codes": sum(
            1 for t in trials if not (t["exitcode"] == -9 or (not t["killed"] and t["exitcode"] == 0))
        ),
        "chains": len(chains),
        "chains_finished_exactly": sum(
            1
            for c in chains
            if c["finish_exit"] == 0 and c["skipped_equals_present"] and c["exactly_the_contexts"] and not c["corrupt"]
        ),
        "trial_rows": trials,
        "chain_rows": chains,
    }


def sigint_soak(args, work: Path, model: Path, rng, log) -> dict:
    import time

    n_contexts = 2000  # long enough that the signal lands mid-build (150 tiny contexts build in < 0.3 s)
    dataset = write_dataset(work / "sigint.jsonl", range(n_contexts), questions=1)
    rows = []
    for t in range(args.sigint_trials):
        store = work / f"sigint-store-{t}"
        argv = build_argv(dataset, model, store, "--batch-size", "1")
        real = t < args.real_sigint_trials
        p = (
            SubprocessCli(argv, work / "logs", f"sigint{t}")
            if real
            else start_cli(argv, work / "logs", name=f"sigint{t}")
        )
        seen: set[str] = set()
        t0 = time.monotonic()
        while p.alive() and not seen and time.monotonic() - t0 < 120:
            seen = store_keys(store, strict=False)
            time.sleep(0.005)
        time.sleep(0.3 * rng.random())
        keys = store_keys(store, strict=False)
        if p.alive():
            seen = keys
        interrupted = p.alive()
        if interrupted:
            p.interrupt()
        code, out, err = p.wait()
        intact, corrupt = verify_store(store)
        lines = nonblank_lines(err)
        # a signal that lands after the last bytecode ran is never handled: the build completed
        completed = code == 0 and out.strip().startswith("{") and len(intact) == n_contexts
        rows.append(
            {
                "real_process": real,
                "interrupted": interrupted and not completed,
                "completed_before_the_signal_took_effect": interrupted and completed,
                "exit": code,
                "one_line": lines == ["kvstore: interrupted; everything committed so far is kept."],
                "traceback": "Traceback" in err,
                "seen": len(seen),
                "after": len(intact),
                "lost": len(seen - intact),
                "corrupt": len(corrupt),
            }
        )
    hit = [r for r in rows if r["interrupted"]]
    log(f"sigint: {len(hit)} interrupted, exits {sorted({r['exit'] for r in hit})}")
    return {
        "trials": len(rows),
        "interrupted_while_running": len(hit),
        "real_process_interrupts": sum(r["real_process"] for r in hit),
        "completed_before_the_signal_took_effect": sum(r["completed_before_the_signal_took_effect"] for r in rows),
        "rows": rows,
        "exit_130": sum(r["exit"] == 130 for r in hit),
        "one_line": sum(r["one_line"] for r in hit),
        "tracebacks": sum(r["traceback"] for r in rows),
        "lost": sum(r["lost"] for r in rows),
        "corrupt": sum(r["corrupt"] for r in rows),
    }


def corruption_soak(args, work: Path, model: Path, rng, log) -> dict:
    import re

    n = 40
    store = work / "corrupt-store"
    contexts = [context_text(i) for i in range(n)]
    for part, codec in ((range(0, 14), "raw"), (range(14, 27), "zstd:3"), (range(27, 40), "zstd-shuffle:1")):
        ds = write_dataset(work / f"corrupt-{codec}.jsonl", part)
        code, _, err = run_main_quiet(
            "build", ds, "--model", model, "--store", store, "--dtype", "float64", "--codec", codec, "--quiet"
        )
        assert code == 0, err
    keys = context_keys(model, contexts, dtype="float64")
    assert store_keys(store) == set(keys.values())
    dataset = write_dataset(work / "corrupt-all.jsonl", range(n))
    common = ["--model", model, "--store", store, "--dtype", "float64", "--quiet", "--format", "json"]
    code, _, err = run_main_quiet("sample", dataset, *common, "--no-cache", "-o", work / "corrupt-reference.jsonl")
    assert code == 0, err
    reference = {k: r["raw_output"] for k, r in read_predictions(work / "corrupt-reference.jsonl").items()}
    context_of = {f"c{i}-q{q}": contexts[i] for i in range(n) for q in range(2)}

    damaged = detected = false_alarms = rounds = 0
    kinds = {"flip": 0, "truncate": 0}
    missed: list[str] = []
    cli = {
        "rounds": 0,
        "verify_exact": 0,
        "sample_warned_exactly": 0,
        "sample_missed_exactly": 0,
        "sample_same_as_no_cache": 0,
        "gc_removed_exactly": 0,
    }
    cli_every = max(1, (args.corruptions // 5) // max(1, args.cli_rounds))
    records: dict[bytes, bytes] = {}
    while damaged < args.corruptions:
        k = rng.randint(1, 10)
        chosen = rng.sample(sorted(keys.values()), k)
        originals = damage_entries(store, chosen, rng)
        for _raw, what in originals.values():
            kinds["truncate" if what.startswith("truncated") else "flip"] += 1
        try:
            intact, corrupt = verify_store(store)
            damaged += k
            detected += len(set(corrupt) & set(chosen))
            false_alarms += len(set(corrupt) - set(chosen))
            missed += [originals[c][1] for c in chosen if c not in corrupt]
            if cli["rounds"] < args.cli_rounds and rounds % cli_every == 0:
                cli["rounds"] += 1
                code, out, err = run_main_quiet("verify", "--store", store, "--quiet")
                cli["verify_exact"] += code == 1 and {
                    ln.split()[1] for ln in out.splitlines() if ln.startswith("corrupt")
                } == set(chosen)
                out_path = work / f"corrupt-cached-{rounds}.jsonl"
                code, out, err = run_main_quiet("sample", dataset, *common, "--readonly-store", "-o", out_path)
                warned = {m.group(1) for m in (re.match(WARNING_RE, ln) for ln in nonblank_lines(err)) if m}
                all_warnings = all(re.match(WARNING_RE, ln) for ln in nonblank_lines(err))
                cli["sample_warned_exactly"] += code == 0 and all_warnings and warned == {c[:16] for c in chosen}
                got = read_predictions(out_path) if code == 0 else {}
                cli["sample_missed_exactly"] += bool(got) and all(
                    r["cache_hit"] == (keys[context_of[i]] not in chosen) for i, r in got.items()
                )
                cli["sample_same_as_no_cache"] += (
                    bool(got) and {i: r["raw_output"] for i, r in got.items()} == reference
                )
                records = _records(store)  # gc removes the damaged contexts' records too: put back after
                code, out, err = run_main_quiet("gc", "--corrupt", "--yes", "--store", store, "--quiet")
                cli["gc_removed_exactly"] += (
                    code == 0 and f" and {k} entr" in out and store_keys(store) == set(keys.values()) - set(chosen)
                )
        finally:
            restore_entries(store, originals)
            if records:
                _restore_records(store, records)
                records = {}
        rounds += 1
    intact, corrupt = verify_store(store)
    log(
        f"corruption: {damaged} damaged in {rounds} rounds, {detected} detected, {false_alarms} false alarms, cli {cli}"
    )
    return {
        "entries": n,
        "rounds": rounds,
        "corruptions": damaged,
        "by_kind": kinds,
        "detected": detected,
        "detection_rate": detected / damaged if damaged else None,
        "false_alarms": false_alarms,
        "missed": missed[:20],
        "cli_checks": cli,
        "store_intact_after": len(intact) == n and not corrupt,
    }


def _records(store) -> dict[bytes, bytes]:
    """The raw context records of a store (backend keys r/...)."""
    from kvstore.store.kvstore import KVStore

    with KVStore(str(store)) as s:
        names = list(s.backend.keys(b"r/"))
        return {k: v for k, v in zip(names, s.backend.get_many(names)) if v is not None}


def _restore_records(store, records: dict[bytes, bytes]) -> None:
    from kvstore.store.kvstore import KVStore

    with KVStore(str(store)) as s:
        s.backend.put_many(list(records.items()))


def concurrency_soak(args, work: Path, model: Path, rng, log) -> dict:

    n = 40
    expected = set(context_keys(model, [context_text(i) for i in range(n)], dtype="float64").values())
    union = write_dataset(work / "conc-union.jsonl", range(n))
    code, _, err = run_main_quiet(
        "sample",
        union,
        "--model",
        model,
        "--dtype",
        "float64",
        "--no-cache",
        "--quiet",
        "--format",
        "json",
        "-o",
        work / "conc-reference.jsonl",
    )
    assert code == 0, err
    reference = read_predictions(work / "conc-reference.jsonl")
    rows = []
    for r_i in range(args.concurrency_runs):
        d = work / f"conc-{r_i}"
        d.mkdir()
        run = concurrency_run(model, d, n_contexts=n, seed=args.seed + r_i)
        intact, corrupt = verify_store(run["store"])
        bad_exit = [k for k, (code, _, _) in run["results"].items() if code != 0]
        noisy = [
            k for k, (_, _, err) in run["results"].items() if "Traceback" in err or "corrupt" in err or "error" in err
        ]
        same = all(
            {k: r["raw_output"] for k, r in read_predictions(d / f"sample{i}.preds.jsonl").items()}
            == {k: reference[k]["raw_output"] for k in read_predictions(d / f"sample{i}.preds.jsonl")}
            for i in range(2)
        )
        rows.append(
            {
                "processes": len(run["results"]),
                "bad_exits": bad_exit,
                "stderr_problems": noisy,
                "entries": len(intact),
                "corrupt": len(corrupt),
                "exactly_the_contexts": intact == expected,
                "samplers_same_as_no_cache": same,
            }
        )
        log(f"concurrency: run {r_i}: {rows[-1]}")
    return {
        "runs": len(rows),
        "all_clean": all(
            not r["bad_exits"]
            and not r["stderr_problems"]
            and not r["corrupt"]
            and r["exactly_the_contexts"]
            and r["samplers_same_as_no_cache"]
            for r in rows
        ),
        "rows": rows,
    }


def fuzz_soak(args, work: Path, log) -> dict:
    import json
    import os
    import subprocess

    report = work / "fuzz.json"
    env = dict(
        os.environ, KVSTORE_SOAK="1", KVSTORE_FUZZ_SOAK_EXAMPLES=str(args.fuzz_cases), KVSTORE_FUZZ_REPORT=str(report)
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/store/test_fuzz.py", "-k", "soak"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    result = json.loads(report.read_text()) if report.exists() else {"cases": 0}
    result["pytest_exit"] = done.returncode
    result["pytest_tail"] = done.stdout[-400:]
    log(f"fuzz: {result['cases']} cases, pytest exit {done.returncode}")
    return result


def machine() -> dict:
    import os
    import platform

    import lmdb
    import torch
    import transformers

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lmdb": ".".join(map(str, lmdb.version())),
        "loadavg_at_start": os.getloadavg(),
    }


def write_markdown(path: Path, res: dict) -> None:
    k, s, c, f, cc = res["kill"], res["sigint"], res["corruption"], res["fuzz"], res["concurrency"]
    cli = c["cli_checks"]
    lines = [
        "# Reliability soak results",
        "",
        f"Run {res['started']} - {res['seconds']:.0f} s on {res['machine']['cpus']} CPUs "
        f"({res['machine']['platform']}), "
        f"torch {res['machine']['torch']}, transformers {res['machine']['transformers']}, LMDB "
        f"{res['machine']['lmdb']}. "
        f"Command: `{res['command']}`.",
        "",
        "| claim | trials | detected / held | lost |",
        "|---|---|---|---|",
        f"| kill -9 during `kvstore build` | {k['trials']} kills of running builds "
        f"({k['kills_before_its_first_commit']} before the build's first "
        f"commit, {k['kills_mid_build']} mid-build, {k['kills_after_its_last_commit']} after its last; "
        f"{k['real_process_kills']} of real "
        f"`python -m kvstore` processes) | {k['entries_committed_by_killed_builds']} entries committed by the "
        "killed builds before their kill, "
        f"{k['corrupt_after_kill']} corrupt after, {k['cli_verify_failures']} `verify` failures; "
        f"{k['chains_finished_exactly']}/{k['chains']} "
        f"re-runs built exactly the missing contexts | {k['lost']} |",
        f"| Ctrl-C during `kvstore build` | {s['interrupted_while_running']} interrupts of running builds "
        f"({s['real_process_interrupts']} of real processes) | exit 130: {s['exit_130']}, one line: "
        f"{s['one_line']}, tracebacks: {s['tracebacks']}, corrupt: {s['corrupt']} | {s['lost']} |",
        f"| random corruptions (flip / truncate, below the codec) | {c['corruptions']} ({c['by_kind']['flip']} "
        f"flip, {c['by_kind']['truncate']} truncate) "
        f"in {c['rounds']} rounds | {c['detected']} detected ({100 * c['detection_rate']:.1f}%), "
        f"{c['false_alarms']} false alarms | - |",
        f"| ... through the CLI | {cli['rounds']} rounds | verify exact {cli['verify_exact']}, sample warned "
        f"exactly {cli['sample_warned_exactly']}, "
        f"missed exactly {cli['sample_missed_exactly']}, same answers as --no-cache "
        f"{cli['sample_same_as_no_cache']}, gc removed exactly "
        f"{cli['gc_removed_exactly']} | - |",
        f"| 4 builders + 2 samplers at once | {cc['runs']} runs | all clean: {cc['all_clean']} | - |",
        f"| entry decoder fuzz (hypothesis) | {f['cases']} cases | only kvstore errors: {f.get('pytest_exit') == 0} "
        "| - |",
        "",
        "Full per-trial rows: `results.json`.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    import datetime
    import json
    import os
    import random
    import shutil
    import tempfile
    import time

    args = parse_args(argv)
    t_start = time.monotonic()
    own_work = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="kvstore-soak-")) if own_work else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("KVSTORE_HOME", str(work / "home"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.pop("KVSTORE_STORE", None)
    os.environ.pop("KVSTORE_DEBUG", None)

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:7.1f} s] {msg}", flush=True)

    from helpers.tiny import save_tiny_model

    model = save_tiny_model(work / "tiny-llama", "llama")
    rng = random.Random(args.seed)
    res = {
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": "KVSTORE_SOAK=1 KVSTORE_SOAK_ARGS="
        + shlex.quote(" ".join(sys.argv[1:] if argv is None else argv))
        + " python -m pytest -q -s tests/reliability/test_soak.py",
        "seed": args.seed,
    }
    try:
        res["fuzz"] = fuzz_soak(args, work, log)
        res["corruption"] = corruption_soak(args, work, model, rng, log)
        res["kill"] = kill_soak(args, work, model, rng, log)
        res["sigint"] = sigint_soak(args, work, model, rng, log)
        res["concurrency"] = concurrency_soak(args, work, model, rng, log)
    finally:
        res["seconds"] = round(time.monotonic() - t_start, 1)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        if all(k in res for k in ("kill", "sigint", "corruption", "fuzz", "concurrency")):
            write_markdown(args.out / "results.md", res)
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    k, c, s = res["kill"], res["corruption"], res["sigint"]
    cli = c["cli_checks"]
    ok = (
        k["lost"] == 0
        and k["corrupt_after_kill"] == 0
        and k["cli_verify_failures"] == 0
        and k["unexpected_exit_codes"] == 0
        and k["chains_finished_exactly"] == k["chains"]
        and c["detected"] == c["corruptions"]
        and c["false_alarms"] == 0
        and s["lost"] == 0
        and s["tracebacks"] == 0
        and s["exit_130"] == s["interrupted_while_running"] == s["one_line"]
        and (s["trials"] == 0 or s["interrupted_while_running"] > s["trials"] // 2)  # the trials must interrupt
        and all(cli[name] == cli["rounds"] for name in cli)
        and res["concurrency"]["all_clean"]
        and res["fuzz"].get("pytest_exit") == 0
    )
    log(f"done: {'all claims held' if ok else 'SOMETHING FAILED - see results.json'}")
    return 0 if ok else 1


@pytest.mark.soak
def test_soak():
    """Every claim held over the whole soak (the figures are in the results files)."""
    assert main(shlex.split(os.environ.get("KVSTORE_SOAK_ARGS", ""))) == 0
