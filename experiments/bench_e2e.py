"""End to end on a TriviaQA-shaped workload, through the CLI as a user runs it.

A synthetic dataset with TriviaQA's shape (``--contexts`` documents of ~1.5k tokens each, 1-3
questions per document, 2 on average, one-word answers; deterministic word salad, since shapes
matter here and content does not) is written to ``cache/bench/e2e/trivia.jsonl``. Then, each
command a subprocess under ``/usr/bin/time`` (peak RSS) with ``--format json``:

``main``
    ``kvstore build`` into a fresh store (wall time, the build's own ``seconds`` and its
    ``store_seconds``: encode + write time on the writer thread), then ``kvstore sample -n 16``
    from the warm store (its file read just before each of ``--cache-repeats`` runs) and
    ``kvstore sample -n 16 --no-cache`` (as often, ``--nocache-repeats``). Questions per
    second come from each summary's ``seconds`` (answering only; model loading excluded); the CLI
    wall time is reported beside it. The
    predictions of both runs are compared.
``sweep``
    How the speed-up moves with answer length: the first ``--sweep-rows`` rows asking for a long
    answer (``LONG_QUESTION``, so that ``-n`` sets the length; the mean generated length is
    reported), cached vs ``--no-cache``, each ``--sweep-cache-repeats`` times (medians), for ``-n`` in
    ``--sweep-lengths``.
``cold``
    The first ``--sweep-rows`` questions from a cold store (its file evicted from the page cache
    with ``posix_fadvise(DONTNEED)``) vs a warm one, twice each.
``overhead``
    Build's store overhead, paired in one process: the first ``--overhead-contexts`` contexts
    prefilled in the same batches with and without storing (``Adapter.prefill`` alone vs
    ``Adapter.generate_kv_cache`` into a fresh store), alternating, ``--overhead-repeats`` times;
    plus the same prefill one context at a time (does batching pay on this CPU?).
``loadahead``
    ``sample`` from the warm store with the next batch's entries loaded on a worker while a batch
    decodes (the default) and without, alternating in one process (``--cache-repeats`` each).
``variants``
    Where that overhead comes from, one build each on the same contexts: as is, with the writer
    budget cut to two 512-token chunks (about the queue of 2 chunks it had before the 1 GiB budget;
    patched in for this row), with the raw codec, batch 1.

Each part is one result, ``e2e_PART.json`` (``--stem`` names the result of a run of one part).

Command (from the repository root; the suite ``e2e``: ``python -m experiments run e2e [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_e2e.py --parts main                 # 40 contexts (~80 questions)
    .venv/bin/python experiments/bench_e2e.py --parts sweep
    .venv/bin/python experiments/bench_e2e.py --parts cold,overhead
    .venv/bin/python experiments/bench_e2e.py --parts variants
    .venv/bin/python experiments/bench_e2e.py --parts loadahead --contexts 20
    .venv/bin/python experiments/bench_e2e.py --parts overhead --stem e2e_overhead_split   # its own suite
    .venv/bin/python experiments/bench_e2e.py --quick                      # smoke test: 4 short contexts

The issue's full size is ``--contexts 225`` (~450 questions): about 10 minutes of build and as long
again without a cache on this 2-core machine, so the committed run is scaled down; the ratios are
what matter.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import benchlib as bl

WORK = bl.SCRATCH / "e2e"
QUESTIONS_PER_CONTEXT = (2, 1, 3, 2, 2, 1, 3, 2)  # mean 2, TriviaQA-like spread


def make_dataset(path: Path, n_contexts: int, words: int, seed: int = 0) -> dict:
    """Write the synthetic TriviaQA-shaped JSONL; returns its shape."""
    rng = random.Random(seed)
    rows = []
    for c in range(n_contexts):
        text = bl.synthetic_text(words, seed=seed * 100_003 + c)
        vocab = text.replace(".", "").lower().split()
        for q in range(QUESTIONS_PER_CONTEXT[c % len(QUESTIONS_PER_CONTEXT)]):
            a, b, d = rng.choice(vocab), rng.choice(vocab), rng.choice(vocab)
            rows.append(
                {
                    "id": f"doc{c}-q{q}",
                    "context": text,
                    "question": f"Which word comes right after '{a} {b}' in the passage about the {d}?",
                    "answers": [rng.choice(vocab)],
                }
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return {"contexts": n_contexts, "questions": len(rows), "words_per_context": words}


def kvstore(*args: str) -> dict:
    """Run one ``kvstore`` command (``python -m cli.main``) under /usr/bin/time; its JSON summary
    plus ``wall_seconds`` and ``peak_rss_mib``."""
    rss_file = WORK / "time.txt"
    cmd = [
        "/usr/bin/time",
        "-f",
        "%M",
        "-o",
        str(rss_file),
        sys.executable,
        "-m",
        "kvstore.cli.main",
        *args,
        "--format",
        "json",
        "--quiet",
    ]
    print("$ kvstore " + " ".join(args), flush=True)
    with bl.timed() as t:
        proc = subprocess.run(cmd, cwd=bl.ROOT, stdout=subprocess.PIPE, text=True)
    wall = t.seconds
    if proc.returncode != 0:
        sys.exit(f"kvstore {' '.join(args)} failed with exit code {proc.returncode}")
    summary = json.loads(proc.stdout)
    summary["wall_seconds"] = round(wall, 3)
    summary["peak_rss_mib"] = round(int(rss_file.read_text().split()[-1]) / 1024, 1)
    summary["load"] = bl.loadavg()
    keep = (
        "seconds",
        "questions_per_second",
        "wall_seconds",
        "peak_rss_mib",
        "store_seconds",
        "ratio",
        "built",
        "cache_hit_rate",
    )
    print("  " + "  ".join(f"{k}={summary[k]}" for k in keep if k in summary) + f"  load={summary['load']}", flush=True)
    return summary


def warm_store(store: Path) -> None:
    """Read the store file once so its pages sit in the page cache ("warm"). On this VM the page
    cache does not keep a 2 GB store for long between runs, so every cached run is preceded by this."""
    with (store / "data.mdb").open("rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def evict_store(store: Path) -> None:
    """Drop the store file's pages from the page cache (this file only), for a cold run."""
    import os

    fd = os.open(store / "data.mdb", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def predictions(path: Path) -> list[str]:
    return [json.loads(line)["raw_output"] for line in path.open(encoding="utf-8")]


def mean_tokens(path: Path, tokenizer, limit: int) -> float:
    """Mean generated tokens per answer (text re-tokenized, plus the EOS when it fit)."""
    outs = predictions(path)
    return statistics.mean(min(limit, len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1) for t in outs)


def part_main(args, data: Path, store: Path) -> tuple[list[dict], dict]:
    """One row per command run (the build, then every cached and no-cache sample), and the totals."""
    shutil.rmtree(store, ignore_errors=True)
    b = kvstore("build", str(data), "--store", str(store), "-b", str(args.batch_size))
    cached = []
    for _i in range(args.cache_repeats):
        warm_store(store)
        cached.append(
            kvstore(
                "sample",
                str(data),
                "--store",
                str(store),
                "-n",
                str(args.new_tokens),
                "-b",
                str(args.batch_size),
                "--readonly-store",
                "-o",
                str(WORK / "pred_cache.jsonl"),
            )
        )
    nocache = []
    for _i in range(args.nocache_repeats):
        nocache.append(
            kvstore(
                "sample",
                str(data),
                "--no-cache",
                "-n",
                str(args.new_tokens),
                "-b",
                str(args.batch_size),
                "-o",
                str(WORK / "pred_nocache.jsonl"),
            )
        )
    same = sum(a == b for a, b in zip(predictions(WORK / "pred_cache.jsonl"), predictions(WORK / "pred_nocache.jsonl")))
    c_s = statistics.median(r["seconds"] for r in cached)
    n_s = statistics.median(r["seconds"] for r in nocache)
    c_w = statistics.median(r["wall_seconds"] for r in cached)
    n_w = statistics.median(r["wall_seconds"] for r in nocache)
    q = cached[0]["questions"]
    rows = [{"command": "build"} | b]
    rows += [{"command": "sample", "run": i + 1} | r for i, r in enumerate(cached)]
    rows += [{"command": "sample --no-cache", "run": i + 1} | r for i, r in enumerate(nocache)]
    return rows, {
        "questions": q,
        "cached_qps": q / c_s,
        "nocache_qps": q / n_s,
        "speedup": n_s / c_s,
        "speedup_wall": n_w / c_w,
        "identical_predictions": f"{same}/{q}",
        "build_store_share": b["store_seconds"] / b["seconds"],
    }


LONG_QUESTION = "Retell the whole passage in your own words, sentence by sentence, leaving nothing out."


def part_sweep(args, data: Path, store: Path) -> list[dict]:
    """The first ``--sweep-rows`` rows with a question that asks for a long answer, so that ``-n``
    sets the answer length (EOS rarely comes first); same contexts, so the store serves them."""
    if not (store / "data.mdb").exists():
        kvstore("build", str(data), "--store", str(store), "-b", str(args.batch_size))
    from kvstore.model.load.loading import load_model

    long_data = data.with_name(data.stem + "_long.jsonl")
    with data.open(encoding="utf-8") as f, long_data.open("w", encoding="utf-8") as out:
        for line in list(f)[: args.sweep_rows]:
            out.write(json.dumps(json.loads(line) | {"question": LONG_QUESTION}) + "\n")
    tok = load_model(None).tokenizer
    rows = []
    for n in [int(x) for x in args.sweep_lengths.split(",")]:
        common = ("-n", str(n), "-b", str(args.batch_size))
        cached = []
        for _ in range(args.sweep_cache_repeats):
            warm_store(store)
            cached.append(
                kvstore(
                    "sample",
                    str(long_data),
                    "--store",
                    str(store),
                    "--readonly-store",
                    *common,
                    "-o",
                    str(WORK / "sweep_c.jsonl"),
                )
            )
        ref = [
            kvstore("sample", str(long_data), "--no-cache", *common, "-o", str(WORK / "sweep_n.jsonl"))
            for _ in range(args.sweep_cache_repeats)  # as often as the cached side
        ]
        r = ref[-1]
        c_s = statistics.median(c["seconds"] for c in cached)
        n_s = statistics.median(x["seconds"] for x in ref)
        same = sum(a == b for a, b in zip(predictions(WORK / "sweep_c.jsonl"), predictions(WORK / "sweep_n.jsonl")))
        rows.append(
            {
                "max_new_tokens": n,
                "questions": r["questions"],
                "mean_answer_tokens": round(mean_tokens(WORK / "sweep_c.jsonl", tok, n), 2),
                "cached_s": c_s,
                "cached_s_all": [c["seconds"] for c in cached],
                "nocache_s": n_s,
                "nocache_s_all": [x["seconds"] for x in ref],
                "cached_qps": r["questions"] / c_s,
                "nocache_qps": r["questions"] / n_s,
                "speedup": n_s / c_s,
                "identical_predictions": f"{same}/{r['questions']}",
                "cached_peak_rss_mib": max(c["peak_rss_mib"] for c in cached),
                "nocache_peak_rss_mib": max(x["peak_rss_mib"] for x in ref),
                "load": r["load"],
            }
        )
    return rows


def part_cold(args, data: Path, store: Path) -> dict:
    """The first ``--sweep-rows`` rows from a cold store (its file evicted from the page cache)
    and from a warm one, ``-n`` as in main."""
    if not (store / "data.mdb").exists():
        kvstore("build", str(data), "--store", str(store), "-b", str(args.batch_size))
    common = (
        "--limit",
        str(args.sweep_rows),
        "-n",
        str(args.new_tokens),
        "-b",
        str(args.batch_size),
        "--readonly-store",
    )
    out = {}
    for state in ("cold", "warm", "cold", "warm"):
        (evict_store if state == "cold" else warm_store)(store)
        r = kvstore("sample", str(data), "--store", str(store), *common)
        out.setdefault(state, []).append(
            {k: r[k] for k in ("questions", "seconds", "wall_seconds", "peak_rss_mib", "load")}
        )
    return out


def part_overhead(args, data: Path) -> dict:
    """Paired in-process comparison: prefill alone vs prefill + store, same contexts and batches."""
    from kvstore.data.datasets import load_dataset
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.pipelines.build import batches as ka_batches
    from kvstore.store.kvstore import KVStore

    adapter = bl.load_adapter("float32")
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    contexts = load_dataset(str(data)).contexts()[: args.overhead_contexts]
    texts = [fmt.context_part(c) for c in contexts]
    ids = [adapter.encode_context(t, special_tokens=fmt.add_special_tokens) for t in texts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches = list(ka_batches(order, [len(x) for x in ids], args.batch_size, None))
    adapter.prefill([ids[0][:8]])  # warm-up
    plain, plain_b1, stored, store_s, wait_s = [], [], [], [], []
    for r in range(args.overhead_repeats):
        with bl.timed() as t:
            for batch in batches:
                adapter.prefill([ids[i] for i in batch])
        plain.append(t.seconds)
        with bl.timed() as t:
            for i in order:  # the same contexts one at a time: does batching pay on this CPU?
                adapter.prefill([ids[i]])
        plain_b1.append(t.seconds)
        path = WORK / "overhead-store"
        shutil.rmtree(path, ignore_errors=True)
        with KVStore(str(path)) as kv:
            rep = adapter.generate_kv_cache(
                texts, kv, batch_size=args.batch_size, special_tokens=fmt.add_special_tokens
            )
        stored.append(rep.seconds)
        store_s.append(rep.store_seconds)
        wait_s.append(rep.store_wait_seconds)
        shutil.rmtree(path, ignore_errors=True)
        print(
            f"  overhead repeat {r + 1}: prefill only {plain[-1]:.1f} s (batch 1: {plain_b1[-1]:.1f} s), build "
            f"{stored[-1]:.1f} s "
            f"(writer busy {store_s[-1]:.2f} s, compute waited {wait_s[-1]:.2f} s)  load {bl.loadavg()}",
            flush=True,
        )
    p, s = statistics.median(plain), statistics.median(stored)
    return {
        "contexts": len(texts),
        "tokens": sum(len(x) for x in ids),
        "batch_size": args.batch_size,
        "prefill_only_s": plain,
        "prefill_only_batch1_s": plain_b1,
        "build_s": stored,
        "writer_busy_s": store_s,
        "compute_waited_s": wait_s,
        "overhead_share": (s - p) / s,
        "writer_busy_share": statistics.median(store_s) / s,
        "waited_share": statistics.median(wait_s) / s,
    }


def part_loadahead(args, data: Path, store: Path) -> dict:
    """``sample`` from the warm store with the next batch loaded on a worker (the default) and
    without (``sample --no-load-ahead``), in this process through the CLI's own entry point,
    alternating, ``--cache-repeats`` times each; the answering ``seconds`` of each summary."""
    import contextlib
    import io

    from kvstore.cli.main import main as cli_main

    out: dict = {"ahead": [], "sequential": []}
    argv = ["sample", str(data), "--store", str(store), "-n", str(args.new_tokens), "-b", str(args.batch_size),
            "--readonly-store", "--quiet", "--format", "json"]  # fmt: skip
    for _ in range(args.cache_repeats):
        for mode in ("ahead", "sequential"):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
                cli_main(argv + ([] if mode == "ahead" else ["--no-load-ahead"]))
            text = buf.getvalue()
            out[mode].append(json.loads(text[text.index("{") :])["seconds"])
            print(f"  sample, {mode}: {out[mode][-1]:.2f} s  load {bl.loadavg()}", flush=True)
    return out


def part_variants(args, data: Path) -> dict:
    """What the build's store overhead comes from: the same contexts prefilled alone (batch
    ``--batch-size`` and 1) and built with ``generate_kv_cache`` as is (writer budget 1 GiB), with
    the writer budget cut to two chunks (the old queue of 2; patched in), with the raw codec, and
    with batch size 1."""
    import kvstore.model.pipelines.build as ka
    from kvstore.data.datasets import load_dataset
    from kvstore.data.prompts import PromptFormat
    from kvstore.store.kvstore import KVStore

    adapter = bl.load_adapter("float32")
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    texts = [fmt.context_part(c) for c in load_dataset(str(data)).contexts()[: args.overhead_contexts]]
    ids = [adapter.encode_context(t, special_tokens=fmt.add_special_tokens) for t in texts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    adapter.prefill([ids[0][:8]])  # warm-up
    out = {"contexts": len(texts), "tokens": sum(len(x) for x in ids), "batch_size": args.batch_size, "rows": []}

    def record(name, seconds, rep=None):
        row = {"variant": name, "seconds": seconds}
        if rep is not None:
            row |= {
                "writer_busy_s": rep.store_seconds,
                "compute_waited_s": rep.store_wait_seconds,
                "stored_bytes": rep.stored_bytes,
            }
        out["rows"].append(row)
        print(
            f"  {name:<34} {seconds:6.1f} s"
            + (
                f"  (writer busy {rep.store_seconds:.1f} s, compute waited {rep.store_wait_seconds:.1f} s)"
                if rep
                else ""
            )
            + f"  load {bl.loadavg()}",
            flush=True,
        )

    for bs in (args.batch_size, 1):
        with bl.timed() as t:
            for batch in ka.batches(order, [len(x) for x in ids], bs, None):
                adapter.prefill([ids[i] for i in batch])
        record(f"prefill only, batch {bs}", t.seconds)
    two_chunks = 2 * 512 * adapter.kv_bytes_per_token()
    for name, codec, bs, patch in (
        (f"build, batch {args.batch_size}", None, args.batch_size, False),
        (f"build, batch {args.batch_size}, writer budget 2 chunks", None, args.batch_size, True),
        (f"build, batch {args.batch_size}, raw codec", "raw", args.batch_size, False),
        ("build, batch 1", None, 1, False),
    ):
        path = WORK / "variant-store"
        shutil.rmtree(path, ignore_errors=True)
        saved = ka.WRITER_BYTES
        try:
            if patch:
                ka.WRITER_BYTES = two_chunks
            with KVStore(str(path), codec=codec) as kv:
                rep = adapter.generate_kv_cache(texts, kv, batch_size=bs, special_tokens=fmt.add_special_tokens)
        finally:
            ka.WRITER_BYTES = saved
            shutil.rmtree(path, ignore_errors=True)
        record(name, rep.seconds, rep)
    return out


def main() -> None:
    p = bl.parser(__doc__, batch_size=8)
    p.add_argument("--parts", default="main,sweep,cold,overhead")
    p.add_argument("--contexts", type=int, default=40)
    p.add_argument(
        "--words",
        type=int,
        default=1350,
        help="words per context (~1.1 tokens each; ~1.5k tokens with the chat template)",
    )
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--cache-repeats", type=int, default=3)
    p.add_argument("--nocache-repeats", type=int, default=3)
    p.add_argument("--sweep-rows", type=int, default=16)
    p.add_argument("--sweep-lengths", default="1,4,16,64")
    p.add_argument("--sweep-cache-repeats", type=int, default=2)
    p.add_argument("--overhead-contexts", type=int, default=16)
    p.add_argument("--overhead-repeats", type=int, default=2)
    p.add_argument("--stem", default="", help="results file stem of a run of one part (default: e2e_PART)")
    quick = dict(contexts=4, words=200, cache_repeats=1, sweep_cache_repeats=1, sweep_rows=4, sweep_lengths="1,4",
                 overhead_contexts=2, overhead_repeats=1)  # fmt: skip
    args = bl.start(p, quick=quick)
    parts = args.parts.split(",")
    if args.stem and len(parts) != 1:
        p.error("--stem names the result of one part: give --parts one part")
    data = WORK / ("trivia_quick.jsonl" if args.quick else f"trivia_{args.contexts}.jsonl")
    store = WORK / ("store_quick" if args.quick else f"store_{args.contexts}")
    shape = make_dataset(data, args.contexts, args.words)
    print(f"dataset {data}: {shape}", flush=True)

    def write(part: str, rows: list[dict], notes: dict) -> None:
        bl.write_result(args.stem or f"e2e_{part}", params=vars(args), rows=rows, notes=notes)

    if "main" in parts:
        with bl.timed() as t:
            rows, m = part_main(args, data, store)
        m = {"dataset": shape} | m | {"bench_seconds": round(t.seconds, 1)}
        write("main", rows, m)
        print(
            f"cached {m['cached_qps']:.2f} q/s vs no-cache {m['nocache_qps']:.2f} q/s -> {m['speedup']:.1f}x; "
            f"store share of build {m['build_store_share']:.1%}; identical predictions {m['identical_predictions']}"
        )
    if "sweep" in parts:
        rows = part_sweep(args, data, store)
        write("sweep", rows, {})
        for r in rows:
            print(f"  -n {r['max_new_tokens']:>3}: mean answer {r['mean_answer_tokens']} tokens, {r['speedup']:.1f}x")
    if "cold" in parts:
        c = part_cold(args, data, store)
        write("cold", [], c)
        print(
            "cold "
            + ", ".join(f"{r['seconds']:.1f} s" for r in c["cold"])
            + "; warm "
            + ", ".join(f"{r['seconds']:.1f} s" for r in c["warm"])
        )
    if "loadahead" in parts:
        if not store.exists():
            kvstore("build", str(data), "--store", str(store), "-b", str(args.batch_size))
        write("loadahead", [], part_loadahead(args, data, store))
    if "variants" in parts:
        v = part_variants(args, data)
        write("variants", v.pop("rows"), v)
    if "overhead" in parts:
        o = part_overhead(args, data)
        write("overhead", [], o)
        print(
            f"store overhead {o['overhead_share']:.1%} of build wall (writer busy {o['writer_busy_share']:.1%}, "
            f"compute waited {o['waited_share']:.1%})"
        )


if __name__ == "__main__":
    main()
