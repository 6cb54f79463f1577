"""S3 backend: load throughput vs boto3's own GET, `kvstore sample` from S3 / S3 + local tier / LMDB,
sharded builds, and a paper estimate for the 1.7 TiB Pythia example.

Everything runs against a private SeaweedFS (``weed mini``, tests/helpers/seaweed.py) on 127.0.0.1
with its data under cache/bench/, on the same 2 cores as the client: the server's CPU is part of
every figure (SeaweedFS spends ~1.3-1.6 CPU-s per GiB read and 9-17 per GiB written here).

* ``load``: values of 10, 50 and 200 MB (random bytes: transport does not care about content),
  written once, then loaded round-robin per repeat by boto3's plain ``get_object().read()``
  (one GET, the reference) and by ``S3Backend.view`` (first part + parallel ranged GETs pinned
  by If-Match into one buffer; 4 and 8 threads). MB/s = 10^6 bytes per second; client CPU is
  this process's user+sys seconds per GB.
* ``sample``: the demo dataset (22 contexts, 78 questions) with the bundled SmolLM2-135M-Instruct
  in float32, built once into LMDB and synced to S3. Each repeat times what ``kvstore sample``
  does after loading the model (open the store, greedy_sample, close) for LMDB, S3, S3 behind a
  cold local tier (emptied before each repeat) and a warm one, with 20 new tokens (the CLI's
  default) and with 1 (where loading matters most). Answers must be identical everywhere.
* ``shards``: ``kvstore build`` of the demo dataset into a fresh S3 prefix, as one process (2 torch
  threads) and as two concurrent ``--shard i/2`` processes (1 thread each); wall time including
  each process's start and model load.
* ``failures``: seconds until the one-line error with the default timeouts (connect 5 s, read
  15 s, 3 tries): nothing listening, an endpoint that accepts and never answers, a wrong secret,
  a missing bucket, the server killed during a 200 MB put.
* ``estimate``: no measurement; bytes, objects, requests, transfer time and list-price cost of the
  `kvstore size` Pythia example (8 models x 225 contexts x 2048 tokens, float32) built by N
  machines into one bucket. Every assumption is in the output.

Command (from the repository root; the suite ``s3``: ``python -m experiments run s3 [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/):

    .venv/bin/python experiments/bench_s3.py                     # all parts, 5 repeats (sample: 3)
    .venv/bin/python experiments/bench_s3.py --parts load --repeats 7
    .venv/bin/python experiments/bench_s3.py --quick             # smoke test: small sizes, 2 repeats
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import uuid

import benchlib as bl

bl.use_test_helpers()  # the SeaweedFS helper lives with the test fixtures

from helpers.seaweed import SeaweedServer  # noqa: E402

MB = 10**6
DEMO = bl.HERE / "data" / "demo.jsonl"


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def mbps(nbytes: int, summary: dict) -> dict:
    """Seconds (median/min/max) -> MB/s (the fastest run gives the max)."""
    return {
        "median": nbytes / summary["median"] / MB,
        "min": nbytes / summary["max"] / MB,
        "max": nbytes / summary["min"] / MB,
    }


# -- load throughput ----------------------------------------------------------------------------------
def part_load(server: SeaweedServer, sizes_mb: list[int], repeats: int) -> list[dict]:
    from kvstore.store.backends.s3 import S3Backend

    raw = server.client()
    raw.create_bucket(Bucket="load")
    backends = {t: S3Backend("s3://load/kv", threads=t) for t in (4, 8)}
    rows = []
    try:
        for size_mb in sizes_mb:
            nbytes = size_mb * MB
            key = f"e/{uuid.uuid4().hex}{uuid.uuid4().hex}".encode()
            backends[8].put(key, os.urandom(nbytes))
            name = backends[8]._name(key)

            def boto3_get():
                data = raw.get_object(Bucket="load", Key=name)["Body"].read()
                assert len(data) == nbytes

            def via_backend(b):
                with b.view(key) as buf:
                    assert buf is not None and len(buf) == nbytes

            methods = {"boto3 get_object().read()": boto3_get}
            methods |= {f"S3Backend.view, {t} threads": (lambda b=b: via_backend(b)) for t, b in backends.items()}
            for fn in methods.values():
                fn()  # warm-up: connections, page cache on the server
            times: dict[str, list[float]] = {m: [] for m in methods}
            cpu = dict.fromkeys(methods, 0.0)
            for _ in range(repeats):
                for m, fn in methods.items():
                    gc.collect()  # outside the measured CPU time (bl.repeat would count it)
                    gc.disable()
                    try:
                        c0 = cpu_seconds()
                        with bl.timed() as t:
                            fn()
                        times[m].append(t.seconds)
                        cpu[m] += cpu_seconds() - c0
                    finally:
                        gc.enable()
            ref = bl.summarize(times["boto3 get_object().read()"])["median"]
            for m, ts in times.items():
                s = bl.summarize(ts)
                rate = mbps(nbytes, s)
                rows.append(
                    {
                        "size_mb": size_mb,
                        "method": m,
                        "mb_s_median": round(rate["median"], 1),
                        "mb_s_min": round(rate["min"], 1),
                        "mb_s_max": round(rate["max"], 1),
                        "vs_boto3_median": round(ref / s["median"], 3),
                        "client_cpu_s_per_gb": round(cpu[m] / (repeats * nbytes / 1e9), 3),
                        "repeats": s["n"],
                    }
                )
                print(f"  {size_mb:>4} MB  {m:<28} {rate['median']:7.1f} MB/s (min {rate['min']:.1f}, max "
                      f"{rate['max']:.1f})  x{ref / s['median']:.2f} of boto3", flush=True)  # fmt: skip
            backends[8].delete(key)
    finally:
        for b in backends.values():
            b.close()
    return rows


# -- kvstore sample -----------------------------------------------------------------------------------
def part_sample(server: SeaweedServer, repeats: int, new_tokens: list[int]) -> list[dict]:
    from kvstore.data.datasets import load_dataset
    from kvstore.data.prompts import PromptFormat
    from kvstore.store.kvstore import KVStore
    from kvstore.store.transfer import sync

    adapter = bl.load_adapter("float32")
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    data = load_dataset(str(DEMO))
    contexts = [fmt.context_part(ex.context) for ex in data.examples]
    questions = [fmt.question_part(ex.question) for ex in data.examples]
    scratch = bl.SCRATCH / "s3"
    lmdb = scratch / "lmdb"
    shutil.rmtree(lmdb, ignore_errors=True)
    with KVStore(str(lmdb)) as kv:
        report = adapter.generate_kv_cache(sorted(set(contexts)), kv, special_tokens=fmt.add_special_tokens)
    server.client().create_bucket(Bucket="sample")
    url = "s3://sample/demo"
    sync(str(lmdb), url)
    print(f"  built {report.built} contexts ({report.stored_bytes / MB:.0f} MB stored) into LMDB and S3", flush=True)
    cache = scratch / "tier"
    variants = {
        "LMDB": (str(lmdb), {}, False),
        "S3": (url, {}, False),
        "S3 + cold tier": (url, {"cache_dir": str(cache)}, True),
        "S3 + warm tier": (url, {"cache_dir": str(cache)}, False),
    }
    rows = []
    for n in new_tokens:
        answers: dict[str, list] = {}

        def run(store: str, options: dict, variant: str) -> None:
            with KVStore(store, readonly=True, **options) as kv:
                result = adapter.greedy_sample(contexts, questions, n, store=kv, batch_size=8,
                                               special_tokens=fmt.add_special_tokens, return_details=True)  # fmt: skip
            assert all(result.cache_hit), variant
            answers[variant] = result.tokens.tolist()

        times: dict[str, list[float]] = {v: [] for v in variants}
        for v, (store, options, _) in variants.items():  # warm-up (fills the tier for the warm variant)
            run(store, options, v)
        for _ in range(repeats):
            for v, (store, options, cold) in variants.items():
                if cold:
                    shutil.rmtree(cache, ignore_errors=True)
                times[v] += bl.repeat(lambda s=store, o=options, v=v: run(s, o, v), 1, warmup=0)
        same = all(a == answers["LMDB"] for a in answers.values())
        ref = bl.summarize(times["LMDB"])["median"]
        for v, ts in times.items():
            s = bl.summarize(ts)
            rows.append(
                {
                    "new_tokens": n,
                    "store": v,
                    "seconds_median": round(s["median"], 3),
                    "seconds_min": round(s["min"], 3),
                    "seconds_max": round(s["max"], 3),
                    "vs_lmdb_median": round(s["median"] / ref, 3),
                    "questions": len(questions),
                    "same_answers_as_lmdb": same,
                    "repeats": s["n"],
                }
            )
            print(f"  -n {n:<3} {v:<16} {s['median']:.2f} s (min {s['min']:.2f}, max {s['max']:.2f})  "
                  f"x{s['median'] / ref:.2f} of LMDB  same answers: {same}", flush=True)  # fmt: skip
    return rows


# -- sharded builds -----------------------------------------------------------------------------------
def part_shards(server: SeaweedServer, repeats: int) -> list[dict]:
    server.client().create_bucket(Bucket="shards")
    env = {**os.environ, **server.env(), "KVSTORE_DEBUG": "", "HF_HUB_OFFLINE": "1"}

    def build(shards: int) -> None:
        prefix = f"s3://shards/{shards}-{uuid.uuid4().hex[:8]}"
        argv = [sys.executable, "-m", "kvstore", "build", str(DEMO), "--store", prefix, "--quiet", "--format", "json"]
        threads = str(2 // shards)
        procs = [
            subprocess.Popen(argv + (["--shard", f"{i}/{shards}"] if shards > 1 else []), cwd=bl.ROOT,
                             env=env | {"OMP_NUM_THREADS": threads}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i in range(shards)
        ]  # fmt: skip
        built = 0
        for p in procs:
            out, err = p.communicate(timeout=1800)
            assert p.returncode == 0, err.decode()
            built += json.loads(out)["built"]
        assert built == 22, built

    rows = []
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats):
        for shards in times:
            times[shards] += bl.repeat(lambda s=shards: build(s), 1, warmup=0)
    for shards, ts in times.items():
        s = bl.summarize(ts)
        rows.append(
            {
                "processes": shards,
                "torch_threads_each": 2 // shards,
                "seconds_median": round(s["median"], 2),
                "seconds_min": round(s["min"], 2),
                "seconds_max": round(s["max"], 2),
                "repeats": s["n"],
            }
        )
        print(f"  {shards} process(es): {s['median']:.1f} s (min {s['min']:.1f}, max {s['max']:.1f})", flush=True)
    return rows


# -- failures ------------------------------------------------------------------------------------------
def part_failures(server: SeaweedServer) -> list[dict]:
    """Seconds from the call to the one-line error, with the backend's default timeouts."""
    import socket
    import threading

    from kvstore.errors import KVStoreError
    from kvstore.store.backends.s3 import S3Backend

    server.client().create_bucket(Bucket="failures")
    rows = []

    def timed(case: str, fn) -> None:
        t = bl.timed()
        try:
            fn()
            message, kind = "no error", ""
        except KVStoreError as exc:
            message, kind = str(exc), type(exc).__name__
        seconds = t.elapsed()
        rows.append({"case": case, "seconds": round(seconds, 2), "error": kind, "message": message})
        print(f"  {case:<44} {seconds:6.2f} s  {kind}: {message}", flush=True)

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    try:
        from helpers.seaweed import free_ports

        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_ports(1)[0]}"
        timed("connection refused (nothing listening)", lambda: S3Backend("s3://failures/kv"))
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(16)
            os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{silent.getsockname()[1]}"
            timed("endpoint accepts, never answers", lambda: S3Backend("s3://failures/kv"))
    finally:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = "wrong"
    timed("wrong secret key", lambda: S3Backend("s3://failures/kv"))
    os.environ["AWS_SECRET_ACCESS_KEY"] = secret
    timed("missing bucket", lambda: S3Backend("s3://no-such-bucket/kv"))
    backend = S3Backend("s3://failures/kv")
    threading.Timer(0.3, server.kill).start()
    timed("server SIGKILLed during a 200 MB put", lambda: backend.put(b"e/dead", os.urandom(200 * MB)))
    backend.close()
    server.start()
    return rows


