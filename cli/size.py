"""``kvstore size``: KV-cache size per model, estimated from its shape and measured in a store.

The library computes (:mod:`kvstore.size`); this module renders: an aligned table, CSV, JSON and
a bar chart (matplotlib, imported only for ``--plot``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from kvstore import dtypes
from kvstore.cli.common import CLIError, store_options, tier_options
from kvstore.cli.table import render_table
from kvstore.errors import DtypeError
from kvstore.size.estimate import DEFAULT_EXAMPLES, DEFAULT_SEQ_LEN, FORMULA, SizeReport, size_report
from kvstore.units import human_bytes


def _measured_lines(report: SizeReport) -> list[str]:
    """What the store measured beside the estimate (``--store``)."""
    lines = [
        "",
        f"Measured in store {report.store}: stored bytes per token (after compression, with headers) vs the estimate",
        "",
    ]
    if not report.measured:
        lines.append("(the store holds no readable contexts)")
    else:
        mh = [
            "model",
            "dtype",
            "codec",
            "contexts",
            "tokens",
            "estimated/token",
            "stored/token",
            "stored",
            "",
            "stored/estimate",
        ]
        mb = [
            [
                m.model_name,
                m.dtype,
                m.codec,
                f"{m.contexts:,}",
                f"{m.n_tokens:,}",
                _number(m.kv_bytes_per_token),
                _number(m.bytes_per_token),
                f"{m.stored_bytes:,}",
                f"({human_bytes(m.stored_bytes)})",
                f"{m.stored_to_kv:.3f}",
            ]
            for m in report.measured
        ]
        lines += render_table(mb, mh, _align(len(mh), {3, 4, 5, 6, 7, 9})).split("\n")
    return lines


def render_report(report: SizeReport) -> str:
    """Aligned text: exact integers with thousands separators and binary units beside them."""
    lines = [f"KV cache per example = {FORMULA}"]
    if report.codec is not None:
        bpv = sorted({round(r.bits_per_value, 3) for r in report.estimates})
        lines.append(
            f"stored with codec {report.codec}: {' / '.join(f'{b:g}' for b in bpv)} bits per value (scales and "
            "zeros included) instead of the dtype's width"
        )
    lines += [
        f"{report.seq_len:,} tokens per example, {report.examples:,} examples; cumulative adds the models in the "
        "order listed.",
        "",
    ]
    windowed = any(r.window != "-" for r in report.estimates)
    stateful = any(r.state_bytes for r in report.estimates)
    headers = ["model", "dtype", "layers", "kv_heads x head_dim"] + (["window"] if windowed else [])
    headers += ["state/example", ""] if stateful else []
    for title in (
        "bytes/token",
        f"per example ({report.seq_len:,} tokens)",
        f"dataset ({report.examples:,} examples)",
        "cumulative",
    ):
        headers += [title, ""]  # the exact number, then its binary units
    body: list[list[str] | None] = []
    for i, r in enumerate(report.estimates):
        if i and r.dtype != report.estimates[i - 1].dtype:
            body.append(None)
        row = [r.model, r.dtype, str(r.n_layers), f"{r.kv_heads} x {r.head_dim}"] + ([r.window] if windowed else [])
        row += [f"{r.state_bytes:,}", f"({human_bytes(r.state_bytes)})"] if stateful else []
        for exact, human in (
            (r.bytes_per_token, r.per_token_str),
            (r.bytes_per_example, r.per_example_str),
            (r.bytes_dataset, r.dataset_str),
            (r.bytes_cumulative, r.cumulative_str),
        ):
            row += [f"{exact:,}", f"({human})"]
        body.append(row)
    right = {2} | set(range(len(headers) - 8, len(headers), 2))  # numbers right, their units left
    right |= {len(headers) - 10} if stateful else set()
    lines += render_table(body, headers, _align(len(headers), right)).split("\n")
    for note in report.notes:
        lines += ["", textwrap.fill(note, 100, initial_indent="note: ", subsequent_indent="      ")]
    if report.measured is not None:
        lines += _measured_lines(report)
    return "\n".join(lines) + "\n"


def render_csv(report: SizeReport) -> str:
    """CSV with a header row; measured rows (``kind=measured``) follow estimated ones and fill
    their own columns."""
    rows = report.records()
    fields = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def render_json(report: SizeReport) -> str:
    """JSON object: parameters, formula, notes, ``estimated`` rows, and ``measured`` rows with a store."""
    doc: dict[str, Any] = {
        "formula": FORMULA,
        "seq_len": report.seq_len,
        "examples": report.examples,
        "dtypes": list(report.dtypes),
        "notes": list(report.notes),
        "codec": report.codec,
        "estimated": [asdict(r) for r in report.estimates],
    }
    if report.measured is not None:
        doc["store"] = report.store
        doc["measured"] = [m.as_record() for m in report.measured]
    return json.dumps(doc, indent=2) + "\n"


def _number(x: float) -> str:
    """``46080.0 -> '46,080'``, ``40521.63 -> '40,521.6'``."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _align(n: int, right: set[int]) -> str:
    return "".join("r" if j in right else "l" for j in range(n))


