"""Reliability: crashes, corruption, concurrency, limits, foreign caches, hostile entries.

Each section proves one claim of the reliability issue on the real ``kvstore`` commands with the
tiny saved models. The CI versions are small (a few trials); ``experiments/reliability/soak.py``
runs the same trial functions (``kill_trial``, ``damage_entries``, ``concurrency_run``...) hundreds
of times and writes the figures down. Section 6 (bad input, Ctrl-C) is ``test_cli_errors.py``;
the decoder fuzz is ``test_fuzz.py``.

Commands that must run in their own process (to be killed, interrupted, or to run side by side)
are forked from a *zygote*: a multiprocessing forkserver that has imported torch, transformers
and the CLI once. Each child then runs the real entry point (``cli.main.main``) with its
stdout/stderr in files, and is a process like any other: ``kill -9`` and Ctrl-C reach it as they
would reach ``python -m cli.main``, without paying ~10-15 s of imports per process on a busy
2-core box. The zygote never runs a torch op, so forking it is safe. Commands that need no process
of their own run in-process through ``cli.main.main`` (same error boundary as the console script).
"""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# -- datasets ---------------------------------------------------------------------------------------
WORDS = (
    "the quick brown fox jumps over lazy dog capital of france is paris spider has eight legs "
    "once upon a time there was small model that stored its keys and values on disk every "
    "question about same context answered from cache hello how can help you today"
).split()


def context_text(i: int, *, words: tuple[int, int] = (20, 60)) -> str:
    """Context number ``i``: deterministic (same text for the same ``i`` in every dataset)."""
    rng = random.Random(1_000_003 * i + 7)
    n = rng.randint(*words)
    return f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def write_dataset(path: Path, contexts: Iterable[int], *, questions: int = 2, words: tuple[int, int] = (20, 60)) -> Path:
    """A JSON Lines QA file: ``questions`` rows per context number (ids unique per context)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for i in contexts:
            for q in range(questions):
                row = {
                    "id": f"c{i}-q{q}",
                    "context": context_text(i, words=words),
                    "question": f"What does document {i} say about {WORDS[(i + q) % len(WORDS)]}?",
                    "answers": [WORDS[(3 * i + q) % len(WORDS)]],
                }
                f.write(json.dumps(row) + "\n")
    return Path(path)


# -- running the CLI -------------------------------------------------------------------------------
def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``cli.main.main`` in-process; returns (exit code, stdout, stderr)."""
    from cli.main import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
        raise SystemExit(0)  # main() returns normally on success
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


def run_main_quiet(*args: str) -> tuple[int, str, str]:
    """``run_main`` without pytest's capsys (for the soak script): captures sys.stdout/stderr."""
    from cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code or 0
    return code, out.getvalue(), err.getvalue()


PRELOAD = [
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt_neox.modeling_gpt_neox",
    "transformers.tokenization_utils_tokenizers",
    "tokenizers",
    "safetensors.torch",
    "accelerate",
    "lmdb",
    "zstandard",
    "xxhash",
    "tqdm",
    "cli.main",
    "cli.common",
    "cli.workflow",
    "cli.manage",
    "kvstore.adapter",
    "kvstore.models",
    "kvstore.datasets",
    "kvstore.prompts",
    "kvstore.metrics",
    "kvstore.store",
    "kvstore.backends.lmdb",
]

_ZYGOTE = None


def zygote():
    """The forkserver context every CLI child is forked from (started once per process)."""
    global _ZYGOTE
    if _ZYGOTE is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _ZYGOTE = ctx
    return _ZYGOTE


def _cli_child(argv: list[str], out_path: str, err_path: str, env: dict[str, str], threads: int) -> None:
    """Body of a CLI child: its stdout/stderr go to files, then the real entry point runs."""
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True)
    import torch

    torch.set_num_threads(threads)
    from cli.main import main

    main(argv)


def _cli_env() -> dict[str, str]:
    names = ("KVSTORE_HOME", "KVSTORE_MODELS", "HF_HUB_OFFLINE", "KVSTORE_DEBUG", "TRANSFORMERS_OFFLINE")
    env = {k: os.environ[k] for k in names if k in os.environ}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("KVSTORE_DEBUG", "")
    return env


