"""Shared helpers for the benchmark scripts in ``experiments/`` (not part of the library).

Results: every script writes what it measured with :func:`write_result`, one call per output, in
the runner's result schema (:mod:`experiments.runner.schema`); the machine (CPU, cores, memory,
GPU, library versions, torch threads, the load average when the run started and when it wrote),
the command and the commit are recorded here, so no script builds a result of its own shape and
the runner (``python -m experiments run SUITE``) commits the file as it is.

The run: every script builds its command line with :func:`parser` (its docstring as the help, and
the options every run shares, :func:`run_args`: ``--threads``, ``--wait``, ``--quick``) and starts
with :func:`start` (parse, apply the script's quick settings, pin torch's threads, wait for a quiet
machine): the common preamble, written once, here.

Timing: every duration is measured by :func:`timed` (a :class:`Timer`: ``with bl.timed() as t:``
then ``t.seconds``, or ``t.lap()`` between phases); :func:`repeat` runs a callable untimed
``warmup`` times, then ``n`` timed times, and :func:`summarize` reports the median with min/max and
the quartiles (never a mean: the machine is shared and noisy).

Synthetic inputs use fixed seeds: token ids drawn uniformly from the ordinary vocabulary (no
special tokens), or word salad from :func:`synthetic_text` when a command needs text. Shapes
matter for these benchmarks, not content (the codec table uses real text instead, since
compression does depend on content).

Importing this module does not import torch (writing a result needs none); the helpers that
compute import it when called.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # a script runs with experiments/ first on sys.path, not the repository root
    sys.path.insert(0, str(ROOT))

from experiments.runner import schema, suites  # noqa: E402
from experiments.runner.schema import loadavg  # noqa: E402, F401 - the scripts' bl.loadavg()

# Where a script writes its results: the runner (``python -m experiments run SUITE``) names a
# scratch folder per suite and commits what lands there, unchanged, once the script exits 0; a
# script run by hand writes to ``cache/bench/raw/`` and never touches the committed results.
RESULTS = Path(os.environ.get("KVSTORE_BENCH_RAW") or ROOT / "cache" / "bench" / "raw")
SCRATCH = ROOT / "cache" / "bench"  # stores and peer files live here (git-ignored), not in /tmp
THREADS = 2

# A 23-token question (the length NOTES.md measured the floor with), as fixed token ids so that
# every method answers exactly the same thing.
QUESTION_TOKENS = 23


def setup(threads: int = THREADS) -> None:
    """Pin torch's intra-op threads (the machine has 2 cores) and silence progress bars."""
    import torch

    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def run_args(ap: argparse.ArgumentParser, batch_size: int | None = None, *, threads: int = THREADS,
             quick: bool = True) -> None:  # fmt: skip
    """The options every benchmark run shares: ``--threads`` (torch's intra-op threads, default
    ``threads``), ``--wait`` (seconds to wait for a quiet machine), ``--quick`` (a smoke run; left
    out for a script without one) and, given a default, ``--batch-size``."""
    if batch_size is not None:
        ap.add_argument("--batch-size", type=int, default=batch_size)
    ap.add_argument("--threads", type=int, default=threads, help="torch intra-op threads")
    ap.add_argument("--wait", type=float, default=0.0, help="seconds to wait for load average < 1.5 before measuring")
    if quick:
        ap.add_argument("--quick", action="store_true", help="a smoke run: small sizes, few repeats")


