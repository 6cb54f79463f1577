"""Store management commands: ``kvstore ls``, ``stats``, ``verify``, ``rm``, ``gc``.

The read commands open the store read-only (a missing store is an error, never created). ``rm``
and ``gc`` plan first (``kvstore.store.plan_gc``), print the plan, ask (unless ``--yes``), then
remove everything planned in one transaction; ``--dry-run`` prints the plan and changes nothing.
Torch-heavy modules are imported inside the command bodies so that ``--help`` stays fast.
"""

from __future__ import annotations

import time
from typing import Any

import click

from kvstore.cli.common import (
    DURATION,
    SIZE,
    CLIError,
    confirm,
    dry_run_option,
    echo_json,
    emit,
    format_option,
    open_store,
    progress_bar,
    quiet_option,
    short,
    store_option,
    warn,
    yes_option,
)
from kvstore.units import human_bytes, human_time

_SORTS = {
    # name -> (field of the record, newest/largest first?)
    "key": ("key", False),
    "model": ("model_name", False),
    "tokens": ("n_tokens", True),
    "size": ("stored_bytes", True),
    "ratio": ("ratio", True),
    "created": ("created", True),
    "used": ("last_used", True),
}

_LMDB_NOTE = "LMDB files never shrink: space freed by rm/gc is reused by new entries"


def _entries(n: int) -> str:
    return f"{n} {'entry' if n == 1 else 'entries'}"


def _warn_corrupt(info: Any) -> None:
    for c in info.corrupt:
        warn(f"skipped entry {c.key[:12]}: {c.reason}")
    if info.corrupt:
        warn(f"{_entries(len(info.corrupt))} unreadable, skipped; `kvstore gc --corrupt` removes them")


def _time(ts: float | None) -> str:
    try:
        return human_time(ts)
    except (ValueError, OverflowError, OSError):
        return "?"


# -- ls -----------------------------------------------------------------------------------------
@click.command()
@store_option
@click.option("--model", metavar="NAME|FINGERPRINT", help="Only entries of this model (name, or fingerprint prefix).")
@click.option(
    "--sort",
    "sort_by",
    type=click.Choice(list(_SORTS)),
    default="used",
    show_default=True,
    help="Order: key/model A-Z; tokens/size/ratio largest first; created/used newest first.",
)
@click.option("--reverse", is_flag=True, help="Reverse the order.")
@click.option("--full-keys", is_flag=True, help="Show whole keys and fingerprints in the table.")
@format_option
def ls(store: str, model: str | None, sort_by: str, reverse: bool, full_keys: bool, fmt: str) -> None:
    """List the entries of a store.

    The table shows each entry's key, model name and fingerprint (both shortened to 12
    characters unless --full-keys), KV dtype, tokens, layers, codec, stored size, ratio
    (stored / uncompressed), creation time and last use (UTC). JSON and CSV carry every field
    unabbreviated, sizes in bytes and times in seconds since the epoch. Entries whose header
    cannot be read are skipped with a warning (`kvstore verify` checks every byte).
    """
    with open_store(store, readonly=True) as s:
        info = s.scan()
    _warn_corrupt(info)
    field, descending = _SORTS[sort_by]
    records = [e.as_record() for e in info.entries if e.matches_model(model)]
    records.sort(key=lambda r: r["key"])
    records.sort(key=lambda r: r[field], reverse=descending != reverse)
    if fmt != "table":
        emit(records, fmt)
        return
    if not records:
        click.echo(f"No entries in {info.url}" + (f" for model {model}." if model else "."))
        return
    n = 64 if full_keys else 12
    emit(
        records,
        "table",
        columns={
            "key": "KEY",
            "model_name": "MODEL",
            "model": "FINGERPRINT",
            "dtype": "DTYPE",
            "n_tokens": "TOKENS",
            "n_layers": "LAYERS",
            "codec": "CODEC",
            "stored_bytes": "SIZE",
            "ratio": "RATIO",
            "created": "CREATED",
            "last_access": "LAST USED",
        },  # fmt: skip
        formatters={
            "key": lambda k: short(k, n),
            "model": lambda m: short(m, n),
            "stored_bytes": human_bytes,
            "created": _time,
            "last_access": _time,
        },  # fmt: skip
        align="llllrrlrrll",
    )
    stored = sum(r["stored_bytes"] for r in records)
    raw = sum(r["raw_bytes"] for r in records)
    click.echo(f"\n{_entries(len(records))}, {human_bytes(stored)} stored ({human_bytes(raw)} uncompressed).")


