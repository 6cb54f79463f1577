"""What ``kvstore ls`` prints: a record per context (with what it has of derived entries), the
table columns for contexts, chunks and derived entries, and model names by key for plans."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore.cli.common import emit, short, warn
from kvstore.units import human_bytes, human_time


def count(n: int, word: str) -> str:
    """``1 entry``, ``2 entries``: ``n`` and ``word`` in the number ``n`` wants."""
    plural = {"entry": "entries", "context": "contexts", "chunk": "chunks", "context record": "context records",
              "bad tier copy": "bad tier copies", "derived entry": "derived entries"}[word]  # fmt: skip
    return f"{n} {word if n == 1 else plural}"


def warn_unreadable(info: Any) -> None:
    """One warning line per entry or context record a scan could not read, then what to do: a
    corrupt one goes with ``gc --corrupt``; one of a newer format or an unknown kind is kept."""
    for c in info.corrupt:
        warn(f"skipped {_entry(c)}: {c.reason}")
    for c in info.malformed:
        warn(f"skipped context {c.key[:12]}: {c.reason}")
    if info.corrupt or info.malformed:
        parts = [count(len(info.corrupt), "entry")] if info.corrupt else []
        parts += [count(len(info.malformed), "context record")] if info.malformed else []
        warn(f"{' and '.join(parts)} unreadable, skipped; `kvstore gc --corrupt` removes them")
    for c in info.unknown:
        warn(f"not listed: {_entry(c)}: {c.reason}")
    if info.unknown:
        warn(
            f"{count(len(info.unknown), 'entry')} of a newer format or of a kind this process does not know, "
            "not listed (kept by gc, copied by sync): upgrade kvstore, or load the plug-in that writes them"
        )


def _entry(c: Any) -> str:
    return f"derived entry {c.key[:12]} of context {c.context[:12]}" if c.context else f"entry {c.key[:12]}"


def _time(ts: float | None) -> str:
    try:
        return human_time(ts)
    except (ValueError, OverflowError, OSError):
        return "?"


def _numerics(numerics: dict) -> str:
    return "/".join(filter(None, (numerics.get("device"), numerics.get("attn")))) or "-"


def context_rows(info: Any, model: str | None) -> list[dict[str, Any]]:
    """One record per context of ``info`` (a scan) of ``model``: its fields, ``numerics_str`` and
    ``derived_str`` for the table (its derived entries, one phrase each)."""
    rows = []
    for c in info.contexts:
        if c.matches_model(model):
            r = c.as_record()
            r["numerics_str"] = _numerics(r["numerics"])
            r["derived_str"] = "; ".join(d.summary() for d in c.derived) or "-"
            rows.append(r)
    return rows


_COMMON = {"model_name": "MODEL", "model": "FINGERPRINT", "dtype": "DTYPE", "n_tokens": "TOKENS"}
# KV-RATIO: stored bytes over the keys and values in the model's dtype (``ratio`` in JSON is over the
# payload before compression: for a lossy codec, already quantized)
_SIZES = {"codec": "CODEC", "stored_bytes": "SIZE", "kv_ratio": "KV-RATIO", "created": "CREATED",
          "last_access": "LAST USED"}  # fmt: skip


def show(records: list[dict[str, Any]], what: str, full_keys: bool) -> None:
    """Print ``records`` (of contexts, chunks or derived entries: ``what``) as ``ls``'s table."""
    n = 64 if full_keys else 12
    if what == "derived entry":
        columns = (
            {"context": "CONTEXT", "key": "KEY", "kind": "KIND", "spec": "SPEC"}
            | _COMMON
            | {"codec": "CODEC", "kept_fraction": "KEPT", **{k: v for k, v in _SIZES.items() if k != "codec"}}
        )
        align = "lllllllrlrrrll"
    else:
        columns = {"key": "KEY"} | _COMMON | ({"start": "START"} if what == "chunk" else {"chunks": "CHUNKS"})
        columns |= _SIZES | {"numerics_str": "NUMERICS"}
        align = "llllrrlrrlll"
        for r in records:
            r.setdefault("numerics_str", _numerics(r["numerics"]))
        if what == "context" and any(r["derived"] for r in records):
            columns |= {"derived_str": "DERIVED"}
            align += "l"
        if what == "context" and any(r.get("passage") for r in records):  # stored alone, for composed contexts
            columns |= {"passage": "PASSAGE"}
            align += "l"
    emit(
        records,
        "table",
        columns=columns,
        formatters={
            "key": lambda k: short(k, n),
            "context": lambda k: short(k, n),
            "model": lambda m: short(m, n),
            "stored_bytes": lambda b: human_bytes(b or 0),
            "kept_fraction": lambda f: "-" if f is None else f"{f:.0%}",
            "kv_ratio": lambda r: "-" if r is None else f"{r:.3f}",
            "passage": lambda p: "passage" if p else "-",
            "created": _time,
            "last_access": _time,
        },  # fmt: skip
        align=align,
    )


def model_names(info: Any) -> Callable[[str], str]:
    """The model name of a key a plan names (a chunk, a context or a derived entry; "?" when the
    scan saw none), looked up in the scan without listing it again."""
    derived = {d.key: d.model_name for d in info.derived}
    contexts: dict[str, int] = {}

    def name(key: str) -> str:
        row = info.entries.row(key)
        if row >= 0:
            return info.entries.profile(row).model_name
        if key in derived:
            return derived[key]
        if not contexts:
            contexts.update((k, i) for i, k in enumerate(info.contexts.keys))
        i = contexts.get(key)
        return "?" if i is None else info.contexts.about(i)[1]

    return name