# -- the Pythia example on paper ----------------------------------------------------------------------
ASSUMPTIONS = {
    "part_bytes": 8 << 20,
    "multipart_threshold_bytes": 64 << 20,
    "per_machine_upload_MB_s": 500,
    "per_machine_download_MB_s": 1000,
    "price_storage_usd_per_GB_month": 0.023,
    "price_put_usd_per_1000": 0.005,
    "price_get_usd_per_1000": 0.0004,
    "price_transfer_out_internet_usd_per_GB": 0.09,
    "source_of_prices": "S3 Standard list prices for us-east-1 (first 50 TB tier) as published by AWS; "
    "transfer in and to compute in the same region is free. Check current prices before relying on them.",
    "bandwidth_note": "an instance with >= 10 Gbit/s and 8 parallel part requests; not measured here (this "
    "box's loopback SeaweedFS is CPU-bound at ~60-115 MB/s for writes)",
    "codec": "raw float32 bytes as `kvstore size` counts them; zstd-shuffle stores fp32 KV ~1.2x smaller",
}


def part_estimate(machines: list[int]) -> dict:
    from kvstore.size.estimate import size_report

    report = size_report()
    a = ASSUMPTIONS
    entries, total_bytes, puts, gets = 0, 0, 0, 0
    per_model = []
    for r in report.estimates:
        size = r.bytes_per_example
        parts = -(-size // a["part_bytes"])
        put_requests = 1 if size <= a["multipart_threshold_bytes"] else parts + 2  # create + parts + complete
        per_model.append({"model": r.model, "entry_bytes": size, "entries": r.examples, "parts_per_entry": parts,
                          "put_requests_per_entry": put_requests})  # fmt: skip
        entries += r.examples
        total_bytes += size * r.examples
        puts += put_requests * r.examples
        gets += parts * r.examples  # one full read of every entry
    objects = 2 * entries + 1  # entries, their access-time records, the description
    puts += entries + 1
    gb = total_bytes / 1e9
    out = {
        "assumptions": a,
        "total_bytes": total_bytes,
        "total_TiB": round(total_bytes / 2**40, 3),
        "entries": entries,
        "objects": objects,
        "put_requests_build": puts,
        "get_requests_one_full_read": gets,
        "storage_usd_per_month": round(gb * a["price_storage_usd_per_GB_month"], 2),
        "put_requests_usd": round(puts / 1000 * a["price_put_usd_per_1000"], 2),
        "get_requests_usd_per_full_read": round(gets / 1000 * a["price_get_usd_per_1000"], 2),
        "transfer_out_internet_usd_per_full_read": round(gb * a["price_transfer_out_internet_usd_per_GB"], 2),
        "per_model": per_model,
        "machines": [
            {
                "machines": n,
                "upload_minutes": round(total_bytes / (n * a["per_machine_upload_MB_s"] * MB) / 60, 1),
                "full_read_minutes": round(total_bytes / (n * a["per_machine_download_MB_s"] * MB) / 60, 1),
                "entries_per_machine": -(-entries // n),
            }
            for n in machines
        ],
    }
    print(f"  {out['total_TiB']} TiB in {entries} entries ({objects} objects), {puts} PUT-class requests; "
          f"${out['storage_usd_per_month']}/month stored", flush=True)  # fmt: skip
    return out


def main() -> None:
    p = bl.parser(__doc__)
    p.add_argument("--parts", default="load,sample,shards,failures,estimate")
    p.add_argument("--sizes-mb", default="10,50,200")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sample-repeats", type=int, default=3)
    p.add_argument("--new-tokens", default="20,1")
    args = bl.start(p, quick=dict(sizes_mb="10,50", repeats=2, sample_repeats=1, new_tokens="1"))
    parts = args.parts.split(",")
    root = bl.SCRATCH / "s3" / "seaweed"
    shutil.rmtree(root, ignore_errors=True)
    server = SeaweedServer(root)
    server.start()
    os.environ.update(server.env())
    try:
        import boto3

        peers = {"boto3": boto3.__version__, "server": "SeaweedFS 4.48 (weed mini) on 127.0.0.1, same machine"}
        for part in parts:
            print(f"{part}:", flush=True)
            if part == "load":
                rows = part_load(server, [int(x) for x in args.sizes_mb.split(",")], args.repeats)
            elif part == "sample":
                rows = part_sample(server, args.sample_repeats, [int(x) for x in args.new_tokens.split(",")])
            elif part == "shards":
                rows = part_shards(server, max(1, args.repeats // 2))
            elif part == "failures":
                rows = part_failures(server)
            elif part == "estimate":  # on paper: its assumptions are its parameters
                estimate = part_estimate([1, 2, 8, 32])
                bl.write_result("s3_estimate", params={"assumptions": estimate.pop("assumptions")}, rows=[],
                                notes=estimate)  # fmt: skip
                continue
            else:
                raise SystemExit(f"unknown part {part!r}")
            bl.write_result(f"s3_{part}", params=vars(args), rows=rows, machine=peers)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