def parser(doc: str | None, *, batch_size: int | None = None, threads: int = THREADS,
           quick: bool = True) -> argparse.ArgumentParser:  # fmt: skip
    """A benchmark's command line: its docstring ``doc`` as the help and the shared run options
    (:func:`run_args`); the script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_args(ap, batch_size, threads=threads, quick=quick)
    return ap


def start(
    ap: argparse.ArgumentParser, quick: Mapping[str, object] | Callable[[argparse.Namespace], None] | None = None,
    *, wait: bool = True, rest: bool = False,
) -> argparse.Namespace:  # fmt: skip
    """The run's options: the command line parsed; with ``--quick``, ``quick`` applied (the values
    to set, or a function of the options); torch's threads pinned (:func:`setup`); then, unless
    ``wait`` is False (a script that warms up first calls :func:`wait_for_quiet` itself), up to
    ``--wait`` seconds for a quiet machine. ``rest``: arguments the parser does not know are kept,
    in ``args.rest``, for the script to pass on (instead of refused)."""
    if rest:
        args, args.rest = ap.parse_known_args()
    else:
        args = ap.parse_args()
    if getattr(args, "quick", False) and quick is not None:
        if callable(quick):
            quick(args)
        else:
            for name, value in quick.items():
                setattr(args, name, value)
    setup(args.threads)
    if wait:
        wait_for_quiet(max_wait_s=args.wait)
    return args


def codec_args(ap: argparse.ArgumentParser, codecs: Sequence[str], dtypes: str, repeats: int) -> dict:
    """The options of a codec measurement on the KV of a real context: ``--tokens`` (2048),
    ``--codecs``, ``--dtypes``, ``--repeats``; returns its quick settings (256 tokens, 2 repeats)."""
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--codecs", default=",".join(codecs))
    ap.add_argument("--dtypes", default=dtypes)
    ap.add_argument("--repeats", type=int, default=repeats)
    return {"tokens": 256, "repeats": 2}


def use_test_helpers() -> None:
    """Put ``tests/`` on ``sys.path``: the scripts that start a SeaweedFS server or write old-format
    entries use the test suite's helpers (``helpers.seaweed``, ``helpers.entries``)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def load_adapter(dtype: str = "float32"):
    """The bundled SmolLM2-135M-Instruct in an :class:`kvstore.model.adapter.Adapter` (sdpa attention)."""
    from kvstore.model.adapter import Adapter

    return Adapter.from_pretrained(None, dtype=dtype)


# -- the run and its results ----------------------------------------------------------------------
# What a result records of the run's start: the machine as the runner sees it (its load average
# then) and the commit. Taken when this module is imported, and again when wait_for_quiet returns.
_start: dict = {}


def _begin() -> None:
    _start.update(machine=schema.machine(), git_sha=schema.git_sha())


_begin()


