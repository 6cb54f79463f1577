"""Helpers shared by the CLI commands: common options, output formats, progress, errors.

Importing this module must stay cheap (click and the standard library only): ``kvstore --help``
and every ``kvstore CMD --help`` import it. Heavy modules (torch via ``kvstore.store``, tqdm) are
imported inside the functions that need them.

Conventions for command modules:

* results go to stdout (``emit`` for anything tabular: ``--format table|json|csv``); warnings
  (``warn``) and progress bars (``progress_bar``) go to stderr;
* a library :class:`kvstore.errors.KVStoreError` may simply propagate: ``kvstore.cli.main.main`` prints
  it as one line (``kvstore: error: ...``) and exits 1;
* a failure the command itself detects is ``raise CLIError("what happened; what to do")``: one
  line, exit 1 (never ``ctx.exit(1)``: ``kvstore.cli.main.main`` runs click with
  ``standalone_mode=False``, which turns ``ctx.exit(n)`` into a return value);
* a bad option value is a ``click.BadParameter`` (usage error, exit 2); the ``SIZE`` and
  ``DURATION`` parameter types do that for sizes and durations;
* destructive commands plan first, print the plan, then ``confirm(...)`` unless ``--yes``.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import click

from kvstore.cli.table import render_table

STORE_DEFAULT_HELP = "$KVSTORE_STORE or cache/store"


# -- errors -----------------------------------------------------------------------------------
class CLIError(click.ClickException):
    """A one-line failure detected by a command: printed as ``kvstore: error: MESSAGE``, exit 1."""

    exit_code = 1

    def show(self, file: IO[str] | None = None) -> None:
        click.echo(f"kvstore: error: {self.format_message()}", err=True, file=file)


def warn(message: str) -> None:
    """Print ``kvstore: warning: MESSAGE`` on stderr."""
    click.echo(f"kvstore: warning: {message}", err=True)


# -- common options ---------------------------------------------------------------------------
def _resolve_store(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    if value:
        return value
    from kvstore.paths import default_store  # cheap (os, pathlib); read at call time, not import

    return default_store()


_TIER_META = "kvstore.tier"  # ctx.meta key: the --cache-dir / --cache-size values


def _remember_tier(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is not None:
        ctx.meta.setdefault(_TIER_META, {})[param.name] = value


def tier_options(fn: Callable) -> Callable:
    """``--cache-dir DIR`` (or ``$KVSTORE_CACHE_DIR``) and ``--cache-size SIZE`` (or
    ``$KVSTORE_CACHE_SIZE``, default 10GiB): a local LMDB tier in front of the store. They are not
    passed to the command: :func:`open_store` and :func:`store_options` read them."""
    fn = click.option(
        "--cache-size",
        type=SIZE,
        metavar="SIZE",
        default=None,
        envvar="KVSTORE_CACHE_SIZE",
        expose_value=False,
        callback=_remember_tier,
        show_default="10GiB",
        help="Most bytes the --cache-dir tier holds; least recently used values go first.",
    )(fn)
    fn = click.option(
        "--cache-dir",
        type=click.Path(file_okay=False),
        metavar="DIR",
        default=None,
        envvar="KVSTORE_CACHE_DIR",
        expose_value=False,
        callback=_remember_tier,
        help="Local LMDB tier in front of a remote --store (read-through, write-through); answers what it "
        "holds even when the remote is down.",
    )(fn)
    return fn


def store_option(fn: Callable) -> Callable:
    """``--store PATH|URL`` (a directory, ``lmdb://DIR``, ``s3://BUCKET[/PREFIX]``,
    ``memory://NAME``) and the local tier in front of it (:func:`tier_options`).

    The command receives ``store: str``, already resolved: the option's value, else
    ``$KVSTORE_STORE``, else ``<kvstore home>/store`` (see :func:`kvstore.paths.default_store`)."""
    fn = tier_options(fn)
    return click.option(
        "--store",
        "store",
        metavar="PATH|URL",
        default=None,
        callback=_resolve_store,
        show_default=STORE_DEFAULT_HELP,
        help="Store: a directory (LMDB) or s3://BUCKET[/PREFIX] (endpoint and credentials: the AWS_* variables).",
    )(fn)


def store_options() -> dict[str, Any]:
    """Backend options from ``--cache-dir`` / ``--cache-size`` of the running command (``{}``
    without a tier), for ``KVStore(store, **store_options())``."""
    ctx = click.get_current_context(silent=True)
    tier = dict(ctx.meta.get(_TIER_META, {})) if ctx is not None else {}
    if tier.get("cache_dir") is None:
        if tier.get("cache_size") is not None:
            raise click.UsageError("--cache-size needs --cache-dir")
        return {}
    return {k: v for k, v in tier.items() if v is not None}


def format_option(
    fn: Callable | None = None, *, choices: Sequence[str] = ("table", "json", "csv"), default: str = "table"
):
    """``--format table|json|csv`` (the command receives ``fmt: str``). Use bare
    (``@format_option``) or with other ``choices``/``default``."""

    def deco(f: Callable) -> Callable:
        return click.option(
            "--format",
            "fmt",
            type=click.Choice(list(choices)),
            default=default,
            show_default=True,
            help="Output format.",
        )(f)

    return deco(fn) if fn is not None else deco


def quiet_option(fn: Callable) -> Callable:
    """``-q/--quiet``: hide progress bars (the command receives ``quiet: bool``)."""
    return click.option("-q", "--quiet", is_flag=True, help="Hide progress bars.")(fn)


def dry_run_option(fn: Callable) -> Callable:
    """``--dry-run``: print the plan, change nothing (the command receives ``dry_run: bool``)."""
    return click.option("--dry-run", is_flag=True, help="Print what would be removed; change nothing.")(fn)


def yes_option(fn: Callable) -> Callable:
    """``-y/--yes``: skip the confirmation prompt (the command receives ``yes: bool``)."""
    return click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation (needed without a terminal).")(
        fn
    )


@dataclass(frozen=True)
class PlanRun:
    """How a removal plan runs: ``--dry-run`` (print it only), ``--yes`` (do not ask), ``--quiet``
    (no progress bars)."""

    dry_run: bool
    yes: bool
    quiet: bool = True


# -- stores -----------------------------------------------------------------------------------
def open_store(store: str, *, readonly: bool, create: bool = False):
    """Open a :class:`kvstore.store.KVStore` (imports torch). ``readonly`` for commands that only
    read; ``create`` for commands that may start a new store. Unless ``create``, a missing store
    raises ``StoreNotFoundError``; a path that is a file raises ``StoreError``: ``cli.main``
    prints either as one line."""
    from kvstore.store.kvstore import KVStore

    if readonly:
        return KVStore(store, readonly=True, **store_options())
    return KVStore(store, create=create, **store_options())


# -- confirmation -------------------------------------------------------------------------------
def stdin_is_tty() -> bool:
    """Whether a person can answer a prompt (tests monkeypatch this)."""
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def confirm(question: str, *, yes: bool, hint: str = "") -> bool:
    """Whether to go ahead: True with ``yes`` (``--yes``) or when the user answers yes; False
    (after printing "Nothing changed.") when they answer no. Without a terminal to ask on (and
    without ``--yes``) raises :class:`CLIError` telling them to pass ``--yes``, then ``hint``
    (e.g. ``"or --dry-run to see the plan"``)."""
    if yes:
        return True
    if not stdin_is_tty():
        raise CLIError(
            "no terminal to ask for confirmation on; pass --yes to go ahead" + (f" ({hint})" if hint else "")
        )
    if click.confirm(question, default=False, err=True):
        return True
    click.echo("Nothing changed.", err=True)
    return False


# -- parsing ----------------------------------------------------------------------------------
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from a size: ``10GiB``, ``512 MiB``, ``1.5G`` (binary: K/M/G/T, KiB...), ``10GB``
    (decimal: kB/MB/GB/TB), ``4096`` (bytes). Case-insensitive. Raises ValueError."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size; use e.g. 10GiB, 500MiB, 2GB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)\s*([smhdw])"
_DURATION_RE = re.compile(rf"^\s*(?:{_DURATION_PART}\s*)+$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds from a duration: ``30d``, ``12h``, ``90m``, ``45s``, ``2w``, ``1.5d``, ``1d12h``
    (s/m/h/d/w, case-insensitive). A unit is required: a bare ``30`` is ambiguous, and guessing
    seconds would make ``rm --older-than 30`` remove almost everything. Raises ValueError."""
    if not _DURATION_RE.match(str(text)):
        raise ValueError(f"{text!r} is not a duration; use a number and a unit: 45s, 90m, 12h, 30d, 2w")
    return sum(float(n) * _DURATION_UNITS[u.lower()] for n, u in re.findall(_DURATION_PART, str(text), re.IGNORECASE))


class _Parsed(click.ParamType):
    def __init__(self, name: str, parse: Callable[[str], Any]):
        self.name = name
        self._parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self._parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = _Parsed("size", parse_size)
"""click type for sizes (``--max-size 10GiB`` -> int bytes); bad input is a usage error."""
DURATION = _Parsed("duration", parse_duration)
"""click type for durations (``--older-than 30d`` -> float seconds); bad input is a usage error."""


# -- output -----------------------------------------------------------------------------------
def emit(
    rows: Sequence[Mapping[str, Any]],
    fmt: str,
    *,
    columns: Mapping[str, str] | Sequence[str] | None = None,
    formatters: Mapping[str, Callable[[Any], Any]] | None = None,
    align: str | Sequence[str] | None = None,
    file: IO[str] | None = None,
) -> None:
    """Print records as ``table``, ``json`` or ``csv`` on stdout (or ``file``).

    ``rows``: dicts of raw, JSON-serialisable values (bytes as ints, times as epoch seconds).
    ``json`` prints the list as it is; ``csv`` prints every field with a header line. ``table``
    shows only ``columns`` (field names, or a mapping field -> header), each value passed through
    ``formatters[field]`` when given (e.g. ``human_bytes``), aligned by :func:`render_table`."""
    out = file if file is not None else sys.stdout
    if fmt == "json":
        click.echo(json.dumps(list(map(dict, rows)), indent=2), file=out)
        return
    if fmt == "csv":
        fields: list[str] = []
        for r in rows:
            fields += [k for k in r if k not in fields]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        click.echo(buf.getvalue(), file=out, nl=False)
        return
    if fmt != "table":
        raise ValueError(f"unknown output format {fmt!r}")
    if columns is None:
        columns = list(rows[0]) if rows else []
    headers = dict(columns) if isinstance(columns, Mapping) else {c: c for c in columns}
    formatters = formatters or {}
    table = [[formatters[k](r.get(k)) if k in formatters else r.get(k) for k in headers] for r in rows]
    click.echo(render_table(table, list(headers.values()), align), file=out)


def echo_json(obj: Any, file: IO[str] | None = None) -> None:
    """Print one JSON document (indented) on stdout (or ``file``)."""
    click.echo(json.dumps(obj, indent=2), file=file if file is not None else sys.stdout)


# -- progress ---------------------------------------------------------------------------------
class ProgressBar:
    """A tqdm bar on stderr that is also the library's progress callback (``kvstore.progress``):
    ``bar(items, amount)`` advances by ``items`` and, with ``rate`` (e.g. ``"tok"``), shows the
    amount per second beside the bar. ``bar.update(n)`` advances too. Use as a context manager, or
    call :meth:`close`. With ``quiet`` no bar is shown (and tqdm is not imported); :meth:`write`
    still prints."""

    def __init__(self, total: int | None, desc: str, quiet: bool = False, unit: str = "it", leave: bool = False,
                 rate: str | None = None):  # fmt: skip
        self._bar = None
        self._rate, self._amount, self._t0 = rate, 0, time.perf_counter()
        if not quiet:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=leave, dynamic_ncols=True)

    def __call__(self, items: int, amount: int = 0) -> None:
        self._amount += amount
        if self._bar is None:
            return
        self._bar.update(items)
        elapsed = time.perf_counter() - self._t0
        if self._rate and elapsed > 0:
            self._bar.set_postfix({f"{self._rate}_s": f"{self._amount / elapsed:,.0f}"})

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def set_description(self, desc: str) -> None:
        if self._bar is not None:
            self._bar.set_description(desc)

    def set_postfix(self, **values: Any) -> None:
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def write(self, message: str) -> None:
        """Print a line on stderr without breaking the bar (printed even when quiet)."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            click.echo(message, err=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(
    total: int | None, desc: str, quiet: bool = False, unit: str = "it", *, leave: bool = False, rate: str | None = None
) -> ProgressBar:
    """A :class:`ProgressBar` (tqdm on stderr, imported only when shown); hidden with ``quiet``.
    ``total`` may be None (unknown); ``leave`` keeps the finished bar on screen; ``rate`` names
    the amount shown per second (``tok`` shows tokens/s)."""
    return ProgressBar(total, desc, quiet, unit, leave, rate)


def write_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """``rows`` as JSON lines (UTF-8, not escaped) in the file ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def short(text: str | None, n: int = 12) -> str:
    """The first ``n`` characters of a key or fingerprint (``-`` for None)."""
    return "-" if text is None else text[:n]


__all__ = [
    "CLIError",
    "DURATION",
    "PlanRun",
    "ProgressBar",
    "SIZE",
    "STORE_DEFAULT_HELP",
    "confirm",
    "dry_run_option",
    "echo_json",
    "emit",
    "format_option",
    "open_store",
    "parse_duration",
    "parse_size",
    "progress_bar",
    "quiet_option",
    "short",
    "stdin_is_tty",
    "store_option",
    "store_options",
    "tier_options",
    "warn",
    "yes_option",
    "write_jsonl",
]
