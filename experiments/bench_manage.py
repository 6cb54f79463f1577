"""Managing a large store: ``kvstore ls``, ``stats``, ``verify``, ``gc --dry-run`` and ``sync`` as whole
commands at 10^4 and 10^5 entries, and the Python memory of a scan per entry (issue 35, item 3).

The store is made by hand, without a model: contexts of a made-up float32 model with a tiny shape
(2 layers, 2 KV heads, head_dim 4) as chains of ~10 chunks of 8 tokens (groups of 5 contexts share
their first 2 chunks, as prompts with a common head do), under the default codec, plus a pressed
cache and scores for every 10th context (derived entries) and last-use records for half the chunks;
entries go in through the backend in batches (one LMDB transaction per 2,000 values). ``--sizes``
counts every stored entry (chunks and derived entries); an empty store is measured too.

Each command runs as ``python -m kvstore CMD --store STORE`` in a fresh process (interpreter start
and imports included; the rows ``command``), ``--repeats`` rounds after one untimed warm-up round
(the page cache warm), the commands taking turns within a round (so that a burst of load from other
jobs falls on all of them); ``sync`` copies into a new LMDB store each time. The same commands on an
empty store give what a command costs before it reads anything (starting Python, importing torch).
The rows ``in_process`` time the same commands through click in one process that imported everything
first (a warm-up round, then the rounds): the commands' own work, on which linearity is judged. The
scan's memory is measured in a child process: ``tracemalloc``'s peak while ``KVStore.scan()`` runs
(and the result it holds), over the entries. The goal (issue 35): time linear in entries, at most
0.5 KB of Python memory per entry.

Command (from the repository root; the suite ``manage``: ``python -m experiments run manage`` writes
experiments/results/manage.json; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_manage.py               # 10^4 and 10^5 entries, 3 repeats
    .venv/bin/python experiments/bench_manage.py --quick       # 2,000 and 5,000 entries, 1 repeat
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

WORK = bl.SCRATCH / "manage"
COMMANDS = {
    "ls": ["ls"],
    "stats": ["stats"],
    "verify": ["verify", "-q"],
    "gc --dry-run": ["gc", "--dry-run", "-q"],
    "sync": ["sync"],
}
CHUNK_TOKENS, CHUNKS, SHARED, GROUP = 8, 10, 2, 5  # tokens per chunk, chunks per context, shared head, group
DERIVED_EVERY = 10  # every 10th context has a pressed cache and scores


def make_store(path: Path, n_entries: int, seed: int = 0) -> dict:
    """A store of about ``n_entries`` entries (see the module docstring); returns its counts."""
    import torch

    from kvstore.store.entry import Entry
    from kvstore.store.keys import chain_keys, chain_seed
    from kvstore.store.keyspace import access_key, derived_entry_key, entry_key, record_key
    from kvstore.store.kind_pressed import encode_pressed
    from kvstore.store.kind_scores import encode_scores
    from kvstore.store.kvstore import KVStore
    from kvstore.store.owned import DerivedFacts
    from kvstore.store.scan import ContextRecord

    fp = "b" * 64
    seed_key = chain_seed(fp, torch.float32, device="cpu", attn="sdpa")
    g = torch.Generator().manual_seed(seed)
    now = time.time()
    counts = {"contexts": 0, "chunks": 0, "derived": 0, "access": 0}
    seen: set[str] = set()
    with KVStore(str(path), chunk_tokens=CHUNK_TOKENS) as store:
        batch: list[tuple[bytes, bytes]] = []

        def flush(force: bool = False) -> None:
            if batch and (force or len(batch) >= 2000):
                store.backend.put_many(batch)
                batch.clear()

        c = 0
        while counts["chunks"] + counts["derived"] < n_entries:
            head = [7, 7, c // GROUP] * (SHARED * CHUNK_TOKENS // 3 + 1)
            ids = head[: SHARED * CHUNK_TOKENS] + torch.randint(100, 1000, ((CHUNKS - SHARED) * CHUNK_TOKENS,),
                                                                generator=g).tolist()  # fmt: skip
            spans = [(s, s + CHUNK_TOKENS) for s in range(0, len(ids), CHUNK_TOKENS)]
            keys = chain_keys(seed_key, ids, spans)
            parent = ""
            for key, (start, end) in zip(keys, spans):
                if key not in seen:
                    seen.add(key)
                    layers = tuple((torch.randn(2, end - start, 4, generator=g), torch.randn(2, end - start, 4,
                                    generator=g)) for _ in range(2))  # fmt: skip
                    entry = Entry(key, fp, "bench-tiny", torch.tensor(ids[start:end]), layers, now - c, parent, start,
                                  numerics={"device": "cpu", "attn": "sdpa"})  # fmt: skip
                    batch.append((entry_key(key), store.encode(entry)))
                    counts["chunks"] += 1
                    if counts["chunks"] % 2:
                        batch.append((access_key(key), struct.pack("<d", now - c / 2)))
                        counts["access"] += 1
                parent = key
            context = keys[-1]
            batch.append((record_key(context), ContextRecord(context, tuple(keys), len(ids), now - c).to_bytes()))
            if c % DERIVED_EVERY == 0:
                facts = DerivedFacts(context, fp, "bench-tiny", "float32", len(ids), {"device": "cpu", "attn": "sdpa"})
                scores = [torch.rand(2, len(ids), generator=g) for _ in range(2)]
                key, blob = encode_scores(facts, "knorm", {"method": "knorm"}, scores, "raw")
                batch.append((derived_entry_key(context, key), blob))
                kept = [[(torch.randn(len(ids) // 2, 4, generator=g), torch.randn(len(ids) // 2, 4, generator=g),
                          torch.arange(0, len(ids), 2)) for _ in range(2)] for _ in range(2)]  # fmt: skip
                key, blob = encode_pressed(facts, "knorm:0.5", {"method": "knorm", "ratio": 0.5}, kept, "raw")
                batch.append((derived_entry_key(context, key), blob))
                counts["derived"] += 2
            counts["contexts"] += 1
            c += 1
            flush()
        flush(force=True)
    return counts


_MEASURE = """
import json, sys, time, tracemalloc
from kvstore.store.kvstore import KVStore
with KVStore(sys.argv[1], readonly=True) as s:
    tracemalloc.start()
    t0 = time.perf_counter()
    info = s.scan()
    seconds = time.perf_counter() - t0
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
print(json.dumps({"peak_bytes": peak, "held_bytes": current, "seconds_traced": seconds,
                  "entries": info.n_entries + len(info.derived), "contexts": len(info.contexts)}))