# -- stats --------------------------------------------------------------------------------------
@click.command()
@store_option
@format_option
def stats(store: str, fmt: str) -> None:
    """Totals of a store per model and dtype.

    For each (model name, fingerprint, KV dtype): entries, tokens, uncompressed and stored bytes,
    ratio (stored / uncompressed) and stored bytes per token; then the store's totals and the
    size of its file on disk, which can exceed the stored bytes: LMDB files never shrink, and
    space freed by rm/gc is reused by new entries.
    """
    with open_store(store, readonly=True) as s:
        info = s.scan()
    _warn_corrupt(info)
    from kvstore.store.scan import summarize

    rows = [g.as_record() for g in summarize(info.entries, by=("model_name", "model", "dtype"))]
    totals = {
        "entries": info.n_entries,
        "corrupt": len(info.corrupt),
        "n_tokens": info.n_tokens,
        "raw_bytes": info.raw_bytes,
        "stored_bytes": info.stored_bytes,
        "ratio": round(info.stored_bytes / info.raw_bytes, 4) if info.raw_bytes else 1.0,
        "disk_bytes": info.disk_bytes,
    }
    if fmt == "json":
        echo_json({"store": info.url, "format": info.format, "codec": info.codec, "groups": rows, "totals": totals})
        return
    if fmt == "csv":
        emit(rows, "csv")
        return
    click.echo(f"Store {info.url} (format {info.format}, codec for new entries {info.codec})")
    if rows:
        click.echo()
        emit(
            rows,
            "table",
            columns={
                "model_name": "MODEL",
                "model": "FINGERPRINT",
                "dtype": "DTYPE",
                "entries": "ENTRIES",
                "n_tokens": "TOKENS",
                "raw_bytes": "UNCOMPRESSED",
                "stored_bytes": "STORED",
                "ratio": "RATIO",
                "bytes_per_token": "BYTES/TOKEN",
            },  # fmt: skip
            formatters={
                "model": short,
                "raw_bytes": human_bytes,
                "stored_bytes": human_bytes,
                "bytes_per_token": lambda b: f"{b:,.0f}",
            },
            align="lllrrrrrr",
        )
    click.echo()
    click.echo(
        f"Total: {_entries(totals['entries'])}, {totals['n_tokens']:,} tokens, "
        f"{human_bytes(totals['stored_bytes'])} stored "
        f"({human_bytes(totals['raw_bytes'])} uncompressed, ratio {totals['ratio']:.2f})"
    )
    if info.corrupt:
        click.echo(
            f"Unreadable: {_entries(len(info.corrupt))} ({human_bytes(sum(c.stored_bytes for c in info.corrupt))})"
        )
    if info.disk_bytes is not None:
        click.echo(f"On disk: {human_bytes(info.disk_bytes)} ({_LMDB_NOTE})")


# -- verify -------------------------------------------------------------------------------------
@click.command()
@store_option
@quiet_option
def verify(store: str, quiet: bool) -> None:
    """Check every entry's checksum and structure.

    Reads and decodes every entry (the checksum, then the header and tensors against each
    other). Prints each corrupt entry's key and what is wrong with it and exits 1 if there is
    any; `kvstore gc --corrupt` removes them. Changes nothing.
    """
    with open_store(store, readonly=True) as s:
        with progress_bar(len(s), "verify", quiet, unit="entry") as bar:
            info = s.verify(progress=bar)
    for c in info.corrupt:
        click.echo(f"corrupt  {c.key}  {c.reason}")
    total = info.n_entries + len(info.corrupt)
    if info.corrupt:
        raise CLIError(f"{len(info.corrupt)} of {_entries(total)} corrupt; `kvstore gc --corrupt` removes them")
    click.echo(f"{_entries(total)} verified, all intact.")


# -- rm / gc ------------------------------------------------------------------------------------
def _show_plan(plan: Any, info: Any, *, limit: int | None) -> None:
    names = {e.key: e.model_name for e in info.entries}
    rows = [{"key": k, "model_name": names.get(k, "?"), "stored_bytes": b, "reason": why} for k, why, b in plan.remove]
    shown = rows if limit is None else rows[:limit]
    emit(
        shown,
        "table",
        columns={"key": "KEY", "model_name": "MODEL", "stored_bytes": "SIZE", "reason": "REASON"},
        formatters={"key": short, "stored_bytes": human_bytes},
        align="llrl",
    )
    if len(shown) < len(rows):
        click.echo(f"... and {len(rows) - len(shown)} more (--dry-run lists them all)")
    click.echo(
        f"\n{_entries(plan.n)} to remove, {human_bytes(plan.freed_bytes)}; "
        f"{human_bytes(plan.keep_bytes)} of entries stay."
    )