@dataclass
class CliProcess:
    """A ``kvstore`` command running in its own process (forked from the zygote)."""

    argv: list[str]
    out_path: Path
    err_path: Path
    proc: multiprocessing.process.BaseProcess
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        """``kill -9``."""
        os.kill(self.pid, signal.SIGKILL)

    def interrupt(self) -> None:
        """Ctrl-C."""
        os.kill(self.pid, signal.SIGINT)

    def wait(self, timeout: float = 180) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); a negative code is the signal that ended the process."""
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(10)
            raise TimeoutError(f"{' '.join(self.argv[:2])} did not finish in {timeout} s")
        return self.proc.exitcode, self.out_path.read_text(errors="replace"), self.err_path.read_text(errors="replace")


def start_cli(argv: Sequence[str], workdir: Path, *, name: str = "cli", threads: int = 1, env: dict | None = None) -> CliProcess:
    """Start ``kvstore ARGV...`` in a child process; its output goes to ``workdir/NAME.out|err``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out, err = workdir / f"{name}.out", workdir / f"{name}.err"
    out.write_bytes(b"")  # exists even if the child dies before it gets to open it
    err.write_bytes(b"")
    argv = [str(a) for a in argv]
    p = zygote().Process(target=_cli_child, args=(argv, str(out), str(err), {**_cli_env(), **(env or {})}, threads), daemon=False)
    p.start()
    return CliProcess(argv, out, err, p)


def store_keys(path: str | Path, *, strict: bool = True) -> set[str]:
    """Keys of the entries in a store, read through a read-only KVStore. With ``strict=False`` a
    store that does not exist yet (or is being created) has no keys."""
    from kvstore.errors import StoreError
    from kvstore.store import KVStore

    try:
        with KVStore(str(path), readonly=True) as s:
            return set(s.keys())
    except StoreError:
        if strict:
            raise
        return set()


def verify_store(path: str | Path) -> tuple[set[str], dict[str, str]]:
    """(intact keys, {corrupt key: reason}) after checking every byte of every entry."""
    from kvstore.store import KVStore

    with KVStore(str(path), readonly=True) as s:
        info = s.verify()
    return {e.key for e in info.entries}, {c.key: c.reason for c in info.corrupt}


def context_keys(model_dir: str | Path, contexts: Iterable[str], *, dtype: str = "float32") -> dict[str, str]:
    """Store key of each context as ``kvstore build --model MODEL_DIR --dtype DTYPE`` computes it
    (chat template when the tokenizer has one, as the CLI's default)."""
    from kvstore.adapter import Adapter
    from kvstore.prompts import PromptFormat

    a = Adapter.from_pretrained(str(model_dir), dtype=dtype, device="cpu")
    fmt = PromptFormat.from_chat_template(a.tokenizer) if getattr(a.tokenizer, "chat_template", None) else PromptFormat.plain()
    return {c: a.key(a.encode_context(fmt.context_part(c), special_tokens=fmt.add_special_tokens)) for c in contexts}