"""


_IN_PROCESS = """
import json, shutil, sys, time
from click.testing import CliRunner
from kvstore.cli.main import app
store, repeats, commands = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
runner, out = CliRunner(), {name: [] for name in commands}
for r in range(repeats + 1):
    for name, argv in commands.items():
        if name == "sync":
            shutil.rmtree(store + "-sync-in", ignore_errors=True)
            argv = argv + [store, store + "-sync-in", "-q"]
        else:
            argv = argv + ["--store", store]
        t0 = time.perf_counter()
        done = runner.invoke(app, argv)
        seconds = time.perf_counter() - t0
        assert done.exit_code == 0, (argv, done.output)
        if r:
            out[name].append(seconds)
print(json.dumps(out))
"""


def in_process(names: list[str], store: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds of each command's own work: run through click in one process that imported
    everything first (a warm-up round, then ``repeats`` rounds, the commands taking turns)."""
    commands = json.dumps({name: COMMANDS[name] for name in names})
    argv = [sys.executable, "-c", _IN_PROCESS, str(store), str(repeats), commands]
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def scan_memory(path: Path) -> dict:
    """tracemalloc's peak and what the result holds, while ``KVStore.scan()`` runs in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_command(name: str, store: Path) -> float:
    """Seconds of one whole command (a fresh process)."""
    argv = [sys.executable, "-m", "kvstore", *COMMANDS[name]]
    if name == "sync":
        dst = store.parent / f"{store.name}-sync"
        shutil.rmtree(dst, ignore_errors=True)
        argv += [str(store), str(dst), "-q"]
    else:
        argv += ["--store", str(store)]
    with bl.timed() as t:
        done = subprocess.run(argv, capture_output=True, text=True)
    seconds = t.seconds
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return seconds


def timed(names: list[str], store: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds of each command over ``repeats`` rounds after a warm-up round, the commands taking turns."""
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats + 1):
        for name in names:
            seconds = run_command(name, store)
            if r:
                out[name].append(seconds)
    return out


