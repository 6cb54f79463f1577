"""Human-readable numbers for reports (binary units: KiB, MiB, GiB)."""

from __future__ import annotations

import datetime as _dt


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``; exact below 1 KiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_time(ts: float | None) -> str:
    """A UTC timestamp as ``2026-11-21 13:45``; ``-`` for None."""
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
