"""``kvstore sync SRC DST``: copy what DST lacks from SRC, between any two backends.

The library does the work (:mod:`kvstore.store.transfer`: plan, then execute); this module opens
the two stores, prints the plan, draws the progress bar and the summary.
"""

from __future__ import annotations

import click

from kvstore.cli.common import CLIError, echo_json, progress_bar, quiet_option, warn
from kvstore.units import human_bytes


def _open(url: str, *, readonly: bool):
    from kvstore.errors import StoreNotFoundError
    from kvstore.store.backends import open_backend

    try:
        return open_backend(url, readonly=readonly)
    except StoreNotFoundError:
        if readonly:
            return None
        raise


@click.command(
    epilog="""\b
Examples:
  kvstore sync cache/store s3://my-bucket/kv        # upload a local store
  kvstore sync s3://my-bucket/kv /scratch/kv          # a local copy for a compute node
  kvstore sync s3://my-bucket/kv s3://other/kv --dry-run
  kvstore sync cache/store cache/store --codec int8   # add int8 copies of every context, in place"""
)
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--dry-run", is_flag=True, help="Print what would be copied; change nothing.")
@click.option(
    "--jobs", "-j", type=click.IntRange(min=1), default=4, show_default=True, help="Records copied at a time."
)
@click.option(
    "--codec",
    default=None,
    help="Convert instead of copying: write SRC's contexts into DST re-encoded with this lossy codec (int8[:G], "
    "int4[:G], fp8, int4r, int8r, ecq, int4h, kvh), no recompute; DST may be SRC. sample --codec with the same "
    "codec then finds them.",
)
@quiet_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def sync(src: str, dst: str, dry_run: bool, jobs: int, codec: str | None, quiet: bool, fmt: str) -> None:
    """Copy every record of store SRC that store DST lacks.

    SRC and DST are store directories or URLs (s3://BUCKET[/PREFIX], lmdb://DIR); DST is created
    if absent. Records are copied byte for byte and every entry and derived entry (scores, pressed
    caches) is verified first: a corrupt one is reported and not copied (exit 1). Records DST
    already holds are never replaced, so a sync that was interrupted resumes where it stopped. DST
    keeps its own description if it has one (of the same or a newer format than SRC).
    """
    from kvstore.store.transfer import execute_sync, plan_sync

    if codec is not None:
        _convert(src, dst, codec, dry_run, quiet, fmt)
        return
    if src.rstrip("/") == dst.rstrip("/"):
        raise click.UsageError("SRC and DST are the same store")
    source = _open(src, readonly=True)
    if source is None:
        raise CLIError(f"no store at {src}; check SRC")
    try:
        target = _open(dst, readonly=dry_run)
        try:
            plan = plan_sync(source, target, src_name=src, dst_name=dst)
            entries, derived = plan.entries, plan.derived
            with_derived = f"{derived:,} derived entries, " if derived else ""
            click.echo(
                f"{src} -> {dst}: {len(plan.missing):,} records to copy ({entries:,} entries, {with_derived}"
                f"{len(plan.missing) - entries - derived:,} other), {plan.present:,} already there; "
                + ("DST gets SRC's description" if plan.meta == "copy" else "DST keeps its description"),
                err=fmt == "json",
            )
            if dry_run:
                if fmt == "json":
                    echo_json({"src": src, "dst": dst, "dry_run": True, "to_copy": len(plan.missing),
                               "entries": entries, "derived": derived, "already_present": plan.present,
                               "meta": plan.meta})  # fmt: skip
                else:
                    click.echo("Dry run: nothing copied.")
                return
            assert target is not None
            with progress_bar(len(plan.missing), "sync", quiet, unit="rec", rate="B") as bar:
                report = execute_sync(plan, source, target, jobs=jobs, progress=bar)
        finally:
            if target is not None:
                target.close()
    finally:
        source.close()
    for key, reason in report.corrupt:
        warn(f"entry {key if ' ' in key else key[:16]} of {src} is corrupt ({reason}); not copied")
    for key, reason in report.unknown:
        warn(f"entry {key if ' ' in key else key[:16]} of {src}: {reason}; copied as it is")
    if fmt == "json":
        echo_json(report.as_dict())
    else:
        rate = report.copied_bytes / report.seconds if report.seconds else 0.0
        derived = f"{report.copied_derived:,} derived entries, " if report.copied_derived else ""
        click.echo(
            f"Copied {report.copied:,} records ({report.copied_entries:,} entries, {derived}"
            f"{human_bytes(report.copied_bytes)}) in {report.seconds:.1f} s ({human_bytes(rate)}/s); "
            f"{report.present:,} were already there."
        )
        if report.vanished:
            click.echo(f"{report.vanished:,} records were deleted from {src} while copying.")
    if report.corrupt:
        raise CLIError(
            f"{len(report.corrupt)} corrupt entries of {src} were not copied; `kvstore gc --corrupt --store {src}` "
            "removes them"
        )