def main() -> None:
    ap = bl.parser(__doc__)
    ap.add_argument("--sizes", default="10000,100000", help="entries per store, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--commands", default=",".join(COMMANDS))
    args = bl.start(ap, {"sizes": "2000,5000", "repeats": 1}, wait=False)
    load = bl.wait_for_quiet(max_wait_s=args.wait)
    sizes = [0] + [int(s) for s in args.sizes.split(",")]
    names = [c for c in args.commands.split(",") if c]
    rows: list[dict] = []
    per_size: dict[int, dict] = {}
    for n in sizes:
        store = WORK / f"store_{n}"
        if not (store / "data.mdb").exists():
            shutil.rmtree(store, ignore_errors=True)
            made = bl.timed()
            counts = make_store(store, n)
            (store / "counts.json").write_text(json.dumps(counts))
            print(f"made {store} in {made.elapsed():.0f} s: {counts}", flush=True)
        counts = json.loads((store / "counts.json").read_text())
        entries = counts["chunks"] + counts["derived"]
        per_size[n] = {"entries": entries}
        if entries:
            memory = scan_memory(store)
            memory["per_entry"] = memory["peak_bytes"] / entries
            rows.append({"entries": entries, "measure": "scan_memory", **counts, **memory})
            print(f"{entries:>7} entries: scan peak {memory['peak_bytes'] / 2**20:.1f} MiB, "
                  f"{memory['per_entry']:.0f} B per entry", flush=True)  # fmt: skip
            per_size[n]["per_entry"] = memory["per_entry"]
        for measure, times_of in (("command", timed), ("in_process", in_process)):
            for name, times in times_of(names, store, args.repeats).items():
                stats = bl.summarize(times)
                rows.append({"entries": entries, "measure": measure, "command": f"kvstore {name}", **stats,
                             "seconds": times})  # fmt: skip
                per_size[n][(measure, name)] = stats["median"]
                print(f"{entries:>7} entries: {measure:<10} kvstore {name:<13} median {bl.fmt_s(stats['median'])} "
                      f"(min {bl.fmt_s(stats['min'])}, max {bl.fmt_s(stats['max'])})", flush=True)  # fmt: skip
    notes: dict = {"load_before": load}
    empty, sized = per_size[0], sizes[1:]
    above = {n: {name: per_size[n]["command", name] - empty["command", name] for name in names} for n in sized}
    notes["whole_command_seconds_above_an_empty_store"] = {str(per_size[n]["entries"]): above[n] for n in sized}
    notes["in_process_microseconds_per_entry"] = {
        str(per_size[n]["entries"]): {
            name: round(per_size[n]["in_process", name] / per_size[n]["entries"] * 1e6, 1) for name in names
        }
        for n in sized
    }
    if len(sized) >= 2:
        small, big = sized[0], sized[-1]
        notes["linearity"] = {
            "entries_ratio": round(per_size[big]["entries"] / per_size[small]["entries"], 3),
            "in_process_time_ratio": {
                name: round(per_size[big]["in_process", name] / per_size[small]["in_process", name], 3)
                for name in names
            },
            "whole_command_time_ratio_above_an_empty_store": {
                name: round(above[big][name] / above[small][name], 3) if above[small][name] > 0 else None
                for name in names
            },
            "memory_per_entry_ratio": round(per_size[big]["per_entry"] / per_size[small]["per_entry"], 3),
        }
    notes["goal"] = {
        "memory_per_entry_bytes_max": 512,
        "memory_met": all(v["per_entry"] <= 512 for v in per_size.values() if "per_entry" in v),
    }
    bl.write_result("manage", params=vars(args) | {"chunk_tokens": CHUNK_TOKENS, "chunks_per_context": CHUNKS,
                    "shared_chunks": SHARED, "derived_every": DERIVED_EVERY}, rows=rows, notes=notes)  # fmt: skip


if __name__ == "__main__":
    main()
