"""Import KV caches written by the llminference research code (the notebook kvstore replaces).

That code saved one file per context, ``<CACHE_DIR>/<name>.pt``: ``torch.save`` of one tensor
``(layers, 2, 1, kv_heads, tokens, head_dim)`` (keys and values of every layer, batch of one). The
name is the MD5 hex digest of the model config's JSON (``config.to_json_string(use_diff=False)``,
as transformers 4 wrote it: pass that text with ``config_json``), then the context text (UTF-8),
then the context token limit as a u32 little-endian; the context was tokenized with the tokenizer's
special tokens and cut from the left to that limit.

This module holds the one place kvstore reads a pickle-based file: ``torch.load`` with
``weights_only=True`` (tensors only, no code) on the CPU; nothing else in kvstore loads pickles,
and the source scan in ``tests/reliability/test_reliability.py`` names this exception (and the
``pickletools`` opcode walk that names what a refused file would have called: it imports nothing). Imported contexts are
spot-checked by recomputing a few of them before anything is stored, then stored as chains like
any other context (keyed as plain, template-free contexts: sample them with ``--no-chat`` and a
template whose context part is the context itself, such as the default one).
"""

from __future__ import annotations

import hashlib
import os
import pickletools  # reads a pickle's opcodes, never unpickles: to say what a refused file would call
import struct
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from kvstore.errors import KVStoreError
from kvstore.progress import Progress
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.adapter import Adapter

SPOT_CHECK_ATOL = {torch.float64: 1e-8, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 2e-1}


@dataclass
class ImportReport:
    imported: int = 0
    already_stored: int = 0
    missing: list[str] = field(default_factory=list)  # contexts with no file
    unmatched: list[str] = field(default_factory=list)  # files that match no context
    rejected: list[str] = field(default_factory=list)  # "file: why"
    checked: int = 0
    max_abs_diff: float = 0.0  # largest difference of a spot-checked file from recomputing it


def cache_name(config_json: str, context: str, limit: int) -> str:
    """The file name (without ``.pt``) llminference gave a context's cache."""
    h = hashlib.md5()  # noqa: S324 - their naming, not a security boundary
    h.update(config_json.encode())
    h.update(context.encode())
    h.update(struct.pack("<L", limit))
    return h.hexdigest()


def _load(path: Path) -> torch.Tensor:
    """The one tensor in ``path``. Raises ValueError with a one-line reason for any file that is not
    one: not a tensor archive, truncated, a pickle of something else, or a pickle that would run code
    (refused by ``weights_only`` before anything runs; the reason names what it would have called,
    read from the pickle itself, never torch's advice to load it without ``weights_only``)."""
    try:
        with warnings.catch_warnings():  # torch's remarks on a foreign pickle: the rejection line says enough
            warnings.simplefilter("ignore")
            value = torch.load(path, map_location="cpu", weights_only=True)  # the one pickle reader in kvstore
    except Exception as exc:  # noqa: BLE001 - any failure to read one file rejects that file only
        raise ValueError(_unreadable(path, exc)) from None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"holds a {type(value).__name__}, not a tensor")
    return value


def _unreadable(path: Path, exc: Exception) -> str:
    """Why ``path`` could not be read, in one line, from the file's own pickle where it has one (what
    it would call), never from torch's message about loading it without ``weights_only``."""
    calls = pickle_globals(path)
    foreign = [c for c in calls or () if not c.startswith(SAFE_GLOBAL_PREFIXES)]
    if foreign:
        return (
            f"is not a plain tensor file (refused: its pickle would call {', '.join(foreign[:3])}, which could run "
            "code; nothing ran)"
        )
    if type(exc).__name__ == "UnpicklingError":  # the tensors-only reader refused it, or it is no pickle
        if calls is None:
            return "is not a readable tensor file (neither a torch archive nor a pickle)"
        return "is not a plain tensor file (a pickle torch's tensors-only reader refuses; nothing ran)"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"is not a readable tensor file ({type(exc).__name__}: {(lines[0] if lines else 'no reason given')[:160]})"


# what a plain tensor file's pickle imports: torch's rebuild functions and storages, and the ordered dict
SAFE_GLOBAL_PREFIXES = ("torch.", "collections.OrderedDict")
_STRING_OPS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"}


