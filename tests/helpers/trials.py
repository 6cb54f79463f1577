"""Trials the reliability tests run a few times and the soak (``tests/reliability/test_soak.py``) hundreds of
times: ``kill -9`` during a build, random corruption of stored entries, concurrent builders and
samplers on one store."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from helpers.cli import build_argv, read_predictions, start_cli, store_keys, verify_store, write_dataset


@dataclass
class KillResult:
    """One ``kill -9`` of a running ``kvstore build``."""

    killed: bool  # the signal ended a running build (exit status -9)
    delay: float  # seconds from start to the kill
    before: int  # entries in the store when this build started
    seen: int  # entries seen committed (by a reader) before the kill
    after: int  # entries in the store after the kill
    lost: int  # seen but gone after the kill
    corrupt: int  # entries failing verification after the kill
    exitcode: int
    stderr_tail: str = ""


def kill_trial(
    argv: Sequence[str],
    store: Path,
    workdir: Path,
    rng: random.Random,
    *,
    mode: str = "after-write",
    window: float = 0.5,
    name: str = "build",
    start=None,
) -> KillResult:
    """Start ``kvstore ARGV`` (a build into ``store``) and ``kill -9`` it at a random moment.

    ``mode="uniform"``: ``window * U(0, 1)`` seconds after the start (may land while loading the
    model, creating the store, prefilling, committing or exiting). ``mode="after-write"``: once a
    reader sees the build's first new entry committed, after a further ``window * U(0, 1)`` s.
    A reader polls the store (read-only) until the kill: every entry it saw committed must still
    be there afterwards, and every entry must verify. ``start(argv, workdir, name)`` launches the
    process (default :func:`start_cli`).
    """
    before = store_keys(store, strict=False)
    p = (start or (lambda a, w, n: start_cli(a, w, name=n)))(argv, workdir, name)
    t0 = time.monotonic()
    deadline = t0 + window * rng.random() if mode == "uniform" else None
    seen = set(before)
    while p.alive():
        keys = store_keys(store, strict=False)
        if p.alive():  # only what was committed while the build ran counts as seen before the kill
            seen |= keys
        if deadline is None and len(keys) > len(before):
            deadline = time.monotonic() + window * rng.random()
        if deadline is not None and time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    killed = p.alive()
    delay = time.monotonic() - t0
    if killed:
        p.kill()
    code, _, err = p.wait()
    killed = killed and code == -signal.SIGKILL  # else it exited by itself just before the signal
    if (Path(store) / "data.mdb").exists():
        after = store_keys(store)  # strict: the store must open
        _, corrupt = verify_store(store)
    else:  # killed before it created the store: nothing can have been committed
        after, corrupt = set(), {}
    return KillResult(
        killed, round(delay, 3), len(before), len(seen), len(after), len(seen - after), len(corrupt), code, err[-300:]
    )


def damage_value(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Flip 1-8 random bytes (each XOR a non-zero mask) or truncate to a random shorter length."""
    if rng.random() < 0.3:
        n = rng.randrange(len(raw))
        return raw[:n], f"truncated to {n} of {len(raw)} bytes"
    out = bytearray(raw)
    positions = sorted(rng.sample(range(len(raw)), rng.randint(1, min(8, len(raw)))))
    for pos in positions:
        out[pos] ^= rng.randint(1, 255)
    return bytes(out), f"flipped bytes at {positions}"


def damage_entries(store: str | Path, keys: Iterable[str], rng: random.Random) -> dict[str, tuple[bytes, str]]:
    """Damage the stored values of ``keys`` through the backend (below the codec); returns
    {key: (original bytes, what was done)} so that the damage can be undone."""
    from kvstore.store.kvstore import KVStore

    done = {}
    with KVStore(str(store)) as s:
        for key in keys:
            bkey = b"e/" + key.encode()
            raw = bytes(s.backend.get(bkey))
            damaged, what = damage_value(raw, rng)
            s.backend.put(bkey, damaged)
            done[key] = (raw, what)
    return done


def restore_entries(store: str | Path, originals: dict[str, tuple[bytes, str]]) -> None:
    from kvstore.store.kvstore import KVStore

    with KVStore(str(store)) as s:
        s.backend.put_many([(b"e/" + k.encode(), raw) for k, (raw, _) in originals.items()])


def corruption_round(store: str | Path, rng: random.Random, n: int) -> dict:
    """Damage ``n`` random entries, check that verification names exactly those, undo the damage.
    Returns {"damaged": n, "detected": ..., "false_alarms": ..., "missed": [...]}."""
    keys = sorted(store_keys(store))
    chosen = rng.sample(keys, n)
    originals = damage_entries(store, chosen, rng)
    try:
        intact, corrupt = verify_store(store)
    finally:
        restore_entries(store, originals)
    return {
        "damaged": n,
        "detected": len(set(corrupt) & set(chosen)),
        "false_alarms": len(set(corrupt) - set(chosen)),
        "missed": [originals[k][1] for k in chosen if k not in corrupt],
    }


def concurrency_run(model_dir: Path, workdir: Path, *, n_contexts: int = 40, seed: int = 0) -> dict:
    """4 builders on overlapping slices of ``n_contexts`` contexts and 2 samplers (one writable,
    one ``--readonly-store``) into one LMDB store at once. Returns what the checks need."""
    rng = random.Random(seed)
    store = workdir / "store"
    # overlapping slices: every context is in at least one builder's dataset, most in two
    third = n_contexts // 3
    slices = [range(0, 2 * third), range(third, n_contexts), range(0, n_contexts, 2), range(1, n_contexts, 3)]
    builders = []
    for b, sl in enumerate(slices):
        ids = list(sl)
        rng.shuffle(ids)
        ds = write_dataset(workdir / f"build{b}.jsonl", ids, questions=1)
        builders.append(
            start_cli(
                build_argv(ds, model_dir, store, "--dtype", "float64", "--batch-size", str(1 + b % 3)),
                workdir,
                name=f"build{b}",
            )
        )
    # samplers need the store to exist (a read-only sampler refuses a missing store)
    t0 = time.monotonic()
    while not store_keys(store, strict=False) and time.monotonic() - t0 < 120:
        time.sleep(0.01)
    samplers = []
    for s_i, extra in enumerate([[], ["--readonly-store"]]):
        ids = rng.sample(range(n_contexts), n_contexts // 2)
        ds = write_dataset(workdir / f"sample{s_i}.jsonl", ids)
        argv = [
            "sample",
            ds,
            "--model",
            model_dir,
            "--store",
            store,
            "--dtype",
            "float64",
            "--quiet",
            "--format",
            "json",
            "-o",
            workdir / f"sample{s_i}.preds.jsonl",
            "--batch-size",
            "4",
            *extra,
        ]
        samplers.append(start_cli(argv, workdir, name=f"sample{s_i}"))
    results = {p.argv[0] + str(i): p.wait(300) for i, p in enumerate(builders + samplers)}
    return {
        "store": store,
        "results": results,
        "sampler_ids": [sorted(read_predictions(workdir / f"sample{i}.preds.jsonl")) for i in range(2)],
    }
