"""Export a store's contexts as plain safetensors files other tools can read.

One file per complete context, ``<DIR>/<context key>.safetensors``, uncompressed, loadable with
``safetensors.torch.load_file``:

* ``layers.{i}.keys`` / ``layers.{i}.values`` ``[kv_heads, tokens, head_dim]`` in the model's
  dtype (lossy entries dequantized);
* ``layers.{i}.positions`` ``[tokens]`` int64, only for a layer that keeps fewer than all of the
  context's tokens (a sliding window): the context position of each kept token;
* ``layers.{i}.state.{name}``: a recurrent layer's state at the context's end;
* ``token_ids`` ``[n_tokens]`` int64.

The safetensors metadata holds the context key, model fingerprint and name, dtype, tokens, the
codec it was stored with, its chunk keys and the numerics it was computed with.

Each derived entry (:mod:`kvstore.store.owned`), verified, becomes
``<DIR>/<context key>.<kind>.<derived key>.safetensors``:

* scores: ``layers.{i}.scores`` ``[kv_heads, tokens]`` as stored (float32 or float64);
* a pressed cache: ``layers.{i}.heads.{h}.keys`` / ``.values`` ``[kept, head_dim]`` in the model's
  dtype (dequantized) and ``layers.{i}.heads.{h}.positions`` ``[kept]`` int64, for every head that
  keeps a token;

with the context and derived keys, kind, spec, model, dtype, tokens, codec and the ``press`` record
(JSON) in the metadata. A file that already exists is skipped, so an interrupted export resumes.

An entry this kvstore cannot read (a newer format, a kind this process does not know) is not
exported: it is listed in the report's ``unknown`` (a context using such a chunk, by its key; such a
derived entry, by its own), and ``kvstore export`` exits 1 after the others.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore.errors import KVStoreError
from kvstore.progress import Progress
from kvstore.store.kinds import kind_of
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import ANY_OWNED


@dataclass
class ExportReport:
    written: int = 0
    skipped: int = 0  # already exported
    incomplete: list[str] = field(default_factory=list)  # contexts with a missing or corrupt chunk
    bytes: int = 0
    owned: int = 0  # derived entries written
    owned_bad: list[str] = field(default_factory=list)  # derived entries that did not verify (not written)
    unknown: list[str] = field(default_factory=list)  # a newer format or an unknown kind (not written)
    derived = property(lambda self: self.owned, doc="Deprecated: ``owned``.")
    derived_bad = property(lambda self: self.owned_bad, doc="Deprecated: ``owned_bad``.")


def export_context(store: KVStore, chunks: tuple[str, ...], path: Path) -> int | None:
    """Write one context (its chain ``chunks``) to ``path``; returns its size in bytes, or None
    when a chunk is missing, corrupt or does not continue the chain."""
    first = store.header(chunks[0])
    if first is not None and first.format == 1:  # a format-1 entry: a whole context of its own
        with store.open_entry(chunks[0]) as view:
            return None if view is None else _write([view], chunks, path)
    with store.open_chain(chunks) as views:
        return _write(views, chunks, path) if len(views) == len(chunks) else None


def _write(views, chunks: tuple[str, ...], path: Path) -> int:
    first, last = views[0].header, views[-1].header
    tensors: dict[str, torch.Tensor] = {}
    for i in range(len(first.layers)):
        keys, values, positions = [], [], []
        for view in views:
            kv = view.layers[i]
            if kv is None:
                continue
            h = view.header
            keys.append(kv[0].materialize())
            values.append(kv[1].materialize())
            positions.append(torch.arange(h.end - h.layers[i].length, h.end))
        if keys:
            tensors[f"layers.{i}.keys"] = torch.cat(keys, 1)
            tensors[f"layers.{i}.values"] = torch.cat(values, 1)
            pos = torch.cat(positions)
            if pos.numel() != last.end:
                tensors[f"layers.{i}.positions"] = pos
        for name, rec in (views[-1].states[i] or {}).items():
            tensors[f"layers.{i}.state.{name}"] = rec.materialize()
    tensors["token_ids"] = torch.cat([v.records["token_ids"].materialize() for v in views])
    metadata = {
        "key": chunks[-1],
        "model": first.model,
        "model_name": first.model_name,
        "dtype": first.dtype,
        "n_tokens": str(last.end),
        "codec": first.codec_spec,
        "chunks": json.dumps(list(chunks)),
        "numerics": json.dumps(dict(first.numerics)),
        "format": str(first.format),
    }
    return _save(tensors, metadata, path)


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> int:
    """Write one safetensors file whole or not at all; returns its size."""
    from safetensors.torch import save_file

    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
            os.replace(tmp, path)  # whole or absent
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise _cannot_write(path.parent, exc) from None
    return path.stat().st_size


def export_owned(store: KVStore, context: str, key: str, path: Path) -> int | None:
    """Write the entry ``key`` that ``context`` owns (a derived entry, any kind) to ``path`` (see
    the module docstring); returns its size, or None when it is missing or does not verify (a
    warning says why)."""
    with store.open(ANY_OWNED, key, context) as view:
        if view is None:
            return None
        h = view.header
        tensors = kind_of(h.kind).export_tensors(view)
        metadata = {
            "context": h.context, "key": h.key, "kind": h.kind, "spec": h.spec, "model": h.model,
            "model_name": h.model_name, "dtype": h.dtype, "n_tokens": str(h.n_tokens), "codec": h.codec_spec,
            "press": json.dumps(dict(h.press), sort_keys=True), "numerics": json.dumps(dict(h.numerics)),
            "format": str(h.format),
        }  # fmt: skip
    return _save(tensors, metadata, path)


def _cannot_write(directory: Path, exc: OSError) -> KVStoreError:
    """One line for a directory an export cannot write into (the store is only read)."""
    why = exc.strerror or str(exc)
    return KVStoreError(
        f"cannot export into {directory}: {why}; give a directory you can write to (the store is unchanged, and "
        "files already exported there are kept)"
    )


def export_store(
    store: KVStore, directory: str | os.PathLike, *, model: str | None = None, progress: Progress | None = None
) -> ExportReport:
    """Export every complete context and every derived entry of ``store`` (of ``model``: a name or
    fingerprint prefix) into ``directory`` (created if absent). See the module docstring. Raises KVStoreError (one
    line) when ``directory`` cannot be created or written."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cannot_write(out, exc) from None
    report = ExportReport()
    info = store.scan()
    newer = info.unknown_chunks
    report.unknown += [u.key for u in info.unknown if u.context]  # no model to filter by: its header is unread
    for c in info.contexts:
        if not c.matches_model(model):
            continue
        if not c.chunks:  # stored only as pressed caches: those are exported below
            continue
        path = out / f"{c.key}.safetensors"
        if path.exists():
            report.skipped += 1
        elif newer.intersection(c.chunks):
            report.unknown.append(c.key)
        elif not c.complete:
            report.incomplete.append(c.key)
        else:
            size = export_context(store, c.chunks, path)
            if size is None:
                report.incomplete.append(c.key)
            else:
                report.written += 1
                report.bytes += size
        if progress:
            progress(1, 0)
    for d in info.owned:
        if not d.matches_model(model):
            continue
        path = out / f"{d.context}.{d.kind}.{d.key}.safetensors"
        if path.exists():
            report.skipped += 1
            continue
        size = export_owned(store, d.context, d.key, path)
        if size is None:
            report.owned_bad.append(d.key)
        else:
            report.owned += 1
            report.bytes += size
    return report


__all__ = ["ExportReport", "export_context", "export_owned", "export_store"]
