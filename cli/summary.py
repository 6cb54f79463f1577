"""What ``build``, ``sample`` and ``score`` print around their work: one-line warnings for
corrupt entries, the closing summary (aligned lines or JSON), and a sweep's per-variant table."""

from __future__ import annotations

import contextlib

import click

from kvstore.cli.common import echo_json
from kvstore.cli.table import render_table


@contextlib.contextmanager
def corrupt_entries_as_warnings(bar):
    """Show each :class:`kvstore.errors.CorruptEntryWarning` (a stored entry that failed
    verification and was treated as a miss) as one ``kvstore: warning: ...`` line on stderr,
    every time; Python's default would print two lines with a source excerpt, once per place."""
    import warnings

    from kvstore.errors import CorruptEntryWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", CorruptEntryWarning)
        show = warnings.showwarning

        def one_line(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, CorruptEntryWarning):
                bar.write(f"kvstore: warning: {str(message).removeprefix('kvstore: ')}")
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = one_line
        yield


def emit_summary(title: str, summary: dict, fmt: str) -> None:
    """The closing summary: JSON on stdout with ``--format json``, else aligned lines."""
    if fmt == "json":
        echo_json(summary)
        return
    click.echo(f"{title} summary")
    width = max(len(k) for k in summary)
    tables = {k: v for k, v in summary.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
    for k, v in summary.items():
        if v is None or k in tables:
            continue
        if isinstance(v, bool):
            v = "yes" if v else "no"
        elif isinstance(v, int) and k.endswith("bytes"):
            from kvstore.units import human_bytes

            v = f"{v:,} ({human_bytes(v)})"
        elif isinstance(v, float) and (k in METRIC_KEYS or k == "cache_hit_rate"):
            v = f"{v:.1%}"
        elif isinstance(v, int):
            v = f"{v:,}"
        click.echo(f"  {k.replace('_', ' '):<{width}}  {v}")
    for k, table in tables.items():
        click.echo(f"{k.replace('_', ' ')}:")
        _echo_table(table)


def _echo_table(table: list[dict]) -> None:
    """Rows of dicts as one aligned table (fractions as percentages, None as -)."""

    def cell(k: str, v):
        if isinstance(v, float) and (k in METRIC_KEYS or k.startswith("agreement")):
            return f"{v:.1%}"
        return v

    keys = list(table[0])
    rows = [[cell(k, r.get(k)) for k in keys] for r in table]
    body = render_table(rows, [k.replace("_", " ") for k in keys], align="r" * len(keys))
    for line in body.splitlines():
        click.echo("  " + line)


METRIC_KEYS = ("accuracy", "contains", "exact_match", "f1")


def metrics(rows: list[dict]) -> dict:
    """The task metrics over ``rows`` that have accepted answers (each None when none has)."""
    from kvstore.data.metrics import answer_metrics

    mine = [r for r in rows if r["answers"]]
    s = answer_metrics([r["prediction"] for r in mine], [r["answers"] for r in mine]) if mine else {}
    return {k: (round(s[k], 4) if mine else None) for k in METRIC_KEYS}


def variant_table(results, rows: list[dict], n: int, dense_bytes: int = 0) -> list[dict]:
    """Per variant of a sweep: task metrics over its ``n`` rows, tokens/s of its decoding, and
    agreement with the ``dense`` variant (rows with the same tokens; None without a dense one).
    ``kept_tokens``: the rows' kept tokens, each row's a mean over layers and KV heads, rounded (a
    row that keeps a few (token, head) pairs may count 0); ``kept_fraction``: the share of the
    contexts' (token, head) pairs kept, the cache bytes over ``dense_bytes`` (the whole contexts'
    keys and values; None when unknown)."""
    from kvstore.model.variants.variant import DENSE

    dense = next((r for r in results if r.variant == DENSE.name), None)
    table = []
    for v, res in enumerate(results):
        agree = None
        if dense is not None:
            same = sum(
                res.lengths[i] == dense.lengths[i] and bool((res.tokens[i] == dense.tokens[i]).all()) for i in range(n)
            )
            agree = round(same / n, 4) if n else None
        generated = sum(res.lengths)
        table.append(
            {
                "variant": res.variant,
                **metrics(rows[v * n : (v + 1) * n]),
                "agreement_with_dense": agree,
                "kept_tokens": sum(res.kept_tokens),
                "kept_fraction": round(res.cache_bytes / dense_bytes, 4) if dense_bytes else None,
                "cache_bytes": res.cache_bytes,
                "generated_tokens": generated,
                "decode_seconds": round(res.decode_seconds, 3),
                "tokens_per_second": round(generated / res.decode_seconds, 1) if res.decode_seconds else None,
            }
        )
    return table


def lossy_copies_hint(held: dict[str, int], readonly: bool) -> None:
    """One line on stderr when the store held contexts this lossless run missed under a lossy codec
    (a plain sample never reads those): which codec, and that ``--codec`` reads them."""
    if not held:
        return
    codec, n = max(held.items(), key=lambda item: (item[1], item[0]))
    others = ", ".join(k for k in sorted(held) if k != codec)
    done = "computed them" if readonly else "computed them and stored lossless copies"
    click.echo(
        f"kvstore: hint: the store holds {n} of the contexts this run missed under the lossy codec {codec}"
        + (f" (some also under {others})" if others else "")
        + f", which a sample without --codec does not read (it {done}); --codec {codec} reads them (lossy)",
        err=True,
    )


__all__ = [
    "METRIC_KEYS",
    "corrupt_entries_as_warnings",
    "emit_summary",
    "lossy_copies_hint",
    "metrics",
    "variant_table",
]