def _convert(src: str, dst: str, codec: str, dry_run: bool, quiet: bool, fmt: str) -> None:
    """``sync --codec``: SRC's lossless contexts re-encoded into DST (see :mod:`kvstore.store.convert`)."""
    import contextlib

    from kvstore.errors import StoreNotFoundError
    from kvstore.store.codecs import get_codec
    from kvstore.store.convert import convert_contexts
    from kvstore.store.keyspace import DERIVED
    from kvstore.store.kvstore import KVStore

    chosen = get_codec(codec)
    if chosen.lossless:
        raise CLIError(
            f"--codec {chosen.spec} is lossless: entries under lossless codecs are interchangeable, so sync copies "
            "them as they are; --codec takes a lossy codec (int8, int4, fp8)"
        )
    same = src.rstrip("/") == dst.rstrip("/")
    with contextlib.ExitStack() as stack:
        try:
            source = stack.enter_context(KVStore(src, readonly=dry_run or not same))
        except StoreNotFoundError:
            raise CLIError(f"no store at {src}; check SRC") from None
        if same:
            target = source
        else:
            try:
                target = stack.enter_context(KVStore(dst, readonly=dry_run))
            except StoreNotFoundError:
                if not dry_run:
                    raise
                target = None
        keys = source.context_keys()
        derived = sum(1 for _ in source.backend.keys(DERIVED))  # never converted: said below
        with progress_bar(len(keys), "convert", quiet, unit="ctx") as bar:
            if target is None:  # a dry run into a store that does not exist yet: everything is to do
                report = convert_contexts(source, source, chosen, keys, progress=bar, dry_run=True)
                report.converted += report.present
                report.present = 0
            else:
                report = convert_contexts(source, target, chosen, keys, progress=bar, dry_run=dry_run)
    for problem in report.problems:
        warn(f"not converted: {problem}")
    summary = {
        "src": src, "dst": dst, "codec": chosen.spec, "dry_run": dry_run, "contexts": report.contexts,
        "converted": report.converted, "already_present": report.present, "refused": len(report.problems),
        "chunks_written": report.chunks_written, "raw_bytes": report.raw_bytes, "stored_bytes": report.stored_bytes,
        "ratio": round(report.ratio, 4), "derived_not_converted": derived,
    }  # fmt: skip
    if derived:  # scores and pressed caches are not re-encoded: build --press --codec makes them under a codec
        where = "stay as they are" if same else f"are not copied to {dst} (sync without --codec copies them)"
        warn(
            f"{derived:,} derived entries of {src} (scores, pressed caches) are not converted to {chosen.spec}: they "
            f"{where}; build --press SPEC --codec {chosen.spec} makes pressed caches under it"
        )
    if fmt == "json":
        echo_json(summary)
    elif dry_run:
        click.echo(
            f"Dry run: {report.converted:,} of {report.contexts:,} contexts would be converted to {chosen.spec}; "
            f"{report.present:,} already are, {len(report.problems):,} cannot be."
        )
    else:
        click.echo(
            f"Converted {report.converted:,} contexts to {chosen.spec} ({report.chunks_written:,} chunks, "
            f"{human_bytes(report.stored_bytes)}, {report.ratio:.3f}x their raw size); {report.present:,} already "
            f"were, {len(report.problems):,} could not be."
        )
