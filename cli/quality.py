"""``kvstore quality``: the lossy codecs' quality gate on your own model and data.

Every row's context is prefilled once (the lossless cache) and the model answers greedily from it;
each ``--codec`` then round-trips that cache through its stored bytes and is compared with it
(:func:`kvstore.quality.quality_gate`): next-token KL and top-1 agreement on the lossless answer
(keys and values quantized, only keys, only values) and its own greedy answer against the lossless
one (identical rows, mean common prefix), with its bytes against float32; and the KL floor, the
lossless cache measured the way the codecs are (its own rounding: read a codec's KL against it). A
codec given twice (``-c int4h -c int4h:32/64``: one canonical spec) is measured once, with a note.
Nothing is stored. A row
is its context's text (the model's own BOS where it uses one) and the question's text after it, as
they are (no prompt template); a row without a question feeds its context's last token.
``--sweep`` (:mod:`kvstore.cli.codec_sweep`) measures each layer's keys and values apart instead
and recommends a ``kvh`` spec for ``--budget``.
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from kvstore.cli.codec_sweep import SweepChoice, run_sweep
from kvstore.cli.common import CLIError, emit, format_option, progress_bar, quiet_option, warn
from kvstore.cli.compose_quality import Composing, compose_option
from kvstore.cli.flags import ModelChoice, dataset_flags, model_flags, receives


@dataclass(frozen=True)
class GateSource:
    """The dataset and its fields (DATASET, ``--context-field``, ``--question-field``, ``--id-field``, ``--limit``)."""

    dataset: str
    context_field: str
    question_field: str
    id_field: str
    limit: int | None

    def load(self) -> tuple[list[str], list[str | None]]:
        from kvstore.data.datasets import load_dataset
        from kvstore.data.readers import Fields

        fields = Fields(self.context_field, self.question_field, id=self.id_field)
        data = load_dataset(self.dataset, fields, require_question=False, limit=self.limit)
        return [e.context for e in data.examples], [e.question for e in data.examples]


@dataclass(frozen=True)
class Gate:
    """``--codec`` (repeatable), ``--new-tokens``, ``--chunk-tokens``, ``--format``, ``--quiet``."""

    codec: tuple[str, ...]
    new_tokens: int
    chunk_tokens: int
    fmt: str
    quiet: bool


COLUMNS = {
    "codec": "codec", "size_vs_f32": "x f32", "identical": "identical", "common_prefix": "prefix",
    "kl_kv": "KL", "top1_kv": "top-1", "kl_keys": "KL K only", "kl_values": "KL V only",
    "top1_keys": "top-1 K", "top1_values": "top-1 V",
}  # fmt: skip


@click.command("quality")
@dataset_flags
@model_flags
@click.option("--codec", "-c", multiple=True, help="A lossy codec to measure (repeat for several).")
@compose_option
@click.option("--new-tokens", "-n", type=click.IntRange(min=1), default=16, show_default=True,
              help="Greedy tokens per row compared with the lossless answer.")  # fmt: skip
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens per stored chunk the codecs encode (a store's default).")  # fmt: skip
@click.option(
    "--sweep",
    is_flag=True,
    help="Instead of --codec: measure each layer's keys and values apart and recommend a kvh spec.",
)
@click.option(
    "--budget",
    type=click.FloatRange(min=0, min_open=True),
    default=0.21,
    show_default=True,
    help="With --sweep: stored bytes over float32 bytes the recommended spec may take.",
)
@format_option
@quiet_option
@receives(source=GateSource, model=ModelChoice, gate=Gate, composing=Composing, choice=SweepChoice)
def quality(source: GateSource, model: ModelChoice, gate: Gate, composing: Composing, choice: SweepChoice) -> None:
    """Measure lossy codecs against the lossless cache on DATASET's rows: next-token KL and top-1,
    key and value damage apart, identical answers and their common prefix, bytes vs float32. With
    --compose POLICY instead: composition policies on passage rows against their full prefill. With
    --sweep: per-layer damage, and the kvh spec recommended for --budget, measured."""
    from kvstore.quality import quality_gate, rows_of, unique_codecs

    if [bool(gate.codec), bool(composing.compose), choice.sweep].count(True) != 1:
        raise CLIError("give --codec (lossy codecs), --compose (policies on passage rows) or --sweep "
                       "(per-layer widths for --budget): one of the three")  # fmt: skip
    if composing.compose:
        return composing.run(source, model, gate.new_tokens, gate.fmt, gate.quiet)
    if choice.sweep:
        return run_sweep(source, model, gate, choice)
    codecs, repeats = unique_codecs(gate.codec)
    for given, canonical in repeats:  # measured once: twice would double its rows and bytes
        warn(f"--codec {given} is {canonical}, given already: measured once")
    for codec in codecs:
        if codec.lossless:
            raise CLIError(f"--codec {codec.spec} is lossless: give lossy codecs (int8, int4h, ecq, ...)")
    contexts, questions = source.load()
    adapter = model.load(gate.quiet)
    try:
        rows = rows_of(adapter, contexts, questions)
    except ValueError as exc:
        raise CLIError(f"{source.dataset}: {exc}") from None
    bar = progress_bar(len(rows) * len(codecs), "quality", gate.quiet)
    results = quality_gate(adapter, rows, codecs, new_tokens=gate.new_tokens, chunk_tokens=gate.chunk_tokens,
                           progress=bar.update)  # fmt: skip
    bar.close()
    out = []
    for q in results:
        rec = q.record()
        flat = {k: v for k, v in rec.items() if k not in ("kl", "top1")}
        flat |= {f"kl_{m}": v for m, v in q.kl.items()} | {f"top1_{m}": v for m, v in q.top1.items()}
        out.append(flat)
    if gate.fmt == "table":
        click.echo(f"{len(rows)} rows, {gate.new_tokens} new tokens each; against the lossless cache")
        floor = results[0].kl_floor if results else 0.0
        click.echo(f"KL floor {floor:.5f}: the lossless cache itself through the gate's path (its own rounding noise)")
    emit(out, gate.fmt, columns=COLUMNS, formatters={
        "size_vs_f32": "{:.3f}".format, "common_prefix": "{:.1%}".format,
        "identical": lambda v: f"{v}/{len(rows)}", **{k: "{:.5f}".format for k in ("kl_kv", "kl_keys", "kl_values")},
        **{k: "{:.3f}".format for k in ("top1_kv", "top1_keys", "top1_values")},
    })  # fmt: skip
