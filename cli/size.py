"""``kvstore size``: KV-cache size per model, estimated from its shape and measured in a store."""
from __future__ import annotations

import click

from kvstore.errors import ModelError
from kvstore.size import DEFAULT_EXAMPLES, DEFAULT_SEQ_LEN, INFERENCE_DTYPES, normalize_dtype, plot_report, size_report


def _dtypes(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if part.lower() == "all":
                out += INFERENCE_DTYPES
            elif part:
                try:
                    out.append(normalize_dtype(part))
                except ModelError as exc:
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
@click.option("--seq-len", type=click.IntRange(min=1), default=DEFAULT_SEQ_LEN, show_default=True, help="Tokens per example.")
@click.option("--examples", type=click.IntRange(min=1), default=DEFAULT_EXAMPLES, show_default=True, help="Examples in the dataset.")
@click.option(
    "--dtype",
    "dtypes",
    multiple=True,
    default=("float32",),
    show_default=True,
    callback=_dtypes,
    help="float32, float16 or bfloat16 (fp32/fp16/bf16 work too); repeat it, or 'all'.",
)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option(
    "--plot", type=click.Path(dir_okay=False), default=None, help="Also draw bytes per example per model and dtype (PNG; needs matplotlib)."
)
@click.option("--store", type=click.Path(), default=None, help="Also measure what this store holds per model and dtype.")
def size(
    models: tuple[str, ...], seq_len: int, examples: int, dtypes: tuple[str, ...], fmt: str, plot: str | None, store: str | None
) -> None:
    """Bytes of KV cache per token, per example and per dataset, for each MODEL.

    \b
    bytes = 2 (keys, values) x layers x kv_heads x head_dim x tokens x bytes per element
    Sliding-window layers hold at most their window. Without MODEL: the eight Pythia models,
    smallest first (built in, nothing loaded). MODEL is a Pythia name (pythia-70m,
    EleutherAI/pythia-1b), 'default' (the bundled SmolLM2-135M-Instruct), a .gguf file, a directory
    holding config.json, or a hub id. The cumulative column adds the models up in the order given.
    """
    report = size_report(models, seq_len=seq_len, examples=examples, dtypes=dtypes, store=store)
    if fmt == "table":
        click.echo(report.to_table(), nl=False)
    elif fmt == "csv":
        click.echo(report.to_csv(), nl=False)
        for note in report.notes:  # keep stdout a plain CSV file
            click.echo(f"note: {note}", err=True)
    else:
        click.echo(report.to_json(), nl=False)
    if plot:
        path = plot_report(report, plot)
        click.echo(f"plot written to {path}", err=True)
