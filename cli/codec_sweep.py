"""``kvstore quality --sweep``: per-layer sensitivity of keys and values on your model and rows, and
the ``kvh`` spec the sweep recommends for ``--budget`` (:func:`kvstore.codec_sweep.sweep`), measured."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import click

from kvstore.cli.common import CLIError, emit, progress_bar

DAMAGE = {"layer": "layer", "keys": "KL keys only", "values": "KL values only"}
CANDIDATES = {"codec": "codec", "bits": "bits/value", "size_vs_f32": "x f32", "kl_kv": "KL", "top1_kv": "top-1",
              "identical": "identical", "common_prefix": "prefix"}  # fmt: skip


@dataclass(frozen=True)
class SweepChoice:
    """``--sweep`` and ``--budget`` (stored bytes over float32's)."""

    sweep: bool
    budget: float


def run_sweep(source: Any, model: Any, gate: Any, choice: SweepChoice) -> None:
    """Run the sweep on ``source``'s rows with ``model`` (the quality command's objects) and print it."""
    from kvstore.codec_sweep import SweepOptions, sweep
    from kvstore.errors import CodecError
    from kvstore.quality import rows_of

    contexts, questions = source.load()
    adapter = model.load(gate.quiet)
    try:
        rows = rows_of(adapter, contexts, questions)
    except ValueError as exc:
        raise CLIError(f"{source.dataset}: {exc}") from None
    options = SweepOptions(budget=choice.budget, new_tokens=gate.new_tokens, chunk_tokens=gate.chunk_tokens)
    bar = progress_bar(len(rows) * (1 + len(options.tails)), "sweep", gate.quiet)
    try:
        result = sweep(adapter, rows, options, progress=bar.update)
    except CodecError as exc:
        raise CLIError(str(exc)) from None
    finally:
        bar.close()
    cands = [
        {"codec": q.codec, "bits": result.bits[q.codec], "size_vs_f32": q.size_vs_f32, "kl_kv": q.kl["kv"],
         "top1_kv": q.top1["kv"], "identical": q.identical, "common_prefix": q.common_prefix, "rows": q.rows}
        for q in result.candidates
    ]  # fmt: skip
    if gate.fmt == "json":
        click.echo(json.dumps(result.record(), indent=2))
        return
    if gate.fmt == "csv":
        emit(cands, "csv")
        return
    click.echo(f"{len(rows)} rows, {gate.new_tokens} new tokens each; each layer alone at the probe widths "
               f"(keys {options.probe_keys} bits, values {options.probe_values})")  # fmt: skip
    emit([{"layer": d.layer, "keys": d.keys, "values": d.values} for d in result.damage], "table", columns=DAMAGE,
         formatters={"keys": "{:.5f}".format, "values": "{:.5f}".format})  # fmt: skip
    click.echo(f"\ncandidates within {choice.budget} x float32, measured on the same rows")
    emit(cands, "table", columns=CANDIDATES, formatters={
        "bits": "{:.3f}".format, "size_vs_f32": "{:.3f}".format, "kl_kv": "{:.5f}".format,
        "top1_kv": "{:.3f}".format, "common_prefix": "{:.1%}".format, "identical": lambda v: f"{v}/{len(rows)}",
    })  # fmt: skip
    click.echo(f"\nrecommended: {result.best}")
