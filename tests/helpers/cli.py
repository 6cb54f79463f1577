"""Running ``kvstore`` commands from tests: in-process (``run_main``), or in a process of their
own forked from a *zygote* (``start_cli``) or started as a real ``python -m kvstore`` process
(``SubprocessCli``), plus small datasets and store inspection.

The zygote is a multiprocessing forkserver that has imported torch, transformers and the CLI once.
Each child runs the real entry point (``kvstore.cli.main.main``) with its stdout/stderr in files
and is a process like any other: ``kill -9`` and Ctrl-C reach it as they would reach
``python -m kvstore``, without paying ~10-15 s of imports per process on a busy 2-core box. The
zygote never runs a torch op, so forking it is safe.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.paths import REPO

# what `kvstore sample` prints for an entry that failed verification
WARNING_RE = r"^kvstore: warning: entry ([0-9a-f]{16}) is corrupt \(.+\); treating it as a miss$"

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


def write_dataset(
    path: Path, contexts: Iterable[int], *, questions: int = 2, words: tuple[int, int] = (20, 60)
) -> Path:
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
    """Run ``kvstore.cli.main.main`` in-process; returns (exit code, stdout, stderr)."""
    from kvstore.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
        raise SystemExit(0)  # main() returns normally on success
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


def run_main_quiet(*args: str) -> tuple[int, str, str]:
    """``run_main`` without pytest's capsys (for the soak script): captures sys.stdout/stderr."""
    from kvstore.cli.main import main

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
    "kvstore.cli.main",
    "kvstore.cli.common",
    "kvstore.cli.workflow",
    "kvstore.cli.manage",
    "kvstore.model.adapter",
    "kvstore.model.load.loading",
    "kvstore.data.datasets",
    "kvstore.data.prompts",
    "kvstore.data.metrics",
    "kvstore.store.kvstore",
    "kvstore.store.backends.lmdb",
    # the S3 backend's client (crash-point children on S3); a missing boto3 is skipped
    "boto3",
    "botocore.client",
    "kvstore.store.backends.s3",
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
    # Ctrl-C as in a terminal: a test run started in the background of a script (`cmd &`) inherits
    # SIGINT ignored, and the child would then never see the interrupt a test sends
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True)
    import torch

    torch.set_num_threads(threads)
    from kvstore.cli.main import main

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


def start_cli(
    argv: Sequence[str], workdir: Path, *, name: str = "cli", threads: int = 1, env: dict | None = None
) -> CliProcess:
    """Start ``kvstore ARGV...`` in a child process; its output goes to ``workdir/NAME.out|err``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out, err = workdir / f"{name}.out", workdir / f"{name}.err"
    out.write_bytes(b"")  # exists even if the child dies before it gets to open it
    err.write_bytes(b"")
    argv = [str(a) for a in argv]
    p = zygote().Process(
        target=_cli_child, args=(argv, str(out), str(err), {**_cli_env(), **(env or {})}, threads), daemon=False
    )
    p.start()
    return CliProcess(argv, out, err, p)


def store_keys(path: str | Path, *, strict: bool = True) -> set[str]:
    """Keys of the contexts a store holds (a context is committed once its record is: after its
    chunks), read through a read-only KVStore. With ``strict=False`` a store that does not exist
    yet (or is being created) has none."""
    from kvstore.errors import StoreError
    from kvstore.store.kvstore import KVStore

    try:
        with KVStore(str(path), readonly=True) as s:
            return set(s.context_keys())
    except StoreError:
        if strict:
            raise
        return set()


def verify_store(path: str | Path) -> tuple[set[str], dict[str, str]]:
    """(keys of the contexts whose every chunk is intact, {corrupt entry key: reason}) after
    checking every byte of every entry."""
    from kvstore.store.kvstore import KVStore

    with KVStore(str(path), readonly=True) as s:
        info = s.verify()
    return {c.key for c in info.contexts if c.complete}, {c.key: c.reason for c in info.corrupt}


def context_keys(model_dir: str | Path, contexts: Iterable[str], *, dtype: str = "float32") -> dict[str, str]:
    """Store key of each context as ``kvstore build --model MODEL_DIR --dtype DTYPE`` computes it
    (chat template when the tokenizer has one, as the CLI's default)."""
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.adapter import Adapter

    a = Adapter.from_pretrained(str(model_dir), dtype=dtype, device="cpu")
    fmt = (
        PromptFormat.from_chat_template(a.tokenizer)
        if getattr(a.tokenizer, "chat_template", None)
        else PromptFormat.plain()
    )
    special = fmt.add_special_tokens
    return {
        c: a.key(
            a.encode_context(fmt.context_part(c), special_tokens=special),
            prefix=fmt.head or None,
            special_tokens=special,
        )
        for c in contexts
    }


def read_predictions(path: str | Path) -> dict[str, dict]:
    """``sample -o`` output by row id."""
    return {r["id"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def nonblank_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def build_argv(dataset: Path, model_dir: Path, store: Path, *extra: str) -> list[str]:
    return [
        "build",
        str(dataset),
        "--model",
        str(model_dir),
        "--store",
        str(store),
        "--quiet",
        "--format",
        "json",
        *extra,
    ]


class SubprocessCli:
    """A real ``python -m kvstore`` process with the interface of :class:`CliProcess`."""

    def __init__(self, argv, workdir: Path, name: str):
        self.argv = [str(a) for a in argv]
        self.out_path, self.err_path = Path(workdir) / f"{name}.out", Path(workdir) / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore", *self.argv],
                cwd=REPO,
                stdout=out,
                stderr=err,
                env=dict(os.environ, KVSTORE_DEBUG=""),
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def wait(self, timeout: float = 300) -> tuple[int, str, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise TimeoutError(f"{' '.join(self.argv[:2])} did not finish in {timeout} s") from None
        return code, self.out_path.read_text(errors="replace"), self.err_path.read_text(errors="replace")