def _machine() -> dict:
    """The run's machine now: its facts at the start, torch's thread count and GPU (when the script
    uses torch) and the load average now."""
    m = dict(_start["machine"]) | {"load_after": loadavg()}
    torch = sys.modules.get("torch")
    if torch is not None:
        m["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            m["gpu"] = torch.cuda.get_device_name()
    return m


def _command() -> str:
    """The runner's command (``KVSTORE_BENCH_COMMAND``), or this script's command line."""
    if os.environ.get("KVSTORE_BENCH_COMMAND"):
        return os.environ["KVSTORE_BENCH_COMMAND"]
    script = Path(sys.argv[0]).resolve()
    name = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else str(script)
    return shlex.join(["python", name, *sys.argv[1:]])


def write_result(
    stem: str, *, params: dict, rows: list[dict], notes: dict | None = None, machine: dict | None = None
) -> Path:
    """Write ``RESULTS/<stem>.json``: one output of this run as a result in the runner's schema.

    ``stem`` names the output (``ttft``, ``quant_prerope_bf16``); the suite listing it and the part it
    is come from :data:`experiments.runner.suites.SUITES` (a stem no suite lists is a suite of its
    own). ``params``: the options the numbers depend on (``vars(args)`` and what else fixed them);
    ``rows``: one JSON object per measurement; ``notes``: everything else the run found (totals,
    per-trial lists, texts); ``machine``: facts to add to the ones recorded here (a peer's version, a
    server). Call it again to rewrite the file: scripts that save after every repetition do.
    Returns the path; raises :class:`experiments.runner.schema.SchemaError` if the result is not
    in the schema (``rows`` not a list of objects).
    """
    suite, part = suites.suite_of(stem)
    doc = schema.make(suite, part, _command(), params, _machine() | (machine or {}), rows, notes or {},
                      _start["git_sha"])  # fmt: skip
    path = RESULTS / f"{stem}.json"
    schema.write(path, doc)
    print(f"wrote {path}", flush=True)
    return path


def wait_for_quiet(max_load: float = 1.5, max_wait_s: float = 0.0, poll_s: float = 30.0) -> list[float]:
    """Sleep (up to ``max_wait_s``) until the 1-minute load average drops below ``max_load``;
    return the load average seen last. The run goes on either way, and starts now: its results
    record the load average at this point as ``load_before``."""
    deadline = time.monotonic() + max_wait_s
    while True:
        la = loadavg()
        if la[0] < max_load or time.monotonic() >= deadline:
            _begin()
            return la
        print(f"  load average {la} >= {max_load}; waiting ...", flush=True)
        time.sleep(poll_s)


# -- timing -------------------------------------------------------------------------------------
class Timer:
    """Wall seconds (``time.perf_counter``) from its start: ``with timed() as t: ...`` sets
    ``t.seconds`` when the block ends; ``t.lap()`` is the seconds since the start or the last lap
    (phases one after another), ``t.elapsed()`` the seconds since the start."""

    def __init__(self) -> None:
        self.begun = self._last = time.perf_counter()
        self.seconds = 0.0

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.begun

    def __enter__(self) -> Timer:
        self.begun = self._last = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.elapsed()


def timed() -> Timer:
    """A :class:`Timer` started now: the one way the benchmarks measure a duration."""
    return Timer()


def repeat(fn: Callable[[], object], n: int, warmup: int = 1) -> list[float]:
    """Seconds of ``n`` timed calls of ``fn`` after ``warmup`` untimed ones (GC off while timing)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        gc.collect()
        gc.disable()
        try:
            with timed() as t:
                fn()
            out.append(t.seconds)
        finally:
            gc.enable()
    return out


def summarize(xs: Sequence[float]) -> dict:
    """Median, min, max and quartiles of a sample (seconds in, seconds out)."""
    xs = sorted(xs)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3, "n": len(xs)}


def fmt_s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


# -- inputs ---------------------------------------------------------------------------------------
def synthetic_ids(n: int, seed: int, vocab: int = 49152, low: int = 100) -> list[int]:
    """``n`` token ids drawn uniformly from ``[low, vocab)`` (skipping special tokens), fixed seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()


_WORDS = (
    "river bridge town council engineer stone arch harbour market winter ferry carts flood "
    "railway station mill chapel library museum garden tower valley mountain forest lake island "
    "coast village castle road canal factory school hospital theatre square street gate wall "
    "north south east west old new great small long short first second third last early late "
    "built opened closed moved grew fell rose changed carried crossed won lost held named found "
    "the a of in on at by for with from to and or but was were is are had has been after before "
    "during while because although where when which who whose that this those these its their"
).split()


def synthetic_text(n_words: int, seed: int) -> str:
    """Deterministic word salad of ``n_words`` words in sentences (about 1.2 tokens per word with
    the SmolLM2 tokenizer). Shapes matter here, not meaning."""
    rng = random.Random(seed)
    words, sentence = [], []
    for _ in range(n_words):
        sentence.append(rng.choice(_WORDS))
        if len(sentence) >= rng.randint(8, 20):
            sentence[0] = sentence[0].capitalize()
            words.append(" ".join(sentence) + ".")
            sentence = []
    if sentence:
        words.append(" ".join(sentence) + ".")
    return " ".join(words)


def real_context_ids(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of the demo articles (``experiments/data/demo.jsonl``) run together:
    real English, for measurements where content matters (compression). Up to ~7k tokens."""
    seen, parts = set(), []
    for line in (HERE / "data" / "demo.jsonl").open(encoding="utf-8"):
        c = json.loads(line)["context"]
        if c not in seen:
            seen.add(c)
            parts.append(c)
    ids = tokenizer("\n\n".join(parts), add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise ValueError(f"the demo articles hold {len(ids)} tokens, fewer than {n}")
    return list(ids[:n])


# -- memory bandwidth -----------------------------------------------------------------------------
def memcpy_bandwidth(nbytes: int, n: int = 7) -> dict:
    """This machine's copy bandwidth for ``nbytes``, measured now: into a preallocated buffer
    (``dst.copy_(src)``) and into a fresh allocation (``torch.empty`` + copy, page faults
    included). Returns ``{"prealloc": summary, "fresh": summary}`` in seconds."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty_like(src)
    dst.fill_(0)

    def fresh():
        out = torch.empty_like(src)
        out.copy_(src)
        return out

    return {
        "prealloc": summarize(repeat(lambda: dst.copy_(src), n, warmup=2)),
        "fresh": summarize(repeat(fresh, n, warmup=2)),
    }


# -- a proposed change, emulated here (the library itself is not edited) --------------------------
@contextlib.contextmanager
def proposed(gqa: bool = False):
    """Run the block with a proposed change patched in. ``gqa``: transformers' SDPA path passes
    ``enable_gqa=True`` for the multi-token question step too (``TRANSFORMERS_SDPA_FORCE_GQA=1``,
    read on every call) instead of materializing the repeated K/V heads with ``repeat_kv``."""
    old_env = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    try:
        if gqa:
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
        yield
    finally:
        if old_env is None:
            os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)
        else:
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = old_env


# -- the floor --------------------------------------------------------------------------------------
def floor(adapter, layers, q_ids: list[int]):
    """kvstore's question step alone, on a context's cache already in its preallocated buffers (the
    in-memory floor a stored load is compared with): a function returning ``(first token, seconds
    of the model call)``. ``layers``: per layer ``(keys, values)`` ``[kv_heads, n, head_dim]``."""
    import torch

    from kvstore.model.compute.attention import grouped_kv
    from kvstore.model.compute.cache import PreallocatedCache, new_buffers

    n, Q = layers[0][0].shape[1], len(q_ids)
    bufs = new_buffers(adapter.kv_shapes(), 1, n + Q + 1, adapter.dtype, adapter.device)
    for (kb, vb), (k, v) in zip(bufs, layers):
        kb[0, :, :n].copy_(k)
        vb[0, :, :n].copy_(v)
    mask = torch.ones((1, n + Q), dtype=torch.long)
    pos = torch.arange(n, n + Q)[None]
    ids = torch.tensor([q_ids])

    @torch.inference_mode()
    def run() -> tuple[int, float]:
        cache = PreallocatedCache(bufs, n)  # wraps the buffers, copies nothing
        with grouped_kv(), timed() as t:
            out = adapter.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                use_cache=True, logits_to_keep=1)  # fmt: skip
            tok = int(out.logits[0, -1].argmax())
        return tok, t.seconds

    return run


