"""The host side of a load into accelerator memory, against a plain memcpy of the same bytes.

What runs on the CPU before the copy engine takes over (``kvstore.model.io.staging``): open a
stored chain in a warm LMDB store and decode every key and value record of every chunk into the
staging ring's host slots, each chunk's checksum computed while its bytes are copied
(``kvstore.store.fused``; the host-to-device copy and the device-side scatter are left out: no GPU
here, and on one they run on the copy engine and the device while the next chunk decodes).
Methods, each run on every thread count of ``--thread-sweep``:

* ``memcpy``: the same number of bytes, held in ordinary memory one contiguous tensor per chunk,
  copied into the same preallocated slots on the same threads (one piece per thread): the fair
  baseline, the copy a load cannot avoid;
* ``staged:CODEC``: the load as it runs (hash while copying);
* ``verify-first:CODEC``: the same load in the order before hash-while-copy: every chunk's
  checksum verified (in parallel over chunks), then the chunks copied;
* ``write:file``, ``write:lmdb`` and its variants (``--write-lengths``, one thread): the write
  path: the ``raw`` store's entries written to an LMDB environment opened as kvstore opens its
  stores (one synced transaction per entry), against a plain sequential write of the same bytes
  to the same disk (``x_file``), each made durable before the clock stops; the variants: LMDB's
  ``writemap``; ``metasync`` off (LMDB: integrity kept, the last transaction may be undone by a
  system crash); every entry in one transaction (``batch``); commits unsynced and one
  ``env.sync()`` for all (``nosync+sync``: durable at the end, but LMDB does not keep a database
  intact through a system crash between); ``writemap`` with ``map_async`` and one ``env.sync()``.
  ``--tunables`` (default ``glibc.malloc.hugetlb=1``; empty: none) runs ``write:file`` and
  ``write:lmdb`` again in a child process started with ``GLIBC_TUNABLES`` set so (``+tunables``
  rows): LMDB copies a value into pages it allocates per commit, which glibc gives fresh from the
  kernel for values over 32 MiB;
* ``read:file``, ``warm:raw``, ``cold:raw``, ``cold-no-readahead:raw`` (``--cold-lengths``, 2
  threads; the page cache dropped before each cold run, ``/proc/sys/vm/drop_caches``, root only:
  left out, with a note, where refused): a sequential read of the ``raw`` store's data file, and
  the staged load through a store opened afresh, warm, cold, and cold without the read-ahead a
  chain's opening turns on (``x_file``: against the cold sequential read);
* ``checksum:raw``: the checksum pass alone, over the stored bytes of the ``raw`` store;
  ``copy-only:raw``: the staged load with no checksum at all (not a load kvstore does: what the
  checksum costs); ``open:raw``: the chain opened and its records paired with their places,
  nothing copied (what a load costs besides copying and hashing).

GB/s are KV bytes (decoded) per second for every method, so the ratio ``staged / memcpy`` (the
same thread count, the same run) is what the store's host side costs against the copy it cannot
avoid.

The KV is shaped like Llama-3.1-8B's (32 layers, 8 KV heads, head_dim 128, bfloat16: 128 KiB per
token, 64 MiB per 512-token chunk), random normal values (scale 2; the high byte of bf16 compresses
as a real cache's does, the low byte not at all), stored as the store stores them (512-token
chunks, ``raw`` and the default ``zstd-split:1:16``). Every timing: min / median / max over
``--repeats`` runs after one warm-up, the methods alternating within each repeat, the load average
recorded per row and the machine in the result.

Command (from the repository root; the suite ``load_host``: ``python -m experiments run load_host
[ARGS]`` writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_load_host.py                    # 512, 2048, 8192 tokens; 1, 2 threads
    .venv/bin/python experiments/bench_load_host.py --thread-sweep 4,8,16   # a GPU host
    .venv/bin/python experiments/bench_load_host.py --quick            # smoke run
    .venv/bin/python experiments/bench_load_host.py --write-only --lengths 2048   # rows as JSON (the child)
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import torch

import benchlib as bl

CODECS = ("raw", "zstd-split:1:16")
LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 512


def _chain(n_tokens: int, seed: int):
    from kvstore.store.entry import Entry
    from kvstore.store.keys import chain_keys, chain_seed

    ids = bl.synthetic_ids(n_tokens, seed=seed)
    spans = [(s, min(s + CHUNK, n_tokens)) for s in range(0, n_tokens, CHUNK)]
    keys = chain_keys(chain_seed("b" * 64, torch.bfloat16, device="cuda", attn="sdpa"), ids, spans)
    g = torch.Generator().manual_seed(seed)
    parent = ""
    for key, (a, b) in zip(keys, spans):
        layers = tuple(
            tuple((torch.randn(KV_HEADS, b - a, HEAD_DIM, generator=g) * 2).to(torch.bfloat16) for _ in range(2))
            for _ in range(LAYERS)
        )
        yield Entry(key, "b" * 64, "llama-3.1-8b-shape", torch.tensor(ids[a:b]), layers, parent=parent, start=a,
                    numerics={"device": "cuda", "attn": "sdpa"})  # fmt: skip
        parent = key


def main() -> None:
    p = bl.parser(__doc__)
    p.add_argument("--lengths", default="512,2048,8192")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--thread-sweep", default="1,2", help="decode threads, comma-separated")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--write-lengths", default="2048", help="context lengths whose write path is measured too")
    p.add_argument("--tunables", default="glibc.malloc.hugetlb=1", help="GLIBC_TUNABLES of the writes' second run")
    p.add_argument("--cold-lengths", default="2048", help="context lengths read cold too (needs root)")
    p.add_argument("--cold-repeats", type=int, default=5)
    p.add_argument("--write-only", action="store_true", help="only the writes of --lengths; rows printed as JSON")
    args = bl.start(p, {"lengths": "512,1024", "repeats": 2, "write_lengths": "512", "cold_lengths": "512",
                        "cold_repeats": 1})  # fmt: skip
    if args.write_only:
        print(json.dumps(_write_rows(args, [int(x) for x in args.lengths.split(",")])))
        return
    from kvstore.model.compute.cache import new_buffers
    from kvstore.model.io.ring import Ring
    from kvstore.model.io.staging import Staging
    from kvstore.parallel import run_all
    from kvstore.store.frame import verify_checksum
    from kvstore.store.kvstore import KVStore

    class HostRing(Ring):
        """The staging ring with its device side left out: the host side alone."""

        def send(self, slot, used, places):  # noqa: ARG002 - the copy engine's part, not measured here
            return None

    codecs = args.codecs.split(",")
    sweep = [int(t) for t in args.thread_sweep.split(",")]
    scratch = bl.SCRATCH / "load_host"
    rows: list[dict] = []
    notes: dict = {}
    for n in [int(x) for x in args.lengths.split(",")]:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        stores = {c: KVStore(str(scratch / str(i)), codec=c, sync=False) for i, c in enumerate(codecs)}
        try:
            sources, keys = [], []
            for entry in _chain(n, seed=1000 + n):
                for store in stores.values():
                    store.put(entry)
                sources.append(torch.cat([t.reshape(-1) for kv in entry.layers for t in kv]).view(torch.uint8))
                keys.append(entry.key)
            kv_bytes = sum(s.numel() for s in sources)
            bufs = new_buffers([(KV_HEADS, HEAD_DIM, HEAD_DIM)] * LAYERS, 1, n, torch.bfloat16, torch.device("cpu"))
            ring = HostRing(torch.device("cpu"), force=True)

            def load(store: KVStore, threads: int, first: bool | None, copy: bool = True) -> None:
                """The staged load (``first``: every checksum verified before any chunk is copied;
                None: none verified; ``copy`` False: the chain opened, nothing copied)."""
                st = Staging(torch.device("cpu"), force=True, ring=ring)
                with store.open_chain(keys, lazy=True, defer=True) as views:
                    assert len(views) == len(keys) and all(v.unverified is not None for v in views)
                    chunks = []  # paired as kvstore.model.stages.load pairs them: row 0's views, cut per chunk
                    rows = [(kb[0], vb[0]) for kb, vb in bufs]
                    for view in views:
                        h = view.header
                        chunks.append([(kv[r], rows[i][r][:, h.start : h.end])
                                       for i, kv in enumerate(view.layers) for r in (0, 1)])  # fmt: skip
                    frames = [v.unverified for v in views]
                    if not copy:
                        return
                    if first:
                        errors = run_all([functools.partial(verify_checksum, f) for f in frames], threads)
                        assert not any(errors), errors
                    sent, err = st.load_chunks(chunks, threads, None if first in (True, None) else frames)
                    assert err is None and sent == len(keys), err
                    assert st.counts["chunks"] == len(keys)

            def memcpy(threads: int) -> None:
                with ring.lock:
                    for src in sources:
                        slot = ring.acquire(src.numel())
                        step = -(-src.numel() // threads)
                        pieces = [(slot.host[i : i + step], src[i : i + step]) for i in range(0, src.numel(), step)]
                        run_all([functools.partial(torch.Tensor.copy_, d, s) for d, s in pieces], threads)

            blobs = {c: [s.backend.get(f"e/{k}".encode()) for k in keys] for c, s in stores.items()}

            def checksum(codec: str, threads: int) -> None:  # the stored bytes, copied out before the timing
                run_all([functools.partial(verify_checksum, b) for b in blobs[codec]], threads)

            for threads in sweep:
                methods = {"memcpy": functools.partial(memcpy, threads)}
                for c, s in stores.items():
                    methods[f"staged:{c}"] = functools.partial(load, s, threads, False)
                    methods[f"verify-first:{c}"] = functools.partial(load, s, threads, True)
                if "raw" in stores:  # where the time goes: the checksum alone, the copy alone, the opening alone
                    methods["checksum:raw"] = functools.partial(checksum, "raw", threads)
                    methods["copy-only:raw"] = functools.partial(load, stores["raw"], threads, None)
                    methods["open:raw"] = functools.partial(load, stores["raw"], threads, None, False)
                rows += _measure(methods, args.repeats, n, threads, kv_bytes, blobs, ring)
            if str(n) in args.write_lengths.split(",") and "raw" in blobs:
                writes = _writes(blobs["raw"], scratch / "writes")
                rows += _measure(writes, args.repeats, n, 1, sum(len(b) for b in blobs["raw"]), blobs, ring,
                                 baseline="write:file")  # fmt: skip
                if args.tunables:
                    rows += _child_writes(args, n)
            if str(n) in args.cold_lengths.split(",") and "raw" in stores:
                stores["raw"].close()  # a map that is still open keeps its pages in the page cache
                cold = _cold(
                    str(scratch / str(codecs.index("raw"))), keys, functools.partial(load_into, bufs, ring), notes
                )
                if cold:
                    rows += _measure(cold, args.cold_repeats, n, 2, kv_bytes, blobs, ring, baseline="read:file")
        finally:
            for store in stores.values():
                store.close()
            shutil.rmtree(scratch, ignore_errors=True)
    bl.write_result("load_host", params=vars(args) | {"shape": [LAYERS, KV_HEADS, HEAD_DIM], "chunk": CHUNK},
                    rows=rows, notes=notes)  # fmt: skip


def load_into(bufs, ring, store, keys: list[str], threads: int) -> None:
    """The staged load of ``keys`` from ``store`` into row 0 of ``bufs`` through ``ring``."""
    from kvstore.model.io.staging import Staging

    st = Staging(torch.device("cpu"), force=True, ring=ring)
    rows = [(kb[0], vb[0]) for kb, vb in bufs]
    with store.open_chain(keys, lazy=True, defer=True) as views:
        chunks = [[(kv[r], rows[i][r][:, v.header.start : v.header.end]) for i, kv in enumerate(v.layers)
                   for r in (0, 1)] for v in views]  # fmt: skip
        sent, err = st.load_chunks(chunks, threads, [v.unverified for v in views])
    assert err is None and sent == len(keys), err


def _drop_caches() -> bool:
    """Drop the page cache (root only); whether it was."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def _cold(path: str, keys: list[str], load, notes: dict) -> dict:
    """The cold-read methods over the ``raw`` store at ``path`` (closed by the caller), each opening
    it afresh; none, and a note, where the page cache cannot be dropped."""
    import contextlib

    from kvstore.store.kvstore import KVStore

    if not _drop_caches():
        notes["cold"] = "not measured: dropping the page cache (/proc/sys/vm/drop_caches) was refused"
        return {}
    data = f"{path}/data.mdb"

    def read_file() -> None:
        with open(data, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass

    def staged(read_ahead: bool = True) -> None:
        with KVStore(path, readonly=True) as store:
            if not read_ahead:  # as before issue 46's read-ahead: LMDB's advice alone
                store.backend.read_ahead = contextlib.nullcontext  # type: ignore[method-assign]
            load(store, keys, 2)

    # a cold method's page cache is dropped before its clock starts (_measure's ``before``)
    return {"read:file": (_drop_caches, read_file), "warm:raw": staged, "cold:raw": (_drop_caches, staged),
            "cold-no-readahead:raw": (_drop_caches, functools.partial(staged, False))}  # fmt: skip


def _write_rows(args, lengths: list[int]) -> list[dict]:
    """The write path of contexts of ``lengths`` alone (``--write-only``: the child of
    :func:`_child_writes`)."""
    from kvstore.store.kvstore import KVStore

    rows, scratch = [], bl.SCRATCH / "load_host_writes"
    for n in lengths:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        blob_list = []
        with KVStore(str(scratch / "raw"), codec="raw", sync=False) as store:
            for entry in _chain(n, seed=1000 + n):
                store.put(entry)
                blob_list.append(bytes(store.backend.get(f"e/{entry.key}".encode())))
        writes = _writes(blob_list, scratch / "writes")
        writes = {m: writes[m] for m in ("write:file", "write:lmdb")}
        rows += _measure(writes, args.repeats, n, 1, sum(map(len, blob_list)), {"raw": blob_list}, None,
                         baseline="write:file")  # fmt: skip
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def _child_writes(args, n: int) -> list[dict]:
    """``write:file`` and ``write:lmdb`` again in a child process started with ``GLIBC_TUNABLES``
    set to ``--tunables``: rows named ``... +tunables``."""
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--write-only", "--lengths", str(n), "--repeats", str(args.repeats),
           "--threads", str(args.threads)]  # fmt: skip
    out = subprocess.run(cmd, env=os.environ | {"GLIBC_TUNABLES": args.tunables}, check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    rows = json.loads(out.strip().splitlines()[-1])
    for row in rows:
        row["method"] += " +tunables"
        row["tunables"] = args.tunables
    return rows


def _writes(blobs: list[bytes], where) -> dict:
    """The write path against a plain sequential write of the same bytes (``blobs``: the stored
    chunk entries) to the same disk, each made durable (fsync) before the clock stops:
    ``write:file`` one file; ``write:lmdb`` an LMDB environment opened as kvstore opens its stores,
    one write transaction per entry (as the writer commits), synced; the variants of the module
    docstring."""
    import lmdb

    def file() -> None:
        where.mkdir(parents=True, exist_ok=True)
        path = where / "plain"
        with open(path, "wb") as f:
            for b in blobs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        path.unlink()

    def store(writemap: bool = False, sync: bool = True, metasync: bool = True, per_txn: int = 1,
              map_async: bool = False) -> None:  # fmt: skip
        path = where / "lmdb"
        shutil.rmtree(path, ignore_errors=True)
        env = lmdb.open(str(path), map_size=4 * sum(len(b) for b in blobs), subdir=True, sync=sync, metasync=metasync,
                        readahead=False, meminit=False, writemap=writemap, map_async=map_async,
                        max_spare_txns=0)  # fmt: skip
        try:
            for i in range(0, len(blobs), per_txn):
                with env.begin(write=True) as txn:
                    for j, b in enumerate(blobs[i : i + per_txn], start=i):
                        txn.put(b"e/%d" % j, b)
            if not sync:
                env.sync(True)  # the one flush that makes them durable
        finally:
            env.close()
            shutil.rmtree(path, ignore_errors=True)

    p = functools.partial
    return {"write:file": file, "write:lmdb": store, "write:lmdb-writemap": p(store, writemap=True),
            "write:lmdb-nometasync": p(store, metasync=False), "write:lmdb-batch": p(store, per_txn=len(blobs)),
            "write:lmdb-nosync+sync": p(store, sync=False, metasync=False),
            "write:lmdb-writemap-async+sync": p(store, writemap=True, sync=False, metasync=False,
                                                map_async=True)}  # fmt: skip


def _measure(methods, repeats: int, n: int, threads: int, kv_bytes: int, blobs, ring, *,
             baseline: str = "memcpy") -> list[dict]:  # fmt: skip
    """Time ``methods`` (alternating, ``repeats`` times after a warm-up): one row per method, its
    ratio to ``baseline`` (``x_memcpy``; ``x_file`` for the write path and cold reads)."""
    # a method may be ``(before, fn)``: ``before`` runs ahead of each timing, off the clock
    steps = {m: fn if isinstance(fn, tuple) else (None, fn) for m, fn in methods.items()}
    for _, fn in steps.values():  # warm-up: page cache, the ring's slots, the thread pool
        fn()
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(repeats):
        for m, (before, fn) in steps.items():
            if before is not None:
                before()
            with bl.timed() as t:
                fn()
            times[m].append(t.seconds)
    base_med = bl.summarize(times[baseline])["median"]
    ratio = "x_memcpy" if baseline == "memcpy" else "x_file"
    rows = []
    for m in methods:
        s = bl.summarize(times[m])
        codec = m.partition(":")[2] or None
        stored = sum(len(b) for b in blobs[codec]) if codec in blobs else None
        row = {"context_tokens": n, "threads": threads, "method": m, "kv_bytes": kv_bytes, "stored_bytes": stored,
               "n": s["n"], "min_ms": s["min"] * 1e3, "median_ms": s["median"] * 1e3, "max_ms": s["max"] * 1e3,
               "gbps_median": kv_bytes / s["median"] / 1e9, "gbps_max": kv_bytes / s["min"] / 1e9,
               ratio: base_med / s["median"], "slot_allocations": ring.allocations if ring is not None else None,
               "loadavg": bl.loadavg()}  # fmt: skip
        rows.append(row)
        print(f"{n:>6} t={threads} {m:<24} median {row['median_ms']:8.1f} ms (min {row['min_ms']:.1f}, max "
              f"{row['max_ms']:.1f})  {row['gbps_median']:5.2f} GB/s  {ratio} {row[ratio]:.2f}  "
              f"(load avg {row['loadavg']})", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
