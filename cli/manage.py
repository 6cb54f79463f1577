"""Store management commands: ``kvstore ls``, ``stats``, ``verify``, ``rm``, ``gc``.

A store holds *contexts*, each a chain of *chunks* (entries); a chunk several contexts share is
stored once. The read commands open the store read-only (a missing store is an error, never
created). ``rm`` and ``gc`` plan first (``kvstore.store.gc.plan_gc``), print the plan, ask
(unless ``--yes``), then remove everything planned at once; ``--dry-run`` prints the plan and
changes nothing. Torch-heavy modules are imported inside the command bodies so that ``--help``
stays fast.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

from kvstore.cli.common import (
    DURATION,
    SIZE,
    CLIError,
    PlanRun,
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
    store_options,
    warn,
    yes_option,
)
from kvstore.cli.flags import receives
from kvstore.cli.listing import count as _count
from kvstore.cli.listing import warn_unreadable as _warn_corrupt
from kvstore.units import human_bytes

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

_OLDER = "Contexts not used for this long (30d, 12h, 2w...)."
_LMDB_NOTE = "LMDB files never shrink: space freed by rm/gc is reused by new entries"

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.gc import GcOptions
    from kvstore.store.scan import StoreInfo


# -- ls -----------------------------------------------------------------------------------------
@click.command()
@store_option
@click.option("--model", metavar="NAME|FINGERPRINT", help="Only this model's (name, or fingerprint prefix).")
@click.option("--chunks", is_flag=True, help="List the stored chunks (entries) instead of the contexts.")
@click.option(
    "--derived", "derived", is_flag=True,
    help="List the derived entries (contexts' scores and pressed caches) instead of the contexts.",
)  # fmt: skip
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
def ls(store: str, model: str | None, chunks: bool, derived: bool, sort_by: str, reverse: bool, full_keys: bool,
       fmt: str) -> None:  # fmt: skip
    """List the contexts of a store (or, with --chunks, its chunks; with --derived, its derived entries).

    A context row shows its key (its last chunk's), model name and fingerprint (both shortened to
    12 characters unless --full-keys), KV dtype, tokens, chunks, codec, size (its chunks, shared
    ones included), KV-RATIO (size / its keys and values in the model's dtype), creation time, last
    use (UTC) and the device and attention implementation its numbers came from; in a store
    holding derived entries, also what each context has of them (kind, spec, codec, kept fraction,
    size). A context stored only as pressed caches shows 0 chunks. JSON and CSV carry every field
    unabbreviated, sizes in bytes and times in seconds since the epoch. Entries whose header cannot
    be read are skipped with a warning (`kvstore verify` checks every byte).
    """
    from kvstore.cli.listing import context_rows, show

    if chunks and derived:
        raise click.UsageError("--chunks and --derived list different things; give one of them")
    with open_store(store, readonly=True) as s:
        info = s.scan()
    _warn_corrupt(info)
    field, descending = _SORTS[sort_by]
    what = "derived entry" if derived else "chunk" if chunks else "context"
    if derived or chunks:
        records = [x.as_record() for x in (info.derived if derived else info.entries) if x.matches_model(model)]
    else:
        records = context_rows(info, model)
    records.sort(key=lambda r: r["key"])
    records.sort(key=lambda r: r[field], reverse=descending != reverse)
    if fmt != "table":
        for r in records:  # in CSV a context's derived entries are one cell, as the table shows them
            r.pop("numerics_str", None)
            phrase = r.pop("derived_str", None)
            if fmt == "csv" and phrase is not None:
                r["derived"] = phrase
        emit(records, fmt)
        return
    if not records:
        click.echo(f"No {_count(0, what).split(' ', 1)[1]} in {info.url}" + (f" for model {model}." if model else "."))
        return
    show(records, what, full_keys)
    total = sum(r["stored_bytes"] for r in records)
    raw = sum(r["raw_bytes"] for r in records)
    shared = " (shared chunks counted per context)" if what == "context" and info.dedupe_ratio > 1.0 else ""
    click.echo(
        f"\n{_count(len(records), what)}, {human_bytes(total)} stored{shared} ({human_bytes(raw)} uncompressed)."
    )


# -- stats --------------------------------------------------------------------------------------
@click.command()
@store_option
@format_option
def stats(store: str, fmt: str) -> None:
    """Totals of a store per model, dtype and codec.

    For each (model name, fingerprint, KV dtype, codec): contexts, tokens, uncompressed bytes,
    logical bytes (each context's chunks, a shared chunk counted for every context that uses it),
    physical bytes (each chunk once), their ratio (dedupe), KV-RATIO (logical bytes over the keys
    and values in the model's dtype: a lossy codec's saving included) and stored bytes per token;
    then the store's totals and the size of its file on disk, which can exceed the stored bytes:
    LMDB files never shrink, and space freed by rm/gc is reused by new entries.
    """
    from kvstore.store.summary import owned_totals, summarize

    with open_store(store, readonly=True) as s:
        info = s.scan()
    _warn_corrupt(info)
    rows = [g.as_record() for g in summarize(info)]
    kinds = [d.as_record() for d in owned_totals(info)]
    totals = _stats_totals(info)
    description = {"store": info.url, "format": info.format, "codec": info.codec, "codec_reason": info.codec_reason,
                   "chunk_tokens": info.chunk_tokens}  # fmt: skip
    if fmt == "json":
        echo_json(description | {"groups": rows, "totals": totals, "derived": kinds})
        return
    if fmt == "csv":
        emit(rows, "csv")
        return
    click.echo(
        f"Store {info.url} (format {info.format}, codec for new entries {info.codec}, {info.chunk_tokens}-token chunks)"
    )
    if info.codec_reason:
        click.echo(f"Codec {info.codec}: {info.codec_reason}")
    if rows:
        click.echo()
        _stats_table(rows)
    click.echo()
    _stats_footer(info, totals, kinds)


def _stats_totals(info: StoreInfo) -> dict[str, Any]:
    """The store's totals, as ``stats --format json`` gives them."""
    return {
        "contexts": len(info.contexts),
        "entries": info.n_entries,
        "orphan_chunks": len(info.orphans),
        "corrupt": len(info.corrupt),
        "unknown": len(info.unknown),
        "n_tokens": info.n_tokens,
        "raw_bytes": info.raw_bytes,
        "logical_bytes": info.logical_bytes,
        "stored_bytes": info.stored_bytes,
        "dedupe_ratio": round(info.dedupe_ratio, 4),
        "ratio": round(info.stored_bytes / info.raw_bytes, 4) if info.raw_bytes else 1.0,
        "disk_bytes": info.disk_bytes,
        "derived_entries": len(info.derived),
        "derived_bytes": info.owned_bytes,
        "orphan_derived": len(info.orphan_owned),
    }


def _stats_table(rows: list[dict[str, Any]]) -> None:
    """One table row per (model, fingerprint, dtype, codec) group."""
    emit(
        rows,
        "table",
        columns={
            "model_name": "MODEL",
            "model": "FINGERPRINT",
            "dtype": "DTYPE",
            "codec": "CODEC",
            "contexts": "CONTEXTS",
            "n_tokens": "TOKENS",
            "raw_bytes": "UNCOMPRESSED",
            "stored_bytes": "LOGICAL",
            "physical_bytes": "PHYSICAL",
            "dedupe_ratio": "DEDUPE",
            "stored_to_kv": "KV-RATIO",  # logical bytes over the keys and values in the model's dtype
            "bytes_per_token": "BYTES/TOKEN",
        },  # fmt: skip
        formatters={
            "model": short,
            "raw_bytes": human_bytes,
            "stored_bytes": human_bytes,
            "physical_bytes": human_bytes,
            "bytes_per_token": lambda b: f"{b:,.0f}",
            "dedupe_ratio": lambda r: f"{r:.2f}x",
            "stored_to_kv": lambda r: f"{r:.3f}",
        },  # fmt: skip
        align="llllrrrrrrrr",
    )


def _stats_footer(info: StoreInfo, totals: dict[str, Any], kinds: list[dict[str, Any]]) -> None:
    """The totals, each kind of owned entry's, and what is unused, unreadable, on disk."""
    click.echo(
        f"Total: {_count(totals['contexts'], 'context')}, {totals['n_tokens']:,} tokens; "
        f"{_count(totals['entries'], 'chunk')}, {human_bytes(totals['stored_bytes'])} stored "
        f"({human_bytes(totals['logical_bytes'])} logical, dedupe {totals['dedupe_ratio']:.2f}x; "
        f"{human_bytes(totals['raw_bytes'])} uncompressed, ratio {totals['ratio']:.2f})"
    )
    for k in kinds:
        kept = f", keeping {k['kept_fraction']:.1%} of their (token, head) pairs" if k["kept_pairs"] else ""
        click.echo(
            f"Derived, {k['kind']}: {_count(k['entries'], 'entry')} of {_count(k['contexts'], 'context')}, "
            f"{human_bytes(k['stored_bytes'])} stored ({human_bytes(k['raw_bytes'])} uncompressed){kept}; "
            f"{k['specs']}; {k['codecs']}"
        )
    if info.orphans:
        click.echo(f"Unused: {_count(len(info.orphans), 'chunk')} no context uses (`kvstore gc` collects them)")
    if info.orphan_owned:
        click.echo(
            f"Unused: {_count(len(info.orphan_owned), 'derived entry')} whose context is gone (`kvstore gc` "
            "collects them)"
        )
    if info.corrupt:
        bad = human_bytes(sum(c.stored_bytes for c in info.corrupt))
        click.echo(f"Unreadable: {_count(len(info.corrupt), 'entry')} ({bad})")
    if info.unknown:
        newer = human_bytes(sum(c.stored_bytes for c in info.unknown))
        click.echo(f"Unknown: {_count(len(info.unknown), 'entry')} ({newer}), a newer format or kind: upgrade kvstore")
    if info.disk_bytes is not None:
        click.echo(f"On disk: {human_bytes(info.disk_bytes)} ({_LMDB_NOTE})")


# -- verify -------------------------------------------------------------------------------------
@click.command()
@store_option
@quiet_option
def verify(store: str, quiet: bool) -> None:
    """Check every entry's checksum and structure, and every context's chain.

    Reads and decodes every entry and derived entry (the checksum, then the header and tensors
    against each other), then walks every context's chain (each chunk present, intact, continuing the one
    before it). Prints each corrupt entry and broken context and what is wrong, and exits 1 if
    there is any; `kvstore gc --corrupt` removes corrupt entries (a broken context is rebuilt
    from where it breaks by the next build or sample). Changes nothing.
    """
    from kvstore.store.tables import RECORDED

    with open_store(store, readonly=True) as s:
        with progress_bar(len(s) + len(s.all_derived()), "verify", quiet, unit="entry") as bar:
            info = s.verify(progress=bar)
    contexts, newer = info.contexts, info.unknown_chunks  # a context using a newer writer's chunk is not broken
    broken = [(contexts.keys[i], reason) for i in range(len(contexts))
              if not newer.intersection(contexts.chunk_keys(i)) and (reason := contexts.problem(i))]  # fmt: skip
    tiered = "cache_dir" in store_options()  # through a local tier the remote's copies are what count
    remote_bad = {(c.context, c.key) for c in info.corrupt}
    for c in info.corrupt:
        of = f" (derived entry of context {c.context})" if c.context else ""
        click.echo(f"corrupt  {c.key}  {c.reason}{of}" + (" (the remote's copy)" if tiered else ""))
    for c in info.local_corrupt:
        of = f" (derived entry of context {c.context})" if c.context else ""
        other = "corrupt too" if (c.context, c.key) in remote_bad else "intact"
        click.echo(f"corrupt  {c.key}  {c.reason}{of} (the local tier's copy; the remote's is {other})")
    for key, reason in broken:
        click.echo(f"broken   {key}  {reason}")
    for c in info.malformed:
        click.echo(f"malformed  {c.key}  {c.reason}")
    for c in info.unknown:
        click.echo(f"unknown  {c.key}  {c.reason}" + (f" (derived entry of context {c.context})" if c.context else ""))
    total = info.n_entries + len(info.derived) + len(info.corrupt) + len(info.unknown)
    entries = _count(total, "entry") + (f" ({len(info.derived)} derived)" if info.derived else "")
    if info.corrupt or broken or info.malformed:
        parts = [_corrupt_share(info, total)] if info.corrupt else []
        parts += [f"{len(broken)} of {_count(len(contexts), 'context')} broken"] if broken else []
        n_records = sum(kind == RECORDED for kind in contexts.kind) + len(info.malformed)
        parts += [f"{len(info.malformed)} of {_count(n_records, 'context record')} malformed"] if info.malformed else []
        raise CLIError("; ".join(parts) + "; `kvstore gc --corrupt` removes corrupt entries")
    if info.local_corrupt:
        click.echo(
            f"{entries} and {_count(len(contexts), 'context')} verified, all intact in the remote store; "
            f"{len(info.local_corrupt)} bad in the local tier (a read drops such a copy and reads the remote's; "
            "`kvstore gc --corrupt` with this --cache-dir drops them all)."
        )
        return
    click.echo(f"{entries} and {_count(len(contexts), 'context')} verified, all intact.")
    if info.unknown:  # not damage: exit 0, with the advice
        warn(
            f"{_count(len(info.unknown), 'entry')} of a newer format or of a kind this process does not know "
            "(checksums intact): kept by gc, copied by sync; upgrade kvstore (or load the plug-in) to read them"
        )


def _corrupt_share(info: Any, total: int) -> str:
    """``N of M entries corrupt``, then the chunk entries' and derived entries' own shares, so that no
    count reads as a count of corrupt ones."""
    bad_derived = sum(1 for c in info.corrupt if c.context)
    all_derived = len(info.derived) + bad_derived
    share = f"{len(info.corrupt)} of {_count(total, 'entry')} corrupt"
    if not all_derived:
        return share
    return (
        f"{share} ({len(info.corrupt) - bad_derived} of {total - all_derived} chunk entries, {bad_derived} of "
        f"{all_derived} derived entries)"
    )


# -- rm / gc ------------------------------------------------------------------------------------
def _show_plan(plan: Any, info: Any, *, limit: int | None) -> None:
    from kvstore.cli.listing import model_names

    name = model_names(info)
    rows = [
        {"what": "context", "key": k, "model_name": name(k), "stored_bytes": b, "reason": why}
        for k, why, b in plan.contexts
    ]
    rows += [
        {"what": "derived" if r.owner else "entry", "key": r.key, "model_name": name(r.key),
         "stored_bytes": r.stored_bytes, "reason": r.reason}
        for r in plan.entries
    ]  # fmt: skip
    rows += [
        {"what": "tier copy", "key": r.key, "model_name": name(r.key), "stored_bytes": r.stored_bytes,
         "reason": r.reason}
        for r in plan.tier_copies
    ]  # fmt: skip
    shown = rows if limit is None else rows[:limit]
    emit(
        shown,
        "table",
        columns={"what": "WHAT", "key": "KEY", "model_name": "MODEL", "stored_bytes": "SIZE", "reason": "REASON"},
        formatters={"key": short, "stored_bytes": human_bytes},
        align="lllrl",
    )
    if len(shown) < len(rows):
        click.echo(f"... and {len(rows) - len(shown)} more (--dry-run lists them all)")
    n_local = len(plan.tier_copies)
    local = f" {_count(n_local, 'bad tier copy')} to drop from the local tier (the remote's stay)."
    click.echo(
        f"\n{_what(plan)} to remove, {human_bytes(plan.freed_bytes)} freed; {human_bytes(plan.keep_bytes)} of entries "
        "stay." + (local if n_local else "")
    )


def _what(plan: Any) -> str:
    """``N contexts and M entries`` (``, N contexts, M entries and D derived entries`` with derived ones)."""
    owned = sum(1 for r in plan.entries if r.owner)
    contexts, entries = _count(len(plan.contexts), "context"), _count(len(plan.entries) - owned, "entry")
    if owned:
        return f"{contexts}, {entries} and {_count(owned, 'derived entry')}"
    return f"{contexts} and {entries}"


def _run_plan(store: str, options: GcOptions, *, verify_all: bool, dry_run: bool, yes: bool, quiet: bool) -> None:
    from kvstore.store.gc import plan_gc
    from kvstore.store.removal import execute_plan

    # a dry run only reads; otherwise open for writing up front, so that an unwritable store
    # fails before the scan rather than after the question
    with open_store(store, readonly=dry_run) as s:
        if verify_all:
            with progress_bar(len(s) + len(s.all_derived()), "verify", quiet, unit="entry") as bar:
                info = s.verify(progress=bar)
        else:
            info = s.scan()
        plan = plan_gc(info, options, now=time.time())
        if not plan.entries and not plan.contexts and not plan.tier_copies:
            click.echo("Nothing to remove.")
            return
        _show_plan(plan, info, limit=None if dry_run else 20)
        if dry_run:
            click.echo("Dry run: nothing removed.")
            return
        question = f"Remove {_what(plan)}?"
        if not confirm(question, yes=yes, hint="or --dry-run to see the plan"):
            return
        report = execute_plan(s, plan)  # removes only what is still as planned
    derived = f" and {_count(len(report.derived), 'derived entry')}" if report.derived else ""
    click.echo(
        f"Removed {_count(len(report.contexts), 'context')}{',' if derived else ' and'} "
        f"{_count(len(report.entries), 'entry')}{derived}, freed {human_bytes(report.freed_bytes)} ({_LMDB_NOTE})."
    )
    if report.dropped_local:
        click.echo(f"Dropped {_count(report.dropped_local, 'bad tier copy')}; the remote's copies are intact.")
    if report.kept:
        click.echo(
            f"Kept {len(report.kept)} of the planned: used, recorded or repaired since the plan (by a build or "
            "sample running meanwhile)."
        )


@click.command()
@store_option
@click.argument("keys", nargs=-1, metavar="[KEY]...")
@click.option("--model", metavar="NAME|FINGERPRINT", help="Contexts of this model (name, or fingerprint prefix).")
@click.option(
    "--older-than", type=DURATION, metavar="DURATION", help="Contexts not used for this long (30d, 12h, 2w...)."
)
@dry_run_option
@yes_option
def rm(
    store: str, keys: tuple[str, ...], model: str | None, older_than: float | None, dry_run: bool, yes: bool
) -> None:
    """Remove contexts by key, model or age.

    KEY may be any prefix of a context's key (as `kvstore ls` shows them) or of an entry's
    (`kvstore ls --chunks`, e.g. a corrupt one). A removed context's chunks go with it unless
    another context uses them. Options narrow each other: `kvstore rm --model tiny --older-than
    30d` removes tiny's contexts unused for 30 days. Prints the plan and asks before removing
    anything (--yes skips the question; it is required without a terminal).
    """
    if not keys and not model and older_than is None:
        raise click.UsageError("say what to remove: KEY..., --model or --older-than")
    from kvstore.store.gc import GcOptions

    options = GcOptions(keys=keys, model=model, older_than=older_than)
    _run_plan(store, options, verify_all=False, dry_run=dry_run, yes=yes, quiet=True)


def _gc_options(values: Mapping[str, Any]) -> GcOptions:
    """``gc``'s removal options from its flags (``--max-size`` fills ``max_bytes``; unused chunks always go)."""
    from kvstore.store.gc import GcOptions

    v = values
    return GcOptions(corrupt=v["corrupt"], older_than=v["older_than"], max_bytes=v["max_size"], model=v["model"],
                     orphans=True, grace=v["grace"])  # fmt: skip


@click.command()
@store_option
@click.option("--corrupt", is_flag=True, help="Corrupt entries (verifies every entry first).")
@click.option(
    "--older-than", type=DURATION, metavar="DURATION", help="Contexts not used for this long (30d, 12h, 2w...)."
)
@click.option(
    "--max-size",
    type=SIZE,
    metavar="SIZE",
    help="Then remove least-recently-used contexts until the chunks left fit (10GiB, 500MiB...).",
)
@click.option(
    "--model", metavar="NAME|FINGERPRINT", help="Only consider this model's contexts (name, or fingerprint prefix)."
)
@click.option(
    "--grace",
    type=DURATION,
    metavar="DURATION",
    default="1h",
    show_default=True,
    help="Chunks no context uses go once unused this long (a running build writes chunks before its context); "
    "below 10m it warns.",
)
@dry_run_option
@yes_option
@quiet_option
@receives(store=lambda values: values["store"], options=_gc_options, run=PlanRun)
def gc(store: str, options: GcOptions, run: PlanRun) -> None:
    """Remove unused chunks, corrupt entries, old contexts, or shrink to a size budget.

    Always removes chunks no context uses any more once unused for --grace (default 1h: a build
    running meanwhile, or one that just found a chunk to reuse, keeps it). --corrupt verifies
    every entry and removes those that fail; --older-than removes contexts not used for that long;
    --max-size then removes the least recently used contexts until the remaining chunks fit (with
    --model: that model's). A removed context's chunks go unless another context uses them.
    Prints the plan and asks before removing anything (--yes skips the question). The store's file
    keeps its size: LMDB reuses the freed space for new entries. Only what is still as planned
    goes: anything used, recorded or repaired since the plan (while the question waited) stays.
    """
    from kvstore.store.gc import SAFE_GRACE_SECONDS

    grace = options.grace
    if grace < SAFE_GRACE_SECONDS:
        warn(
            f"--grace {grace:g}s is under {SAFE_GRACE_SECONDS / 60:g} minutes: chunks a running build has written "
            "but not recorded yet may go (the build then computes them again)"
        )
    _run_plan(store, options, verify_all=options.corrupt, dry_run=run.dry_run, yes=run.yes, quiet=run.quiet)