# -- profiles -------------------------------------------------------------------------------------
def profile_rows(prof, limit: int) -> list[dict]:
    """The first ``limit`` operators of a ``torch.profiler`` run by self CPU time, one row each: name,
    calls, self and total CPU milliseconds, and the self time's share of every operator's (the
    ``Self CPU %`` of the profiler's own table)."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "self_cpu_pct": 100 * e.self_cpu_time_total / total, "cpu_total_ms": e.cpu_time_total / 1e3}
            for e in events[:limit]]  # fmt: skip


# -- peak memory ----------------------------------------------------------------------------------
def rss_mib() -> float:
    """Peak resident set size of this process so far (MiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- output ---------------------------------------------------------------------------------------
def md_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def ratio_plot(path: Path, panels: Sequence[tuple[str, dict, float | None]], title: str) -> None:
    """A PNG of side-by-side panels of a metric against the compression ratio: each panel is
    ``(ylabel, lines, reference)``, ``lines`` mapping a label to ``(ratios, values)`` (labels ending in
    ``:q`` dashed) and ``reference`` (the dense value) a dotted horizontal line (None: none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (ylabel, lines, reference) in zip(axes[0], panels):
        for i, (label, (xs, ys)) in enumerate(lines.items()):
            ax.plot(xs, ys, marker="o", markersize=4, linestyle="--" if label.endswith(":q") else "-",
                    color=f"C{i % 10}", label=label)  # fmt: skip
        if reference is not None:
            ax.axhline(reference, color="k", linestyle=":", label="dense")
        ax.set_xlabel("compression ratio (fraction of context tokens dropped)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo_rows() -> list[dict]:
    """The rows of experiments/data/demo.jsonl (22 articles, 78 questions)."""
    return [json.loads(line) for line in (HERE / "data" / "demo.jsonl").open(encoding="utf-8")]


def press_spec(press: str, ratio: float) -> str:
    """The printed spec of ``press`` (``NAME[:FIELDS]``, e.g. ``snapkv:adakv``) at ``ratio``: the ratio
    goes after the name (``snapkv:0.5:adakv``)."""
    from kvstore.model.press.spec import parse_press, ratio_text

    head, _, rest = press.partition(":")
    return parse_press(f"{head}:{ratio_text(ratio)}" + (f":{rest}" if rest else "")).name


def press_label(name: str) -> str:
    """A variant's press without its ratio (``snapkv:0.5:adakv`` -> ``snapkv:adakv``)."""
    parts = name.split(":")
    return ":".join(parts[:1] + parts[2:])


def question_sets() -> dict[str, list[dict]]:
    """``demo``: the demo rows; ``long``: the demo articles four at a time (5 contexts of ~1.3k
    tokens), every question about one of the four asked of the joined context."""
    rows = demo_rows()
    articles = list(dict.fromkeys(r["context"] for r in rows))
    long = []
    for g in range(len(articles) // 4):
        group = articles[4 * g : 4 * g + 4]
        joined = "\n\n".join(group)
        long += [dict(r, context=joined, id=f"long{g}-{r['id']}") for r in rows if r["context"] in group]
    return {"demo": rows, "long": long}