def pickle_globals(path: Path) -> list[str] | None:
    """The globals (``module.name``) the pickle in ``path`` imports, in order and each once: the
    pickle inside a torch archive (``*/data.pkl``), else the file's own pickles in turn (torch's
    legacy format writes several, then raw bytes). None when no pickle could be read at all. Reads
    the opcodes only (:func:`pickletools.genops`); nothing is imported or run."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                members = [n for n in archive.namelist() if n.endswith("data.pkl")]
                if not members:
                    return None
                with archive.open(members[0]) as f:
                    return _globals_of(f, archive.getinfo(members[0]).file_size)
        with open(path, "rb") as f:
            return _globals_of(f, path.stat().st_size)
    except (OSError, zipfile.BadZipFile):
        return None


def _globals_of(f: IO[bytes], size: int) -> list[str] | None:
    found: dict[str, None] = {}
    parsed = False
    while True:
        strings: list[Any] = []
        memo: dict[Any, Any] = {}
        try:
            for op, arg, _ in pickletools.genops(f):
                if op.name in _STRING_OPS:
                    strings.append(arg)
                elif op.name in ("GLOBAL", "INST"):
                    found[".".join(str(arg).split(" ", 1))] = None
                elif op.name == "STACK_GLOBAL":
                    found[".".join(str(x) for x in strings[-2:])] = None
                elif op.name == "MEMOIZE" and strings:
                    memo[len(memo)] = strings[-1]
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT") and strings:
                    memo[arg] = strings[-1]
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    strings.append(memo.get(arg))
        except Exception:  # noqa: BLE001 - the end of the pickles (raw bytes follow, or not a pickle at all)
            return list(found) if parsed else None
        parsed = True
        if f.tell() >= size:
            return list(found)


def import_caches(
    adapter: Adapter,
    cache_dir: str | os.PathLike,
    contexts: Sequence[str],
    store: KVStore,
    *,
    max_context_length: int,
    config_json: str | None = None,
    check: int = 3,
    progress: Progress | None = None,
) -> ImportReport:
    """Store the llminference caches of ``contexts`` found in ``cache_dir`` (see the module
    docstring). ``check`` contexts are recomputed first and must match (else nothing is stored and
    a KVStoreError says so: wrong model, config text, limit or dtype)."""
    directory = Path(cache_dir)
    if not directory.is_dir():
        raise KVStoreError(f"{directory} is not a directory of llminference caches")
    config_json = config_json if config_json is not None else adapter.model.config.to_json_string(use_diff=False)
    report = ImportReport()
    found = _found(directory, contexts, config_json, max_context_length, report)
    jobs = _read(adapter, found, max_context_length, report)
    _spot_check(adapter, jobs[: max(0, check)], report)
    _write(adapter, store, jobs, report, progress)
    return report


def _found(
    directory: Path, contexts: Sequence[str], config_json: str, max_context_length: int, report: ImportReport
) -> list[tuple[str, Path]]:
    """The cache file of each distinct context found in ``directory``; the contexts missing and the
    files no context named go to ``report``."""
    files = {p.stem: p for p in directory.glob("*.pt")}
    found: list[tuple[str, Path]] = []
    for text in dict.fromkeys(contexts):
        name = cache_name(config_json, text, max_context_length)
        if name in files:
            found.append((text, files.pop(name)))
        else:
            report.missing.append(text[:60])
    report.unmatched = sorted(p.name for p in files.values())
    return found


def _read(
    adapter: Adapter, found: Sequence[tuple[str, Path]], max_context_length: int, report: ImportReport
) -> list[tuple[list[int], torch.Tensor]]:
    """``(context ids, cache tensor)`` of each file whose shape and dtype are this model's; the
    others are rejected in ``report`` (that file only: the others are still imported)."""
    shapes = adapter.kv_shapes()
    jobs = []
    for text, path in found:
        ids = adapter.encode_context(text)
        ids = ids[len(ids) - max_context_length :] if len(ids) > max_context_length else ids
        try:
            t = _load(path)
            want = (len(shapes), 2, 1, shapes[0][0], len(ids), shapes[0][1])
            if tuple(t.shape) != want:
                raise ValueError(f"is {tuple(t.shape)}, this model's context would be {want}")
            if t.dtype != adapter.dtype:
                raise ValueError(f"holds {t.dtype}, the model runs in {adapter.dtype}; import with --dtype to match")
        except (OSError, ValueError) as exc:
            report.rejected.append(f"{path.name}: {exc}")
            continue
        jobs.append((ids, t))
    return jobs


def _spot_check(adapter: Adapter, jobs: Sequence[tuple[list[int], torch.Tensor]], report: ImportReport) -> None:
    """Recompute ``jobs``' contexts and compare; KVStoreError (nothing stored) past the tolerance."""
    for ids, t in jobs:
        fresh = adapter.prefill([ids])[0]
        diff = max(float((t[i, j, 0] - kv).abs().max()) for i, layer in enumerate(fresh) for j, kv in enumerate(layer))
        report.checked += 1
        report.max_abs_diff = max(report.max_abs_diff, diff)
    tolerance = SPOT_CHECK_ATOL.get(adapter.dtype, 1e-3)
    if report.max_abs_diff > tolerance:
        raise KVStoreError(
            f"the llminference caches do not match this model: recomputing {report.checked} context(s) differs by up "
            f"to {report.max_abs_diff:.3g} (> {tolerance:g}); check --model, --dtype, --config-json and "
            "--max-context-length; nothing was stored"
        )


def _write(
    adapter: Adapter, store: KVStore, jobs: Sequence[tuple[list[int], torch.Tensor]], report: ImportReport,
    progress: Progress | None,
) -> None:  # fmt: skip
    """Each context not stored whole yet written as a chain (chunks, then its record)."""
    from kvstore.model.io.writer import Writer

    writer = Writer(store)
    try:
        written = {}
        for ids, t in jobs:
            plan = adapter.chain(ids, store)
            if store.context(plan.key) is not None and store.stored_prefix(plan.keys) == len(plan.keys):
                report.already_stored += 1
            else:
                written[plan.key] = (plan, tuple((layer[0, 0], layer[1, 0]) for layer in t))
                writer.put_chunks(adapter.handle, plan, written[plan.key][1])
                report.imported += 1
            if progress:
                progress(1, len(ids))
        for _ in range(3):  # chunks a concurrent gc took while their records were written: put them again
            writer.flush()
            lost, writer.lost = writer.lost, []
            for key in dict.fromkeys(lost):
                writer.put_chunks(adapter.handle, *written[key])
    finally:
        writer.close()


__all__ = ["ImportReport", "cache_name", "import_caches"]