def plot_report(report: SizeReport, path: str | os.PathLike) -> Path:
    """Grouped bars of bytes per example (log scale) per model, one bar per storage width
    (dtypes of equal width share a bar), saved as an image at ``path``. Needs matplotlib
    (``pip install 'kvstore[plot]'``); raises CLIError without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'kvstore[plot]' (or pip install matplotlib)") from None

    models = list(dict.fromkeys(r.model for r in report.estimates))
    by_width: dict[int, dict[str, int]] = {}
    labels: dict[int, list[str]] = {}
    for r in report.estimates:
        width = dtypes.bits(r.dtype)
        by_width.setdefault(width, {})[r.model] = r.bytes_per_example
        labels.setdefault(width, [])
        if r.dtype not in labels[width]:
            labels[width].append(r.dtype)
    widths = sorted(by_width, reverse=True)

    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(models) + 2), 5.2), dpi=120)
    bar = 0.8 / max(1, len(widths))
    values = [v for w in widths for v in by_width[w].values() if v > 0] or [1]
    for k, width in enumerate(widths):
        xs = [i + (k - (len(widths) - 1) / 2) * bar for i in range(len(models))]
        ys = [by_width[width].get(m, 0) for m in models]
        bars = ax.bar(xs, ys, bar * 0.95, label=" / ".join(labels[width]))
        for rect, y in zip(bars, ys):
            if y:
                ax.annotate(
                    human_bytes(y),
                    (rect.get_x() + rect.get_width() / 2, y),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    rotation=90,
                )
    ax.set_yscale("log", base=2)
    lo, hi = min(values), max(values)
    ticks = [2**e for e in range(int(lo).bit_length() - 2, int(hi).bit_length() + 3) if e % 2 == 0]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels([human_bytes(t).replace(".0 ", " ") for t in ticks])
    ax.set_ylim(lo / 2, hi * 8)
    ax.set_xticks(range(len(models)))
    long_names = max(map(len, models)) > 12
    ax.set_xticklabels(models, rotation=20 if long_names else 0, ha="right" if long_names else "center")
    ax.set_ylabel(f"KV cache per example ({report.seq_len:,} tokens), log scale")
    ax.set_title(f"KV-cache size per example at {report.seq_len:,} tokens\n{FORMULA}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(title="dtype", loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


def _dtypes(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if part.lower() == "all":
                out += dtypes.INFERENCE_DTYPES
            elif part:
                try:
                    out.append(dtypes.parse_kv(part))
                except DtypeError as exc:
                    raise click.BadParameter(str(exc)) from None
    return tuple(dict.fromkeys(out)) or ("float32",)


@click.command(
    epilog="""\b
Examples:
  kvstore size                                   # the eight Pythia models, float32
  kvstore size --dtype all --plot sizes.png
  kvstore size default HuggingFaceTB/SmolLM2-360M --seq-len 4096
  kvstore size default --store cache/store       # estimate beside what the store holds"""
)
@click.argument("models", nargs=-1, metavar="[MODEL]...")
@click.option(
    "--seq-len", type=click.IntRange(min=1), default=DEFAULT_SEQ_LEN, show_default=True, help="Tokens per example."
)
@click.option(
    "--examples",
    type=click.IntRange(min=1),
    default=DEFAULT_EXAMPLES,
    show_default=True,
    help="Examples in the dataset.",
)
@click.option(
    "--dtype",
    "dtype_names",
    multiple=True,
    default=("float32",),
    show_default=True,
    callback=_dtypes,
    help="float32, float16 or bfloat16 (fp32/fp16/bf16 work too); repeat it, or 'all'.",
)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also draw bytes per example per model and dtype (PNG; needs matplotlib).",
)
@click.option(
    "--store",
    metavar="PATH|URL",
    default=None,
    help="Also measure what this store (directory or s3://BUCKET[/PREFIX]) holds per model and dtype.",
)
@click.option(
    "--codec",
    default=None,
    help="Estimate as stored by this codec's quantizer (int8, int4, fp8, with a group size: int4:64); "
    "zstd packings are lossless and data-dependent: measure them with --store.",
)
@tier_options
def size(
    models: tuple[str, ...],
    seq_len: int,
    examples: int,
    dtype_names: tuple[str, ...],
    fmt: str,
    plot: str | None,
    store: str | None,
    codec: str | None,
) -> None:
    """Bytes of KV cache per token, per example and per dataset, for each MODEL.

    \b
    bytes = 2 (keys, values) x layers x kv_heads x head_dim x tokens x bytes per element
    Sliding-window layers hold at most their window. Without MODEL: the eight Pythia models,
    smallest first (built in, nothing loaded). MODEL is a Pythia name (pythia-70m,
    EleutherAI/pythia-1b), 'default' (the bundled SmolLM2-135M-Instruct), a .gguf file, a directory
    holding config.json, or a hub id. The cumulative column adds the models up in the order given.
    """
    report = size_report(
        models, seq_len=seq_len, examples=examples, dtype_names=dtype_names, store=store, codec=codec,
        store_options=store_options(),
    )  # fmt: skip
    if fmt == "table":
        click.echo(render_report(report), nl=False)
    elif fmt == "csv":
        click.echo(render_csv(report), nl=False)
        for note in report.notes:  # keep stdout a plain CSV file
            click.echo(f"note: {note}", err=True)
    else:
        click.echo(render_json(report), nl=False)
    if plot:
        path = plot_report(report, plot)
        click.echo(f"plot written to {path}", err=True)