def read_predictions(path: str | Path) -> dict[str, dict]:
    """``sample -o`` output by row id."""
    return {r["id"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def nonblank_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# == 1. crash during build ===========================================================================
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


def kill_trial(argv: Sequence[str], store: Path, workdir: Path, rng: random.Random, *, mode: str = "after-write",
               window: float = 0.5, name: str = "build", start=None) -> KillResult:
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
    return KillResult(killed, round(delay, 3), len(before), len(seen), len(after), len(seen - after), len(corrupt), code,
                      err[-300:])


def build_argv(dataset: Path, model_dir: Path, store: Path, *extra: str) -> list[str]:
    return ["build", str(dataset), "--model", str(model_dir), "--store", str(store), "--quiet", "--format", "json", *extra]


def test_kill_9_during_build_loses_nothing(tiny_llama_dir, tmp_path, capsys):
    """Three kill -9 in a row on one store (each build resuming the last), then a clean finish."""
    n_contexts = 60
    dataset = write_dataset(tmp_path / "data.jsonl", range(n_contexts), questions=1, words=(30, 90))
    store = tmp_path / "store"
    argv = build_argv(dataset, tiny_llama_dir, store, "--batch-size", "1")
    rng = random.Random(20240601)
    results = []
    # right after a commit, a little later, then at any moment (loading, prefilling, committing...)
    for trial, (mode, window) in enumerate([("after-write", 0.0), ("after-write", 0.3), ("uniform", 1.0)]):
        r = kill_trial(argv, store, tmp_path / "logs", rng, mode=mode, window=window, name=f"kill{trial}")
        results.append(r)
        if trial == 1:
            assert len(store_keys(store)) < n_contexts, results  # the build was cut short: something to resume
        assert r.lost == 0 and r.corrupt == 0, r
        assert r.exitcode == -signal.SIGKILL or (not r.killed and r.exitcode == 0), r
        if r.after:
            code, out, err = run_main(capsys, "verify", "--store", store, "--quiet")
            assert code == 0 and "all intact" in out, err
    assert results[0].killed and results[0].seen > results[0].before, results  # a kill hit a build mid-write
    present = store_keys(store)
    from kvstore.store import KVStore

    with KVStore(str(store)):
        pass  # the store opens for writing after the kills (LMDB recovers the dead writer's lock)
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["contexts"] == n_contexts
    assert summary["skipped"] == len(present) and summary["built"] == n_contexts - len(present)
    intact, corrupt = verify_store(store)
    assert not corrupt and len(intact) == n_contexts and present <= intact
    assert set(context_keys(tiny_llama_dir, [context_text(i, words=(30, 90)) for i in range(n_contexts)]).values()) == intact


# == 2. corruption ====================================================================================
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
    from kvstore.store import KVStore

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
    from kvstore.store import KVStore

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


WARNING_RE = r"^kvstore: warning: entry ([0-9a-f]{16}) is corrupt \(.+\); treating it as a miss$"


def test_corrupt_entries_are_detected_recomputed_and_collected(tiny_llama_dir, tmp_path, capsys):
    import re

    n_contexts, n_bad = 8, 3
    contexts = [context_text(i) for i in range(n_contexts)]
    dataset = write_dataset(tmp_path / "data.jsonl", range(n_contexts))
    store = tmp_path / "store"
    common = ["--model", tiny_llama_dir, "--store", store, "--dtype", "float64", "--quiet"]
    assert run_main(capsys, "build", dataset, *common)[0] == 0
    keys = context_keys(tiny_llama_dir, contexts, dtype="float64")
    assert store_keys(store) == set(keys.values())

    rng = random.Random(7)
    bad = rng.sample(sorted(keys.values()), n_bad)
    damage_entries(store, bad, rng)

    # verify names exactly the damaged entries
    code, out, err = run_main(capsys, "verify", "--store", store, "--quiet")
    assert code == 1 and err == f"kvstore: error: {n_bad} of {n_contexts} entries corrupt; `kvstore gc --corrupt` removes them\n"
    assert {line.split()[1] for line in out.splitlines() if line.startswith("corrupt")} == set(bad)

    # sample: misses for the damaged contexts (one warning line each), same answers as --no-cache
    code, out, err = run_main(capsys, "sample", dataset, *common, "--readonly-store", "--format", "json", "-o", tmp_path / "cached.jsonl")
    assert code == 0, err
    warned = [re.match(WARNING_RE, line) for line in nonblank_lines(err)]
    assert all(warned), err
    assert {m.group(1) for m in warned} == {k[:16] for k in bad}
    code, _, err = run_main(capsys, "sample", dataset, *common, "--no-cache", "--format", "json", "-o", tmp_path / "reference.jsonl")
    assert code == 0, err
    cached, reference = read_predictions(tmp_path / "cached.jsonl"), read_predictions(tmp_path / "reference.jsonl")
    assert {i: r["raw_output"] for i, r in cached.items()} == {i: r["raw_output"] for i, r in reference.items()}
    context_of = {f"c{i}-q{q}": contexts[i] for i in range(n_contexts) for q in range(2)}
    assert {i: r["cache_hit"] for i, r in cached.items()} == {i: keys[context_of[i]] not in bad for i in cached}

    # gc removes exactly the damaged entries
    code, out, err = run_main(capsys, "gc", "--corrupt", "--yes", "--store", store, "--quiet")
    assert code == 0 and f"Removed {n_bad} entries" in out, err
    intact, corrupt = verify_store(store)
    assert not corrupt and intact == set(keys.values()) - set(bad)

    # a writable sample recomputes what is missing and repairs a damaged entry in place
    damage_entries(store, [sorted(intact)[0]], rng)
    code, out, err = run_main(capsys, "sample", dataset, *common, "--format", "json", "-o", tmp_path / "repaired.jsonl")
    assert code == 0 and len(nonblank_lines(err)) == 1 and re.match(WARNING_RE, err.strip()), err
    repaired = read_predictions(tmp_path / "repaired.jsonl")
    assert {i: r["raw_output"] for i, r in repaired.items()} == {i: r["raw_output"] for i, r in reference.items()}
    intact, corrupt = verify_store(store)
    assert not corrupt and intact == set(keys.values())


def test_random_corruptions_are_all_detected(tiny_llama_dir, tmp_path, capsys):
    """A few rounds of what the soak script does >= 1000 times."""
    dataset = write_dataset(tmp_path / "data.jsonl", range(12), questions=1)
    store = tmp_path / "store"
    assert run_main(capsys, "build", dataset, "--model", tiny_llama_dir, "--store", store, "--quiet")[0] == 0
    rng = random.Random(11)
    total = {"damaged": 0, "detected": 0, "false_alarms": 0}
    for _ in range(10):
        r = corruption_round(store, rng, rng.randint(1, 5))
        assert not r["missed"], r
        for k in total:
            total[k] += r[k]
    assert total["detected"] == total["damaged"] and total["false_alarms"] == 0
    intact, corrupt = verify_store(store)  # every round undid its damage
    assert len(intact) == 12 and not corrupt


# == 3. concurrency ===================================================================================
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
        builders.append(start_cli(build_argv(ds, model_dir, store, "--dtype", "float64", "--batch-size", str(1 + b % 3)),
                                  workdir, name=f"build{b}"))
    # samplers need the store to exist (a read-only sampler refuses a missing store)
    t0 = time.monotonic()
    while not store_keys(store, strict=False) and time.monotonic() - t0 < 120:
        time.sleep(0.01)
    samplers = []
    for s_i, extra in enumerate([[], ["--readonly-store"]]):
        ids = rng.sample(range(n_contexts), n_contexts // 2)
        ds = write_dataset(workdir / f"sample{s_i}.jsonl", ids)
        argv = ["sample", ds, "--model", model_dir, "--store", store, "--dtype", "float64", "--quiet", "--format", "json",
                "-o", workdir / f"sample{s_i}.preds.jsonl", "--batch-size", "4", *extra]
        samplers.append(start_cli(argv, workdir, name=f"sample{s_i}"))
    results = {p.argv[0] + str(i): p.wait(300) for i, p in enumerate(builders + samplers)}
    return {"store": store, "results": results, "sampler_ids": [sorted(read_predictions(workdir / f"sample{i}.preds.jsonl")) for i in range(2)]}


def test_concurrent_builders_and_samplers(tiny_llama_dir, tmp_path, capsys):
    n = 40
    run = concurrency_run(tiny_llama_dir, tmp_path, n_contexts=n)
    for name, (code, out, err) in run["results"].items():
        assert code == 0, (name, err)
        assert "Traceback" not in err and "corrupt" not in err and "error" not in err, (name, err)
    store = run["store"]
    intact, corrupt = verify_store(store)
    expected = set(context_keys(tiny_llama_dir, [context_text(i) for i in range(n)], dtype="float64").values())
    assert not corrupt and intact == expected  # every context, once (keys are content addresses)
    assert store_keys(store) == expected  # nothing else (no stray or duplicate records)
    # readers saw only complete entries: their answers are the reference's
    union = write_dataset(tmp_path / "union.jsonl", range(n))
    code, _, err = run_main(capsys, "sample", union, "--model", tiny_llama_dir, "--dtype", "float64", "--no-cache", "--quiet",
                            "--format", "json", "-o", tmp_path / "reference.jsonl")
    assert code == 0, err
    reference = read_predictions(tmp_path / "reference.jsonl")
    for i in range(2):
        got = read_predictions(tmp_path / f"sample{i}.preds.jsonl")
        assert {k: r["raw_output"] for k, r in got.items()} == {k: reference[k]["raw_output"] for k in got}


# == 4. limits ========================================================================================
def test_lmdb_map_filling_up_grows_during_a_build(tiny_llama, tmp_path):
    """A store whose map starts at 64 KiB takes a whole build (~1 MB) through the writer thread."""
    from kvstore.adapter import Adapter
    from kvstore.store import KVStore

    adapter = Adapter(*tiny_llama, name="tiny")
    contexts = [context_text(i) for i in range(24)]
    with KVStore(str(tmp_path / "store"), map_size=1 << 16) as s:
        report = adapter.generate_kv_cache(contexts, s, batch_size=4)
        grown = s.backend.env.info()["map_size"]
    assert report.built == 24 and report.stored_bytes > 4 * (1 << 16) and grown >= report.stored_bytes
    intact, corrupt = verify_store(tmp_path / "store")
    assert len(intact) == 24 and not corrupt


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (a disk that really fills up). Needs permission to mount: skipped otherwise."""
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a small tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_disk_full_is_one_clear_line_and_keeps_earlier_entries(tiny_llama_dir, small_fs, tmp_path, capsys):
    store = small_fs / "store"
    first = write_dataset(tmp_path / "first.jsonl", range(4), questions=1)
    common = ["--model", tiny_llama_dir, "--store", store, "--quiet", "--format", "json"]
    assert run_main(capsys, "build", first, *common)[0] == 0
    before = store_keys(store)
    assert len(before) == 4
    big = write_dataset(tmp_path / "big.jsonl", range(60), questions=1)  # ~2 MB of entries
    code, out, err = run_main(capsys, "build", big, *common)
    assert code == 1 and out == ""
    assert err == f"kvstore: error: disk full while writing to {store}; the entries stored before are intact - free space and re-run\n"
    intact, corrupt = verify_store(store)
    assert not corrupt and before <= intact and len(intact) < 60
    # free space and re-run: the build resumes
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_fs)], check=True, capture_output=True, timeout=30)
    code, out, err = run_main(capsys, "build", big, *common)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["skipped"] == len(intact) and summary["built"] == 60 - len(intact)
    intact, corrupt = verify_store(store)
    assert not corrupt and len(intact) == 60  # the first 4 contexts are among the 60


class _FailingEnv:
    """An LMDB environment whose write transactions fail to commit with ``error`` after
    ``ok_commits`` successful ones (a disk that fills up, simulated)."""

    def __init__(self, env, error: Exception, ok_commits: int):
        self._env, self._error, self._left = env, error, ok_commits

    def begin(self, *args, write: bool = False, **kwargs):
        txn = self._env.begin(*args, write=write, **kwargs)
        if not write:
            return txn
        if self._left > 0:
            self._left -= 1
            return txn
        env_error = self._error

        class Failing:
            def __enter__(self):
                return txn

            def __exit__(self, *exc):
                txn.abort()
                if exc[0] is None:
                    raise env_error
                return False

        return Failing()

    def __getattr__(self, name):
        return getattr(self._env, name)


def fail_lmdb_writes(monkeypatch, error: Exception, ok_commits: int = 0) -> None:
    import lmdb

    real_open = lmdb.open
    monkeypatch.setattr(lmdb, "open", lambda *a, **kw: _FailingEnv(real_open(*a, **kw), error, ok_commits))


@pytest.mark.parametrize(
    "message, free, expected",
    [
        ("mdb_txn_commit: No space left on device", 10 << 30, "StoreFullError"),
        ("mdb_txn_commit: Input/output error", 4096, "StoreFullError"),  # LMDB's word for a short write
        ("mdb_txn_commit: Input/output error", 10 << 30, "StoreError"),  # a real I/O error is not "disk full"
    ],
)
def test_simulated_write_failures(monkeypatch, tmp_path, message, free, expected):
    import types

    import lmdb

    import kvstore.errors as errors
    from kvstore.backends import lmdb as lmdb_backend
    from kvstore.store import KVStore

    from test_cli_manage import make_entry  # noqa: E402 - a small real entry

    entries = [make_entry(i) for i in range(3)]
    fail_lmdb_writes(monkeypatch, lmdb.Error(message), ok_commits=3)  # meta + 2 entries
    monkeypatch.setattr(lmdb_backend.shutil, "disk_usage", lambda p: types.SimpleNamespace(total=100 << 30, used=0, free=free))
    with KVStore(str(tmp_path / "s")) as s:
        s.put(entries[0])
        s.put(entries[1])
        with pytest.raises(errors.StoreError) as exc:
            s.put(entries[2])
    assert type(exc.value).__name__ == expected
    if expected == "StoreFullError":
        assert str(exc.value).startswith("disk full while writing to") and "intact" in str(exc.value)
    monkeypatch.undo()
    intact, corrupt = verify_store(tmp_path / "s")
    assert intact == {entries[0].key, entries[1].key} and not corrupt


def test_simulated_disk_full_during_a_cli_build(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    import lmdb

    dataset = write_dataset(tmp_path / "data.jsonl", range(10), questions=1)
    store = tmp_path / "store"
    fail_lmdb_writes(monkeypatch, lmdb.Error("mdb_txn_commit: No space left on device"), ok_commits=4)  # meta + 3 entries
    code, out, err = run_main(capsys, "build", dataset, "--model", tiny_llama_dir, "--store", store, "--quiet", "--batch-size", "2")
    monkeypatch.undo()
    assert code == 1 and out == "" and "Traceback" not in err
    assert err == f"kvstore: error: disk full while writing to {store}; the entries stored before are intact - free space and re-run\n"
    intact, corrupt = verify_store(store)
    assert len(intact) == 3 and not corrupt


# == 5. foreign caches =================================================================================
@pytest.fixture
def other_weights_dir(tiny_llama_dir, tmp_path):
    """The tiny llama with one weight changed: same architecture and tokenizer, other fingerprint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 0.5
    out = tmp_path / "other-weights"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(out)
    return out


def test_caches_of_another_model_or_dtype_are_misses(tiny_llama_dir, other_weights_dir, tmp_path, capsys):
    n = 6
    dataset = write_dataset(tmp_path / "data.jsonl", range(n))
    fp64, fp32 = tmp_path / "a-fp64", tmp_path / "a-fp32"
    for store, dtype in ((fp64, "float64"), (fp32, "float32")):
        assert run_main(capsys, "build", dataset, "--model", tiny_llama_dir, "--dtype", dtype, "--store", store, "--quiet")[0] == 0

    def sample(model, store, *extra) -> dict[str, dict]:
        out = tmp_path / f"preds-{len(list(tmp_path.glob('preds-*')))}.jsonl"
        args = ["sample", dataset, "--model", model, "--dtype", "float64", "--quiet", "--format", "json", "-o", out, *extra]
        code, _, err = run_main(capsys, *args, *(["--store", store, "--readonly-store"] if store else ["--no-cache"]))
        assert code == 0 and err == "", err
        return read_predictions(out)

    # the same model and dtype hits (so the misses below are not a broken lookup)
    assert all(r["cache_hit"] for r in sample(tiny_llama_dir, fp64).values())
    for model, store in ((other_weights_dir, fp64), (tiny_llama_dir, fp32)):  # other weights; other dtype
        before = store_keys(store)
        got, reference = sample(model, store), sample(model, None)
        assert not any(r["cache_hit"] for r in got.values())
        assert {k: r["raw_output"] for k, r in got.items()} == {k: r["raw_output"] for k, r in reference.items()}
        assert store_keys(store) == before


FORGERIES = ["more-layers", "kv-heads", "head-dim", "fewer-tokens", "dtype", "model", "token-ids"]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_entry_that_does_not_fit_the_model_is_a_miss(forgery, tmp_path):
    """An entry stored under the right key whose tensors do not fit the model (a bug, a hash
    collision or tampering) is never used: the row is computed, and the entry replaced."""
    import torch

    from kvstore.adapter import Adapter
    from kvstore.store import Entry, KVStore
    from tiny import make_tiny_model

    adapter = Adapter(*make_tiny_model("llama", dtype=torch.float64), name="tiny")
    ctx = adapter.encode_context(context_text(0))
    question = adapter.encode_question("What does it say?")
    reference = adapter.greedy_sample([ctx], [question], 8, use_cache=False)
    key = adapter.key(ctx)
    layers = [(1.5 * k, 1.5 * v) for k, v in adapter.prefill([ctx])[0]]  # a hit would change the answer
    ids, fingerprint = torch.tensor(ctx), adapter.fingerprint
    if forgery == "more-layers":
        layers.append(layers[0])
    elif forgery == "kv-heads":
        layers = [(torch.cat([k, k]), torch.cat([v, v])) for k, v in layers]
    elif forgery == "head-dim":
        layers = [(k[..., :4].contiguous(), v[..., :4].contiguous()) for k, v in layers]
    elif forgery == "fewer-tokens":
        layers, ids = [(k[:, 1:].contiguous(), v[:, 1:].contiguous()) for k, v in layers], ids[1:]
    elif forgery == "dtype":
        layers = [(k.float(), v.float()) for k, v in layers]
    elif forgery == "model":
        fingerprint = "0" * 64
    elif forgery == "token-ids":
        ids = ids.flip(0)
    with KVStore(str(tmp_path / "store")) as s:
        s.put(Entry(key, fingerprint, "forged", ids, tuple(layers)))
        result = adapter.greedy_sample([ctx], [question], 8, store=s, return_details=True)
    assert result.cache_hit == [False]
    assert torch.equal(result.tokens, reference)
    with KVStore(str(tmp_path / "store"), readonly=True) as s:
        assert s.get(key).model == adapter.fingerprint  # replaced by the real thing


# == 7. hostile entries ===============================================================================
def _kv_entry(codec: str, n_layers: int = 1, n_tokens: int = 6, head_dim: int = 8) -> bytes:
    import torch

    from kvstore.entry import encode_entry

    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(2, n_tokens, head_dim, generator=g), torch.randn(2, n_tokens, head_dim, generator=g)) for _ in range(n_layers)]
    return encode_entry(key="k" * 64, model="f" * 64, model_name="tiny", token_ids=list(range(n_tokens)), layers=layers,
                        codec=codec, created=1.7e9)


def _split(blob: bytes) -> tuple[dict, bytes]:
    from kvstore.entry import read_header

    _, offset = read_header(blob)
    return json.loads(blob[12:offset]), blob[offset:-8]


def _assemble(header: dict | bytes, payload: bytes) -> bytes:
    """An entry with a valid checksum around any header and payload (what an attacker writes)."""
    import struct

    import xxhash

    from kvstore.entry import MAGIC

    h = header if isinstance(header, bytes) else json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<I", len(h)) + h + payload
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def _rle_frame(content: int, declared: int | None) -> bytes:
    """A zstd frame of ``content`` zero bytes in 128 KiB RLE blocks (4 bytes each: a bomb),
    whose header declares ``declared`` bytes (None: no size in the header)."""
    import struct

    head = struct.pack("<I", 0xFD2FB528)
    head += bytes([0x00, 0x38]) if declared is None else bytes([0xC0, 0x38]) + struct.pack("<Q", declared)
    out, left = bytearray(head), content
    while left:
        n = min(left, 1 << 17)
        left -= n
        out += ((n << 3) | (1 << 1) | (left == 0)).to_bytes(3, "little") + b"\0"
    return bytes(out)


def _with_frame(header: dict, payload: bytes, index: int, frame: bytes, declared: int | None = None) -> bytes:
    frames = header["codec"]["frames"]
    parts, pos = [], 0
    for c, _ in frames:
        parts.append(payload[pos : pos + c])
        pos += c
    parts[index] = frame
    header = json.loads(json.dumps(header))
    header["codec"]["frames"][index][0] = len(frame)
    if declared is not None:
        grow = declared - header["codec"]["frames"][index][1]
        header["codec"]["frames"][index][1] = declared
        header["raw_bytes"] += grow
    return _assemble(header, b"".join(parts))


def hostile_entries() -> dict[str, bytes]:
    """Entries with valid checksums built to make a decoder allocate gigabytes or crash."""
    import struct

    z_header, z_payload = _split(_kv_entry("zstd:1"))
    r_header, r_payload = _split(_kv_entry("raw"))
    (n,) = struct.unpack_from("<Q", r_payload)
    st = json.loads(r_payload[8 : 8 + n])

    def st_edit(edit) -> bytes:
        s = json.loads(json.dumps(st))
        edit(s)
        text = json.dumps(s).encode()
        text += b" " * (-len(text) % 8)
        new = struct.pack("<Q", len(text)) + text + r_payload[8 + n :]
        return _assemble(dict(r_header, raw_bytes=len(new)), new)

    gib = 1 << 30
    tensor0 = z_header["codec"]["frames"][1][1]  # bytes of layers.0.keys, as the frame table says
    big_tokens = dict(z_header, n_tokens=gib)
    big_tokens["raw_bytes"] = 2 * 2 * 8 * 4 * gib + 8 * gib
    return {
        "zstd frame declares 4 GiB": _with_frame(z_header, z_payload, 1, _rle_frame(4 * gib, 4 * gib)),
        "zstd frame and table declare 4 GiB": _with_frame(z_header, z_payload, 1, _rle_frame(4 * gib, 4 * gib), declared=4 * gib),
        "zstd frame expands to 1 GiB, declares nothing": _with_frame(z_header, z_payload, 1, _rle_frame(gib, None)),
        "zstd frame declares its tensor's size, expands to 1 GiB": _with_frame(z_header, z_payload, 1, _rle_frame(gib, tensor0)),
        "header declares 2**30 tokens consistently": _assemble(big_tokens, z_payload),
        "header declares 2**40 raw bytes": _assemble(dict(z_header, raw_bytes=1 << 40), z_payload),
        "safetensors header length 2**63": _assemble(r_header, struct.pack("<Q", 1 << 63) + r_payload[8:]),
        "safetensors huge shape": st_edit(lambda s: s["layers.0.keys"].update(shape=[gib, gib, gib])),
        "safetensors offsets beyond the data": st_edit(lambda s: s["layers.0.keys"].update(data_offsets=[0, 1 << 62])),
        "safetensors overlapping tensors": st_edit(lambda s: s["layers.0.values"].update(data_offsets=s["layers.0.keys"]["data_offsets"])),
        "entry header nested 100k deep": _assemble(b"[" * 100_000, r_payload),
        "entry header length 2**32-1": _assemble(r_header, r_payload)[:8] + struct.pack("<I", 0xFFFFFFFF) + r_payload,
    }


def _decode_all_child(blobs: dict[str, bytes], result_path: str, control_mib: int) -> None:
    """Decode each blob, recording the outcome and how much the peak RSS grew (KiB)."""
    from kvstore.entry import decode_entry
    from kvstore.errors import KVStoreError

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    base = peak()
    outcomes = {}
    for name, blob in blobs.items():
        try:
            decode_entry(blob, threads=4)
            outcomes[name] = "decoded"
        except KVStoreError as exc:
            outcomes[name] = type(exc).__name__
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcomes[name] = f"{type(exc).__name__}: {exc}"
    hostile = peak() - base
    control = b"\1" * (control_mib << 20)  # the measurement must see an allocation this size
    Path(result_path).write_text(json.dumps({"outcomes": outcomes, "hostile_kib": hostile, "control_kib": peak() - base, "n": len(control)}))


def test_hostile_entries_are_rejected_with_bounded_memory(tmp_path):
    blobs = hostile_entries()
    result = tmp_path / "result.json"
    p = zygote().Process(target=_decode_all_child, args=(blobs, str(result), 256))
    p.start()
    p.join(300)
    assert p.exitcode == 0
    r = json.loads(result.read_text())
    assert r["outcomes"] == {name: "CorruptEntryError" for name in blobs}
    assert r["hostile_kib"] < 64 << 10, r  # peak RSS grew by less than 64 MiB over all of them
    assert r["control_kib"] > 200 << 10, r  # while a 256 MiB allocation does show


FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve", "marshal", "pickletools"}
FORBIDDEN_CALLS = {"eval", "exec", "__import__", "compile"}
FORBIDDEN_ATTRS = {"torch.load", "torch.serialization", "numpy.load", "np.load", "torch.jit.load", "torch.package"}
FORBIDDEN_KEYWORDS = {("weights_only", False), ("allow_pickle", True), ("trust_remote_code", True)}


def _dotted(node) -> str:
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def code_execution_risks(source: str, filename: str = "<source>") -> list[str]:
    """Uses of pickle-family modules, torch.load & co, eval/exec, and the keyword arguments that
    switch loaders into executing code, found in the syntax tree (docstrings saying "never
    pickle" are not uses)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{where}: from {mod} import ...")
            found += [f"{where}: from {mod} import {a.name}" for a in node.names if f"{mod}.{a.name}" in FORBIDDEN_ATTRS]
        elif isinstance(node, ast.Attribute) and _dotted(node) in FORBIDDEN_ATTRS:
            found.append(f"{where}: {_dotted(node)}")
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
                found.append(f"{where}: {node.func.id}()")
            for kw in node.keywords:
                if isinstance(kw.value, ast.Constant) and (kw.arg, kw.value.value) in FORBIDDEN_KEYWORDS:
                    found.append(f"{where}: {kw.arg}={kw.value.value}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_MODULES:
            found.append(f"{where}: {node.id}")
    return found


def test_the_risk_scanner_finds_what_it_looks_for():
    for bad in (
        "import pickle", "from pickle import loads", "import torch\ntorch.load(f)", "from torch import load",
        "x = eval('1')", "load_file(p, weights_only=False)", "np.load(f, allow_pickle=True)", "import dill as d",
        "AutoModel.from_pretrained(p, trust_remote_code=True)", "torch.serialization.load(f)", "import marshal",
    ):
        assert code_execution_risks(bad), bad
    assert not code_execution_risks('"""Never pickle, never torch.load."""\nimport json\njson.loads("1")\n')


def test_no_pickle_or_code_execution_in_the_library():
    """Everything under kvstore/ (the store, entry, codec, backends, adapter, keys... and every
    module they import from kvstore) is free of pickle, torch.load, eval/exec and the like."""
    import kvstore.adapter  # noqa: F401 - the load path and what it imports
    import kvstore.store  # noqa: F401

    files = sorted((REPO / "kvstore").rglob("*.py"))
    loaded = {Path(m.__file__).resolve() for name, m in sys.modules.items() if name.startswith("kvstore") and getattr(m, "__file__", None)}
    assert loaded <= set(files)  # the scan covers every kvstore module the load path imports
    assert {"store.py", "entry.py", "codec.py", "adapter.py", "keys.py", "lmdb.py"} <= {f.name for f in files}
    risks = [r for f in files for r in code_execution_risks(f.read_text(), str(f.relative_to(REPO)))]
    assert not risks, risks


def test_load_path_runs_with_pickle_and_torch_load_disabled(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """Every unpickler raises: putting, verifying, loading and sampling from a store still work."""
    import pickle

    import numpy
    import torch

    from kvstore.adapter import Adapter
    from kvstore.store import KVStore

    dataset = write_dataset(tmp_path / "data.jsonl", range(3))
    store = tmp_path / "store"
    adapter = Adapter.from_pretrained(str(tiny_llama_dir))
    contexts = [context_text(i) for i in range(3)]

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling on the kvstore load path")

    for obj, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                      (torch.serialization, "load"), (numpy, "load")):
        monkeypatch.setattr(obj, name, refuse)
    with KVStore(str(store)) as s:
        adapter.generate_kv_cache(contexts, s)
        tokens = adapter.greedy_sample(contexts, ["What?"] * 3, 4, store=s, return_details=True)
        assert all(tokens.cache_hit)
        assert all(s.get(k) is not None for k in s.keys())
        assert not s.verify().corrupt
    code, _, err = run_main(capsys, "sample", dataset, "--model", tiny_llama_dir, "--store", store, "--quiet", "--readonly-store")
    assert code == 0, err
