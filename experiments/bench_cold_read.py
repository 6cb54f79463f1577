"""Cold reads from an LMDB store: the backend's ``readahead=False`` vs LMDB's default ``readahead=True``.

Reads the first ``--entries`` entries of a store through LMDB's zero-copy ``get`` (``buffers=True``)
and hashes every byte (what ``KVStore.open_entry``'s checksum pass does), after evicting the store
file from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (this file only; nothing else
is dropped). kvstore's LMDB backend opens environments with ``readahead=False``; LMDB then
advises ``MADV_RANDOM`` and every 4 KiB page of a cold entry is a separate synchronous read.
Alternates the two settings ``--repeats`` times.

This VM's idle reclaim drops the page cache every few minutes (``dmesg``: ``idle-reclaim:
drop_caches``), so a store read a while ago is cold again.

Command (from the repository root; needs a store, e.g. the one bench_e2e.py builds; the suite
``cold_read``: ``python -m experiments run cold_read STORE`` writes experiments/results/; run by hand
it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_cold_read.py cache/bench/e2e/store_40
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import xxhash

import benchlib as bl


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    p = bl.parser(__doc__, quick=False)
    p.add_argument("store", type=Path)
    p.add_argument("--entries", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = bl.start(p)
    data = args.store / "data.mdb"
    rows = []
    for r in range(args.repeats):
        for readahead in (False, True):
            env = lmdb.open(str(args.store), readonly=True, lock=False, readahead=readahead, subdir=True)
            try:
                with env.begin() as txn:
                    keys = [
                        bytes(k) for k in txn.cursor().iternext(keys=True, values=False) if bytes(k).startswith(b"e/")
                    ]
                keys = keys[: args.entries]
                evict(data)
                total = 0
                with bl.timed() as t, env.begin(buffers=True) as txn:
                    for k in keys:
                        buf = txn.get(k)
                        xxhash.xxh3_64_intdigest(buf)
                        total += len(buf)
                cold = t.seconds
                with bl.timed() as t, env.begin(buffers=True) as txn:
                    for k in keys:
                        xxhash.xxh3_64_intdigest(txn.get(k))
                warm = t.seconds
            finally:
                env.close()
            rows.append(
                {
                    "repeat": r,
                    "readahead": readahead,
                    "entries": len(keys),
                    "mb": round(total / 1e6, 1),
                    "cold_s": cold,
                    "cold_mb_s": total / cold / 1e6,
                    "warm_s": warm,
                    "warm_mb_s": total / warm / 1e6,
                }
            )
            print(
                f"readahead={readahead!s:<5} {total / 1e6:6.0f} MB cold {cold:6.2f} s ({total / cold / 1e6:6.0f} "
                "MB/s), "
                f"then warm {warm * 1e3:6.1f} ms ({total / warm / 1e6:6.0f} MB/s)",
                flush=True,
            )
    summary = {
        f"readahead={ra}": {k: bl.summarize([r[k] for r in rows if r["readahead"] == ra]) for k in ("cold_s", "warm_s")}
        for ra in (False, True)
    }
    bl.write_result("cold_read", params=vars(args), rows=rows, notes=summary)


if __name__ == "__main__":
    main()
