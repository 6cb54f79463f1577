"""The load stage: a batch's stored context prefixes, copied straight into its KV buffers.

:func:`load` allocates the buffers a :class:`~kvstore.model.plan.batch.BatchPlan` asks for and,
for each distinct context whose dense cache the plan needs (``plan.dense``), copies the chunks the
plan expects stored (``plan.stored``) into its first row, context position ``p`` at slot ``P - c +
p`` (left-padded). Every chunk is checked against its chain (:func:`kvstore.model.io.chains.fits`)
and its checksum before any byte reaches the buffers; a missing, corrupt or foreign chunk ends the
prefix there (a corrupt one warns): ``Loaded.tokens`` says how much it found, and the complete stage
computes the rest. Chunks the writer still held when the batch was planned are
waited for first. ``sample`` runs it for the next batch on a worker thread while the current batch
decodes. A batch that needs no dense cache (every row read from a pressed entry) allocates nothing.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstore.errors import CorruptEntryError, CorruptEntryWarning
from kvstore.model.compute.cache import Buffers, new_buffers
from kvstore.model.io import device_zstd
from kvstore.model.io.chains import Chain, fits
from kvstore.model.io.ring import Ring
from kvstore.model.io.staging import Staging
from kvstore.model.plan.batch import BatchPlan
from kvstore.parallel import run_all
from kvstore.store import fused
from kvstore.store.codecs import StoredTensor, spec_of
from kvstore.store.entry import EntryView
from kvstore.store.frame import verify_checksum
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.io.writer import Writer


@dataclass(frozen=True)
class Loaded:
    """What :func:`load` found: the batch's KV buffers (each needed context's stored prefix in its
    first row; empty when no context is needed densely), context tokens loaded per distinct key (less
    than :meth:`BatchPlan.load_tokens` where a planned chunk went missing or turned out corrupt), and
    the codec spec of each chunk loaded."""

    bufs: Buffers
    tokens: Mapping[str, int]
    codecs: Mapping[str, tuple[str, ...]]


@torch.inference_mode()
def load(handle: ModelHandle, plan: BatchPlan, store: KVStore | None, writer: Writer | None = None) -> Loaded:
    """Allocate ``plan``'s buffers and load each distinct context's stored prefix (see the module
    docstring). Without a store nothing is loaded."""
    loaded: dict[str, int] = dict.fromkeys(plan.distinct, 0)
    codecs: dict[str, tuple[str, ...]] = {k: () for k in plan.distinct}
    if not plan.dense:
        return Loaded([], loaded, codecs)
    if writer is not None and plan.unwritten:
        writer.wait_for(plan.unwritten)  # chunks computed by an earlier batch: load them, do not recompute
    dev = handle.device
    bufs = new_buffers(handle.kv_shapes(), len(plan.rows), plan.slots, handle.dtype, dev)
    P = plan.context_slots
    # accelerator buffers: the handle's ring of pinned slots, one copy per chunk on a side stream
    force = handle.force_staging
    ring = Ring.of(handle, dev, force=force) if dev.type == "cuda" or force else None
    decoder = device_zstd.decoder_for(dev, ring.stream) if ring is not None else None  # zstd frames decoded there
    staging = Staging(dev, force=force, ring=ring, decoder=decoder)
    try:
        for key, rows in plan.distinct.items():
            if key not in plan.dense:
                continue
            ctx = plan.contexts[rows[0]]
            found: list[str] = []
            if store is not None:  # the plan's chunks, each checked
                depth = plan.stored.get(key, 0)
                loaded[key] = load_prefix(
                    handle, store, ctx.upto(depth), bufs, rows[0], P - ctx.n_tokens, found, staging
                )
            codecs[key] = tuple(found)
    finally:  # also on an error (out of memory): copies still in flight are ordered before what comes next
        staging.finish()
    return Loaded(bufs, loaded, codecs)


def load_prefix(
    handle: ModelHandle, store: KVStore, chain: Chain, bufs: Buffers, row: int, slot0: int,
    codecs: list[str] | None = None, staging: Staging | None = None,
) -> int:  # fmt: skip
    """Copy the longest verified stored prefix of ``chain`` (of the chunks it lists: a chain cut
    with :meth:`~kvstore.model.io.chains.Chain.upto` reads no further) into batch row ``row`` of
    ``bufs``, context position ``p`` at slot ``slot0 + p``. Falls back to a format-1 entry holding
    exactly this (lossless) context. Returns how many context tokens were loaded (0: nothing); the
    codec spec of each chunk loaded is appended to ``codecs``. With ``staging`` (accelerator
    buffers), records go through its pinned host tensors and asynchronous copies: call its
    ``finish()`` before using ``bufs``."""
    loaded = 0
    # checksums verified while the chunks are copied (kvstore.store.fused): one pass over memory
    with store.open_chain(chain.keys, lazy=True, defer=True) as views:
        fitting = []
        for j, view in enumerate(views):
            try:
                if not fits(handle, view, chain, j):
                    if view.unverified is not None:  # a flipped byte may be why: a corrupt chunk warns
                        verify_checksum(view.unverified)
                    break
            except CorruptEntryError as exc:  # a lazily decoded record that does not decode
                _warn_corrupt(chain.keys[j], exc)
                break
            fitting.append(view)
        # every tensor of every chunk into place, decompressed and copied on a few threads
        good, err = _copy_chunks(fitting, bufs, row, slot0, staging, store.codec.decode_threads())
        if err is not None:
            if not isinstance(err, CorruptEntryError):
                raise err
            _warn_corrupt(chain.keys[good], err)
        if good:
            loaded = fitting[good - 1].header.end
        if codecs is not None:
            codecs += [spec_of(view.header.codec) for view in fitting[:good]]
    if loaded == 0 and not chain.lossy and store.contains(chain.v1_key):
        with store.open_entry(chain.v1_key) as v1:
            one_chunk = Chain(chain.ids, ((0, chain.n_tokens),), (chain.v1_key,), chain.v1_key)
            if v1 is not None and v1.header.format == 1 and fits(handle, v1, one_chunk, 0):
                for (kb, vb), (k, v) in zip(bufs, v1.layers):  # type: ignore[misc]
                    k.copy_into(kb[row, :, slot0 : slot0 + chain.n_tokens])
                    v.copy_into(vb[row, :, slot0 : slot0 + chain.n_tokens])
                loaded = chain.n_tokens
                if codecs is not None:
                    codecs.append(spec_of(v1.header.codec))
    return loaded


def _copy_chunks(
    fitting: Sequence[EntryView], bufs: Buffers, row: int, slot0: int, staging: Staging | None, threads: int
) -> tuple[int, BaseException | None]:
    """Copy every stored key and value tensor of the ``fitting`` chunks into row ``row``: straight
    into place (in the order they lie in the store), or through an active ``staging`` (one ring slot
    and one device copy per chunk). Returns ``(chunks copied whole, the error of the first chunk
    that failed, or None)``: that chunk and the later ones do not count as loaded."""
    per_chunk: list[list[tuple[StoredTensor, torch.Tensor]]] = []
    frames = [view.unverified for view in fitting]
    rows = [(kb[row], vb[row]) for kb, vb in bufs]  # row ``row`` once, each chunk's span of it below
    for view in fitting:
        h = view.header
        pairs: list[tuple[StoredTensor, torch.Tensor]] = []
        for (kr, vr), kv, spec in zip(rows, view.layers, h.layers):
            if kv is not None:
                lo, hi = slot0 + h.end - spec.length, slot0 + h.end
                pairs += [(kv[0], kr[:, lo:hi]), (kv[1], vr[:, lo:hi])]
        per_chunk.append(pairs)
    if staging is not None and staging.active:
        return staging.load_chunks(per_chunk, threads, frames)
    failed = _copy_direct(per_chunk, frames, threads)
    if not failed:
        return len(fitting), None
    for _, err in failed:  # anything but a corrupt record is the caller's error
        if not isinstance(err, CorruptEntryError):
            return min(j for j, _ in failed), err
    return min(failed, key=lambda f: f[0])


def _copy_direct(
    per_chunk: Sequence[Sequence[tuple[StoredTensor, torch.Tensor]]], frames: Sequence[Any], threads: int
) -> list[tuple[int, BaseException]]:
    """Copy each chunk's ``(record, dest)`` pairs straight into place, its checksum (``frames``:
    each chunk's unverified frame, or None) computed while its records are copied, or, for a chunk
    whose bytes the copies do not all read from the frame, verified before any is copied. Returns
    ``(chunk, error)`` of every failure (a chunk that failed may have written some of its places)."""
    works: list[fused.ChunkWork | None] = []
    first: list[tuple[int, Any]] = []  # chunks verified before their records are copied
    for j, (pairs, frame) in enumerate(zip(per_chunk, frames)):
        fns = [functools.partial(_copy_into, rec, dest) for rec, dest in pairs]
        work = fused.records_work(frame, pairs, fns)
        if work is None and frame is not None:
            first.append((j, frame))
        works.append(work)
    verified = run_all([functools.partial(verify_checksum, f) for _, f in first], threads)
    failed = [(j, e) for (j, _), e in zip(first, verified) if e is not None]
    bad = {j for j, _ in failed}
    plain = [(j, fn) for j, (pairs, w) in enumerate(zip(per_chunk, works)) if w is None and j not in bad
             for fn in (functools.partial(_copy_into, rec, dest) for rec, dest in pairs)]  # fmt: skip
    failed += [(j, e) for (j, _), e in zip(plain, run_all([fn for _, fn in plain], threads)) if e is not None]
    fed = [(j, w) for j, w in enumerate(works) if w is not None]
    for (j, work), err in zip(fed, fused.run([w for _, w in fed], threads)):
        if (err := err or _check(work)) is not None:
            failed.append((j, err))
    return failed


def _copy_into(record, dest) -> None:
    record.copy_into(dest)


def _check(work: fused.ChunkWork) -> CorruptEntryError | None:
    try:
        work.check()
    except CorruptEntryError as exc:
        return exc
    return None


def _warn_corrupt(key: str, exc: Exception) -> None:
    warnings.warn(
        f"kvstore: entry {key[:16]} is corrupt ({exc}); treating it as a miss", CorruptEntryWarning, stacklevel=3
    )


__all__ = ["Loaded", "load", "load_prefix"]