def _run_plan(
    store: str, plan_args: dict[str, Any], *, verify_all: bool, dry_run: bool, yes: bool, quiet: bool
) -> None:
    from kvstore.store.scan import execute_plan, plan_gc

    # a dry run only reads; otherwise open for writing up front, so that an unwritable store
    # fails before the scan rather than after the question
    with open_store(store, readonly=dry_run) as s:
        if verify_all:
            with progress_bar(len(s), "verify", quiet, unit="entry") as bar:
                info = s.verify(progress=bar)
        else:
            info = s.scan()
        plan = plan_gc(info, now=time.time(), **plan_args)
        if plan.n == 0:
            click.echo("Nothing to remove.")
            return
        _show_plan(plan, info, limit=None if dry_run else 20)
        if dry_run:
            click.echo("Dry run: nothing removed.")
            return
        if not confirm(
            f"Remove {_entries(plan.n)} ({human_bytes(plan.freed_bytes)})?",
            yes=yes,
            hint="or --dry-run to see the plan",
        ):
            return
        removed = execute_plan(s, plan)
    click.echo(f"Removed {_entries(removed)}, freed {human_bytes(plan.freed_bytes)} ({_LMDB_NOTE}).")


@click.command()
@store_option
@click.argument("keys", nargs=-1, metavar="[KEY]...")
@click.option("--model", metavar="NAME|FINGERPRINT", help="Entries of this model (name, or fingerprint prefix).")
@click.option(
    "--older-than", type=DURATION, metavar="DURATION", help="Entries not used for this long (30d, 12h, 2w...)."
)
@dry_run_option
@yes_option
def rm(
    store: str, keys: tuple[str, ...], model: str | None, older_than: float | None, dry_run: bool, yes: bool
) -> None:
    """Remove entries by key, model or age.

    KEY may be any prefix of a key (as `kvstore ls` shows them). Options narrow each other:
    `kvstore rm --model tiny --older-than 30d` removes tiny's entries unused for 30 days. A
    corrupt entry can be removed by key. Prints the plan and asks before removing anything
    (--yes skips the question; it is required without a terminal).
    """
    if not keys and not model and older_than is None:
        raise click.UsageError("say what to remove: KEY..., --model or --older-than")
    _run_plan(
        store,
        {"keys": keys, "model": model, "older_than": older_than},
        verify_all=False,
        dry_run=dry_run,
        yes=yes,
        quiet=True,
    )


@click.command()
@store_option
@click.option("--corrupt", is_flag=True, help="Corrupt entries (verifies every entry first).")
@click.option(
    "--older-than", type=DURATION, metavar="DURATION", help="Entries not used for this long (30d, 12h, 2w...)."
)
@click.option(
    "--max-size",
    type=SIZE,
    metavar="SIZE",
    help="Then remove least-recently-used entries until the rest fit (10GiB, 500MiB...).",
)
@click.option(
    "--model", metavar="NAME|FINGERPRINT", help="Only consider this model's entries (name, or fingerprint prefix)."
)
@dry_run_option
@yes_option
@quiet_option
def gc(store: str, corrupt: bool, older_than: float | None, max_size: int | None, model: str | None,
       dry_run: bool, yes: bool, quiet: bool) -> None:  # fmt: skip
    """Remove corrupt entries, old entries, or shrink to a size budget.

    --corrupt verifies every entry and removes those that fail; --older-than removes entries not
    used for that long; --max-size then removes the least recently used entries until the
    remaining entries' stored bytes fit (with --model: that model's entries fit). The criteria
    add up; --model limits them to one model (a corrupt entry's model is unknown, so --corrupt
    ignores it). Prints the plan and asks before removing anything (--yes skips the question).
    The store's file keeps its size: LMDB reuses the freed space for new entries.
    """
    if not corrupt and older_than is None and max_size is None:
        raise click.UsageError(
            "say what to collect: --corrupt, --older-than or --max-size (to remove a model's entries: kvstore rm "
            "--model)"
        )
    _run_plan(
        store,
        {"corrupt": corrupt, "older_than": older_than, "max_bytes": max_size, "model": model},
        verify_all=corrupt,
        dry_run=dry_run,
        yes=yes,
        quiet=quiet,
    )
