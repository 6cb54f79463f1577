"""The complete stage: compute what the load did not find, and hand it to the writer.

After :func:`kvstore.model.stages.load.load`, each distinct context of a
:class:`~kvstore.model.plan.batch.BatchPlan` is whole, partly stored or missing. :func:`complete`
computes a missing one by a prefill and the rest of a partly stored one on top of its prefix
(:func:`kvstore.model.compute.forward.extend`), writes it into its row and hands the new chunks and
the context record to the writer; then zeroes every pad slot (masked, but ``0 * NaN`` would still
poison) and copies each context into the other rows that share it. With a lossy codec the computed
chunks are encoded first and the values they decode to go into the buffers, so an answer computed
now is the answer every later run loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import BatchCache, Buffers, LayerKV
from kvstore.model.compute.forward import extend, prefill
from kvstore.model.io.chains import Chain, chunk_entries
from kvstore.model.io.staging import Staging
from kvstore.model.plan.batch import BatchPlan
from kvstore.model.stages.load import Loaded
from kvstore.store.entry import decode_entry
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.io.writer import Writer


@dataclass(frozen=True)
class Completed:
    """A batch's contexts, whole in its buffers: the :class:`BatchCache` (row ``r``'s context in
    slots ``P - c_r .. P``; None when the plan needs no dense cache: every row reads stored pressed
    entries), context tokens loaded per distinct key, context tokens computed, and per row the codec
    spec(s) its context came from or was stored with (None without a store)."""

    cache: BatchCache | None
    tokens_loaded: Mapping[str, int]
    computed: int
    codecs: tuple[str | None, ...]


@torch.inference_mode()
def complete(
    handle: ModelHandle, plan: BatchPlan, loaded: Loaded, store: KVStore | None, writer: Writer | None
) -> Completed:
    """Compute and store what ``loaded`` lacks of the contexts the plan needs densely (see the
    module docstring)."""
    P = plan.context_slots
    bufs = loaded.bufs
    got = dict(loaded.tokens)
    specs = {k: list(v) for k, v in loaded.codecs.items()}
    if not plan.dense:
        return Completed(None, got, 0, tuple(codec_label(specs[p.key]) for p in plan.contexts))
    heads = {k: rows[0] for k, rows in plan.distinct.items() if k in plan.dense}
    missing = [k for k in heads if got[k] == 0]
    if missing:
        for k, layers in zip(missing, prefill(handle, [plan.contexts[heads[k]].ids for k in missing])):
            _place(handle, _Target(plan.contexts[heads[k]], bufs, heads[k], P), layers, 0, store, writer)
            if store is not None:
                specs[k].append(store.codec.spec)
    partial = [k for k in heads if 0 < got[k] < plan.contexts[heads[k]].n_tokens]
    if partial:
        prefixes = []
        for k in partial:
            r0, c = heads[k], plan.contexts[heads[k]].n_tokens
            prefixes.append(
                tuple((kb[r0, :, P - c : P - c + got[k]], vb[r0, :, P - c : P - c + got[k]]) for kb, vb in bufs)
            )
        rests = extend(handle, prefixes, [plan.contexts[heads[k]].ids[got[k] :] for k in partial])
        for k, layers in zip(partial, rests):
            ctx = plan.contexts[heads[k]]
            _place(handle, _Target(ctx, bufs, heads[k], P), layers, ctx.depth_of(got[k]), store, writer)
            assert store is not None
            specs[k].append(store.codec.spec)
    lengths = tuple(p.n_tokens for p in plan.contexts)
    _fill_pads_and_repeats(bufs, plan.distinct, lengths, P, plan.dense)
    computed = sum(plan.contexts[r0].n_tokens - got[k] for k, r0 in heads.items())
    labels = tuple(codec_label(specs[p.key]) for p in plan.contexts)
    cache = BatchCache(bufs, tuple((P - c, P) for c in lengths), lengths, P, tuple(p.ids for p in plan.contexts))
    return Completed(cache, got, computed, labels)


@dataclass(frozen=True)
class _Target:
    """Where a computed context goes: its chain, and the batch row and buffers it fills (context
    position ``p`` at slot ``P - c + p``)."""

    chain: Chain
    bufs: Buffers
    row: int
    P: int

    @property
    def slot0(self) -> int:
        return self.P - self.chain.n_tokens


def _place(
    handle: ModelHandle, target: _Target, layers: LayerKV, depth: int, store: KVStore | None, writer: Writer | None
) -> None:
    """Chunks ``depth..`` of a computed context (``layers``: its positions from that chunk on) into
    its row, and to the writer (chunks, then the context record)."""
    start = target.chain.spans[depth][0] if depth else 0
    if store is not None and not store.codec.lossless:
        store_and_reload(handle, store, target, layers, depth, writer)
        return
    a = target.slot0 + start
    for (kb, vb), (kl, vl) in zip(target.bufs, layers):
        kb[target.row, :, a : target.P].copy_(kl)
        vb[target.row, :, a : target.P].copy_(vl)
    if writer is not None:
        writer.put_chunks(handle, target.chain, layers, depth, start)


def store_and_reload(
    handle: ModelHandle, store: KVStore, target: _Target, layers: LayerKV, depth: int, writer: Writer | None
) -> None:
    """For a lossy codec: encode chunks ``depth..`` of the target's context (``layers`` holding the
    positions from the chunk at ``depth`` on) with the store's codec, hand the bytes to ``writer``
    (then the context record), and copy the values they decode to into the target's row. The answer
    then comes from exactly what a later run loads, whether or not the store can be written."""
    chain = target.chain
    offset = chain.spans[depth][0]
    # decoded as a load decodes them (on the buffers' device where the codec can), so that a later
    # run's answer is this one's
    staging = Staging(target.bufs[0][0].device, force=handle.force_staging)
    for i, entry in enumerate(chunk_entries(handle, chain, layers, depth, offset)):
        blob = store.encode(entry)
        view = decode_entry(blob, key=entry.key)
        h = view.header
        a, b = target.slot0 + h.start, target.slot0 + h.end
        for (kb, vb), kv in zip(target.bufs, view.layers):
            assert kv is not None
            staging.copy_into(kv[0], kb[target.row, :, a:b])
            staging.copy_into(kv[1], vb[target.row, :, a:b])
        staging.finish()  # release the host tensors chunk by chunk
        if writer is not None:
            writer.put_encoded(entry, blob, overwrite=i == 0)
    if writer is not None:
        writer.put_context(chain)


def codec_label(specs: Sequence[str]) -> str | None:
    """The codec spec of the entries a row's context came from (their distinct specs joined by
    ``,`` when its chunks differ; None without a store)."""
    return ",".join(dict.fromkeys(specs)) or None


def _fill_pads_and_repeats(
    bufs: Buffers, distinct: Mapping[str, Sequence[int]], lengths: Sequence[int], P: int, dense: frozenset[str]
) -> None:
    """Zero each row's pad slots (masked, but ``0 * NaN`` would still poison) and copy a context
    loaded once into the other rows that share it; rows whose context is not needed are zeros."""
    for key, rs in distinct.items():
        r0, c = rs[0], lengths[rs[0]]
        if key not in dense:
            c = 0
        for kb, vb in bufs:
            kb[r0, :, : P - c].zero_()
            vb[r0, :, : P - c].zero_()
            for r in rs[1:]:
                kb[r, :, :P].copy_(kb[r0, :, :P])
                vb[r, :, :P].copy_(vb[r0, :, :P])


__all__ = ["Completed", "codec_label", "complete", "store_and_reload"]
