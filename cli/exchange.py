"""``kvstore export`` and ``kvstore import-llminference``: caches out to other tools, and in from
the llminference research code."""

from __future__ import annotations

import click

from kvstore import dtypes
from kvstore.cli.common import CLIError, echo_json, open_store, progress_bar, quiet_option, store_option


@click.command()
@store_option
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--model", metavar="NAME|FINGERPRINT", help="Only this model's contexts (name, or fingerprint prefix).")
@quiet_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def export(store: str, directory: str, model: str | None, quiet: bool, fmt: str) -> None:
    """Write every complete context of a store as DIRECTORY/<key>.safetensors.

    Plain, uncompressed safetensors files that `safetensors.torch.load_file` reads:
    layers.{i}.keys / layers.{i}.values [kv_heads, tokens, head_dim] (lossy entries
    dequantized), token_ids, and the model fingerprint, name, dtype and codec in the metadata.
    Each derived entry, verified, is DIRECTORY/<context>.<kind>.<key>.safetensors: scores as
    layers.{i}.scores, a pressed cache as layers.{i}.heads.{h}.keys / .values / .positions.
    Files already there are skipped, so an interrupted export resumes.
    """
    from kvstore.store.export import export_store

    with open_store(store, readonly=True) as s:
        with progress_bar(None, "export", quiet, unit="ctx") as bar:
            report = export_store(s, directory, model=model, progress=bar)
    summary = {"directory": directory, "written": report.written, "derived": report.derived,
               "skipped": report.skipped, "incomplete": len(report.incomplete), "bytes": report.bytes,
               "derived_corrupt": len(report.derived_bad)}  # fmt: skip
    if fmt == "json":
        echo_json(summary | {"incomplete_keys": report.incomplete, "derived_corrupt_keys": report.derived_bad})
        return
    derived = f" and {report.derived} derived entr{'y' if report.derived == 1 else 'ies'}" if report.derived else ""
    click.echo(f"Exported {report.written} context(s){derived} to {directory} ({report.bytes:,} bytes); "
               f"{report.skipped} already there.")  # fmt: skip
    if report.incomplete:
        click.echo(f"Skipped {len(report.incomplete)} incomplete context(s) (`kvstore verify` names them).", err=True)
    if report.derived_bad:
        n = len(report.derived_bad)
        click.echo(f"Skipped {n} corrupt derived entr{'y' if n == 1 else 'ies'} (`kvstore verify` names them).",
                   err=True)  # fmt: skip


@click.command(name="import-llminference")
@click.argument("source", metavar="CACHE_DIR", type=click.Path(file_okay=False))
@click.argument("dataset")
@click.option("--model", "-m", default=None, help="The model the caches were computed with [default: bundled].")
@click.option("--max-context-length", type=click.IntRange(min=1), required=True,
              help="The context token limit llminference used (part of its file names).")  # fmt: skip
@click.option("--config-json", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The model config JSON exactly as the llminference run wrote it (transformers 4's "
                   "to_json_string); default: this transformers' rendering, which only matches its own "
                   "caches.")  # fmt: skip
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(list(dtypes.KV_DTYPES)))
@click.option("--device", default="cpu", show_default=True)
@click.option("--context-field", default="context", show_default=True)
@click.option("--check", type=click.IntRange(min=0), default=3, show_default=True,
              help="Contexts recomputed to check the files before anything is stored.")  # fmt: skip
@store_option
@quiet_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def import_llminference(source: str, dataset: str, model: str | None, max_context_length: int,
                        config_json: str | None, dtype: str, device: str, context_field: str, check: int, store: str,
                        quiet: bool, fmt: str) -> None:  # fmt: skip
    """Import the KV caches llminference wrote to CACHE_DIR for the contexts of DATASET.

    Each context's file is found by llminference's own naming (MD5 of the config JSON, the
    context text and the context limit), loaded as tensors only (torch.load weights_only: the one
    pickle reader in kvstore), checked against this model's shapes and dtype, spot-checked by
    recomputing --check contexts, and stored as a plain (template-free) context: sample it with
    --no-chat. Files that match no context of DATASET are reported; a file that cannot be read
    (not a tensor archive, truncated, hostile, the wrong shape) is rejected with one line and the
    others are imported. Exits 0 when every good file was imported and the spot check passed, 1
    when nothing could be imported or the spot check failed.
    """
    from pathlib import Path

    from kvstore.data.datasets import load_dataset
    from kvstore.data.readers import Fields
    from kvstore.model.adapter import Adapter
    from kvstore.model.llminference import import_caches
    from kvstore.store.kvstore import KVStore

    data = load_dataset(dataset, Fields(context=context_field), require_question=False)
    adapter = Adapter.from_pretrained(model, dtype=dtype, device=device)
    config_text = Path(config_json).read_text() if config_json else None
    contexts = data.contexts()
    with KVStore(store) as kv, progress_bar(len(contexts), "import", quiet, unit="ctx") as bar:
        report = import_caches(adapter, source, contexts, kv, max_context_length=max_context_length,
                               config_json=config_text, check=check, progress=bar)  # fmt: skip
    summary = {
        "imported": report.imported, "already_stored": report.already_stored, "missing": len(report.missing),
        "unmatched_files": len(report.unmatched), "rejected_files": len(report.rejected), "checked": report.checked,
        "max_abs_diff": report.max_abs_diff,
    }  # fmt: skip
    if fmt == "json":
        echo_json(summary | {"unmatched": report.unmatched, "rejected": report.rejected})
    else:
        click.echo(f"Imported {report.imported} context(s) ({report.already_stored} already stored, "
                   f"{len(report.missing)} without a file); {report.checked} recomputed, max difference "
                   f"{report.max_abs_diff:.3g}.")  # fmt: skip
        for name in report.unmatched[:10]:
            click.echo(f"unmatched  {name}  (no context of {dataset} has this name)")
        for line in report.rejected:  # every file that failed, one line each
            click.echo(f"rejected   {line}")
    if not report.imported and not report.already_stored:
        if report.rejected:
            raise CLIError(
                f"none of the {len(report.rejected)} llminference cache(s) in {source} that match a context of "
                f"{dataset} could be imported (each is listed above with why)"
            )
        raise CLIError(f"no llminference cache in {source} matches a context of {dataset}")
