"""``kvstore export`` and ``kvstore import-llminference``: caches out to other tools, and in from
the llminference research code."""

from __future__ import annotations

from dataclasses import dataclass

import click

from kvstore import dtypes
from kvstore.cli.common import CLIError, echo_json, open_store, progress_bar, quiet_option, store_option
from kvstore.cli.flags import ModelChoice, Report, StoreChoice, receives


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
    Files already there are skipped, so an interrupted export resumes. An incomplete context or a
    corrupt derived entry is not exported, and the export exits 1 (after the others); so is an
    entry of a newer format or of a kind this process does not know (a plug-in's): upgrade kvstore.
    """
    from kvstore.store.export import export_store

    with open_store(store, readonly=True) as s:
        with progress_bar(None, "export", quiet, unit="ctx") as bar:
            report = export_store(s, directory, model=model, progress=bar)
    summary = {"directory": directory, "written": report.written, "derived": report.derived,
               "skipped": report.skipped, "incomplete": len(report.incomplete), "bytes": report.bytes,
               "derived_corrupt": len(report.derived_bad), "unknown": len(report.unknown)}  # fmt: skip
    if fmt == "json":
        echo_json(summary | {"incomplete_keys": report.incomplete, "derived_corrupt_keys": report.derived_bad,
                             "unknown_keys": report.unknown})  # fmt: skip
    else:
        derived = f" and {report.derived} derived entr{'y' if report.derived == 1 else 'ies'}" if report.derived else ""
        click.echo(f"Exported {report.written} context(s){derived} to {directory} ({report.bytes:,} bytes); "
                   f"{report.skipped} already there.")  # fmt: skip
    bad = [f"{len(report.incomplete)} incomplete context(s)"] * bool(report.incomplete) + [
        f"{len(report.derived_bad)} corrupt derived entr{'y' if len(report.derived_bad) == 1 else 'ies'}"
    ] * bool(report.derived_bad)
    bad += [f"{len(report.unknown)} entr{'y' if len(report.unknown) == 1 else 'ies'} of a newer format or an unknown "
            "kind (upgrade kvstore, or load the plug-in that writes them)"] * bool(report.unknown)  # fmt: skip
    if bad:  # as sync: what could not be exported is a failure (exit 1), named by verify
        raise CLIError(f"not exported: {' and '.join(bad)} (`kvstore verify --store {store}` names them)")


@dataclass(frozen=True)
class LLMInferenceCaches:
    """What ``import-llminference`` imports: the cache directory, the dataset whose contexts name
    the files, and how llminference named and made them."""

    source: str
    dataset: str
    context_field: str
    max_context_length: int
    config_json: str | None
    check: int


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
@receives(caches=LLMInferenceCaches, model=ModelChoice, store=StoreChoice, report=Report)
def import_llminference(caches: LLMInferenceCaches, model: ModelChoice, store: StoreChoice, report: Report) -> None:
    """Import the KV caches llminference wrote to CACHE_DIR for the contexts of DATASET.

    Each context's file is found by llminference's own naming (MD5 of the config JSON, the
    context text and the context limit), loaded as tensors only (torch.load weights_only: the one
    pickle reader in kvstore), checked against this model's shapes and dtype, spot-checked by
    recomputing --check contexts, and stored as a plain (template-free) context: sample it with
    --no-chat. Files that match no context of DATASET are reported; a file that cannot be read
    (not a tensor archive, truncated, a pickle that would run code, the wrong shape) is rejected
    with one line naming it and why, and the others are imported. Exits 0 when every good file was
    imported and the spot check passed, 1 when nothing could be imported or the spot check failed.
    """
    from pathlib import Path

    from kvstore.data.datasets import load_dataset
    from kvstore.data.readers import Fields
    from kvstore.model.llminference import import_caches

    data = load_dataset(caches.dataset, Fields(context=caches.context_field), require_question=False)
    adapter = model.load(quiet=True)
    config_text = Path(caches.config_json).read_text() if caches.config_json else None
    contexts = data.contexts()
    with store.open() as kv, progress_bar(len(contexts), "import", report.quiet, unit="ctx") as bar:
        imported = import_caches(adapter, caches.source, contexts, kv, max_context_length=caches.max_context_length,
                                 config_json=config_text, check=caches.check, progress=bar)  # fmt: skip
    _report_import(imported, caches, report.fmt)


def _report_import(imported, caches: LLMInferenceCaches, fmt: str) -> None:
    """The import's summary; CLIError when nothing could be imported."""
    summary = {
        "imported": imported.imported, "already_stored": imported.already_stored, "missing": len(imported.missing),
        "unmatched_files": len(imported.unmatched), "rejected_files": len(imported.rejected),
        "checked": imported.checked, "max_abs_diff": imported.max_abs_diff,
    }  # fmt: skip
    if fmt == "json":
        echo_json(summary | {"unmatched": imported.unmatched, "rejected": imported.rejected})
    else:
        click.echo(f"Imported {imported.imported} context(s) ({imported.already_stored} already stored, "
                   f"{len(imported.missing)} without a file); {imported.checked} recomputed, max difference "
                   f"{imported.max_abs_diff:.3g}.")  # fmt: skip
        for name in imported.unmatched[:10]:
            click.echo(f"unmatched  {name}  (no context of {caches.dataset} has this name)")
        for line in imported.rejected:  # every file that failed, one line each
            click.echo(f"rejected   {line}")
    if not imported.imported and not imported.already_stored:
        if imported.rejected:
            raise CLIError(
                f"none of the {len(imported.rejected)} llminference cache(s) in {caches.source} that match a context "
                f"of {caches.dataset} could be imported (each is listed above with why)"
            )
        raise CLIError(f"no llminference cache in {caches.source} matches a context of {caches.dataset}")
