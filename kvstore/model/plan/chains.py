"""Contexts as chains of chunks: planning their keys, loading stored prefixes, computing the rest.

A context's :class:`ContextPlan` lists its chunks (spans of ``chunk_tokens`` tokens, restarting at
an explicit boundary such as the end of a prompt's fixed head) and their keys, seeded by the
model's identity and numerics and the store's lossy codec (``kvstore.store.keys``). Loading copies
the longest verified stored prefix of the chain straight into the batch buffers; computing the rest
runs only the missing tokens on top of that prefix (:func:`extend`), in the same left-padded
layout with explicit positions as decoding, so rows of one batch may hit at different depths.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.errors import CorruptEntryError, CorruptEntryWarning
from kvstore.model.compute.cache import Buffers, LayerKV, PreallocatedCache, new_buffers
from kvstore.model.compute.staging import Staging
from kvstore.parallel import run_all
from kvstore.store.codecs import StoredTensor, identity_of, spec_of
from kvstore.store.entry import Entry, EntryView, decode_entry
from kvstore.store.keys import DEFAULT_CHUNK_TOKENS, cache_key, chain_keys, chunk_key, chunk_spans
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.compute.writer import Writer
    from kvstore.model.handle import ModelHandle


@dataclass(frozen=True)
class ContextPlan:
    """One tokenized context as a chain: ``spans[i]`` are chunk ``i``'s positions, ``keys[i]``
    its key. ``key`` (the last chunk's) names the context; ``v1_key`` is the format-1 key of the
    whole context, under which a phase-1 store may hold it. ``lossy``: the lossy codec the chain
    is stored with (its quantizer spec, part of the keys), ``""`` for lossless."""

    ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    keys: tuple[str, ...]
    v1_key: str
    lossy: str = ""

    @property
    def key(self) -> str:
        return self.keys[-1]

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def depth_of(self, n_tokens: int) -> int:
        """How many whole chunks ``n_tokens`` leading tokens cover."""
        return sum(1 for _, end in self.spans if end <= n_tokens)


def plan(
    adapter: ModelHandle, ids: Sequence[int], *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, lossy: str = "",
    boundaries: Sequence[int] = (), store: KVStore | None = None,
) -> ContextPlan:  # fmt: skip
    """The chain of a tokenized context for this adapter's model, dtype and numerics. With a
    ``store`` whose lookups are local (LMDB, memory), a stored shorter context that ends inside
    one of this chain's chunks adds a boundary there (:func:`stored_tails`), so its last, partial
    chunk is reused too."""
    seed = adapter.chain_seed(lossy)
    cuts = list(boundaries)
    if store is not None and store.backend.local:
        cuts = stored_tails(seed, ids, chunk_tokens, cuts, store)
    spans = chunk_spans(len(ids), chunk_tokens, cuts)
    return ContextPlan(
        tuple(ids),
        tuple(spans),
        tuple(chain_keys(seed, ids, spans)),
        cache_key(adapter.fingerprint, adapter.dtype, ids),
        lossy,
    )


def stored_tails(seed: str, ids: Sequence[int], chunk_tokens: int, cuts: list[int], store: KVStore) -> list[int]:
    """``cuts`` plus the ends of stored partial chunks this chain can continue: walk the chain
    while its chunks are stored; at the first one that is not, look for a stored chunk with the
    same parent holding a strict prefix of its tokens (the last chunk of a shorter context, e.g.
    the first half of this document), the longest first; if there is one, cut there and walk on.

    The canonical chain (no such cuts) is kept wherever it is stored, so a context stored before
    a shorter one still hits whole; each probe is up to ``chunk_tokens - 1`` local lookups."""
    cuts = list(cuts)
    while True:
        spans = chunk_spans(len(ids), chunk_tokens, cuts)
        keys = chain_keys(seed, ids, spans)
        j = next((j for j, k in enumerate(keys) if not store.contains(k)), None)
        if j is None:
            return cuts
        s, e = spans[j]
        parent = keys[j - 1] if j else seed
        m = next((m for m in range(e - s - 1, 0, -1) if store.contains(chunk_key(parent, ids[s : s + m]))), 0)
        if not m:
            return cuts
        cuts.append(s + m)


def chunk_entries(
    adapter: ModelHandle, plan_: ContextPlan, layers: LayerKV, first: int = 0, offset: int = 0
) -> list[Entry]:
    """Entries for chunks ``first..`` of ``plan_`` cut from ``layers`` (per layer ``(keys, values)``
    ``[kv_heads, n, head_dim]`` holding positions ``offset..offset+n-1``)."""
    out = []
    for j in range(first, len(plan_.spans)):
        s, e = plan_.spans[j]
        kv = tuple((k[:, s - offset : e - offset], v[:, s - offset : e - offset]) for k, v in layers)
        out.append(adapter.entry(plan_.keys[j], plan_.ids[s:e], kv, parent=plan_.keys[j - 1] if j else "", start=s))
    return out


def fits(adapter: ModelHandle, view: EntryView, plan_: ContextPlan, j: int) -> bool:
    """Whether a stored chunk is chunk ``j`` of ``plan_`` for this model: its model, dtype, span,
    tokens and layer shapes. Its key already says all that; the entry must agree too, so that a
    misfiled or forged entry never feeds another model's tensors to this one, and a lossy entry
    never answers a lossless request (or one for another lossy codec)."""
    h = view.header
    start, end = plan_.spans[j]
    try:
        if identity_of(h.codec) != plan_.lossy:
            return False
    except CorruptEntryError:
        return False
    if not adapter.layout.dense:  # every layer's record: kind, kept length, window, state shapes and dtypes
        return (
            h.model == adapter.fingerprint
            and h.dtype == adapter.dtype_name
            and (h.start, h.end) == (start, end)
            and h.layers == adapter.layout.specs(start, end)
            and view.token_ids() == list(plan_.ids[start:end])
        )
    shapes = adapter.kv_shapes()
    return (
        h.model == adapter.fingerprint
        and h.dtype == adapter.dtype_name
        and (h.start, h.end) == (start, end)
        and h.n_layers == len(shapes)
        and all(
            s.kind == "attn" and (s.kv_heads, s.head_dim, s.head_dim) == shape for s, shape in zip(h.layers, shapes)
        )
        and view.token_ids() == list(plan_.ids[start:end])
    )


def load_prefix(
    adapter: ModelHandle, store: KVStore, plan_: ContextPlan, bufs: Buffers, row: int, slot0: int,
    codecs: list[str] | None = None, staging: Staging | None = None,
) -> int:  # fmt: skip
    """Copy the longest verified stored prefix of ``plan_`` into batch row ``row`` of ``bufs``,
    context position ``p`` at slot ``slot0 + p``. Falls back to a format-1 entry holding exactly
    this (lossless) context. Returns how many context tokens were loaded (0: nothing); the codec
    spec of each chunk loaded is appended to ``codecs``. With ``staging`` (accelerator buffers),
    records go through its pinned host tensors and asynchronous copies: call its ``finish()``
    before using ``bufs``."""
    loaded = 0
    with store.open_chain(plan_.keys, lazy=True) as views:
        fitting = []
        for j, view in enumerate(views):
            try:
                if not fits(adapter, view, plan_, j):
                    break
            except CorruptEntryError as exc:  # a lazily decoded record that does not decode
                _warn_corrupt(plan_.keys[j], exc)
                break
            fitting.append(view)
        # every tensor of every chunk straight into place, decompressed and copied on a few threads
        tasks = _copy_tasks(fitting, bufs, row, slot0, staging)
        errors = run_all([fn for _, fn in tasks], store.codec.decode_threads())
        good = len(fitting)
        for (j, _), err in zip(tasks, errors):
            if err is not None:
                if not isinstance(err, CorruptEntryError):
                    raise err
                if j < good:
                    good = j
                    _warn_corrupt(plan_.keys[j], err)
        if good:
            loaded = fitting[good - 1].header.end
        if codecs is not None:
            codecs += [spec_of(view.header.codec) for view in fitting[:good]]
    if loaded == 0 and not plan_.lossy and store.contains(plan_.v1_key):
        with store.open_entry(plan_.v1_key) as v1:
            one_chunk = ContextPlan(plan_.ids, ((0, plan_.n_tokens),), (plan_.v1_key,), plan_.v1_key)
            if v1 is not None and v1.header.format == 1 and fits(adapter, v1, one_chunk, 0):
                for (kb, vb), (k, v) in zip(bufs, v1.layers):  # type: ignore[misc]
                    k.copy_into(kb[row, :, slot0 : slot0 + plan_.n_tokens])
                    v.copy_into(vb[row, :, slot0 : slot0 + plan_.n_tokens])
                loaded = plan_.n_tokens
                if codecs is not None:
                    codecs.append(spec_of(v1.header.codec))
    return loaded


def _copy_tasks(
    fitting: Sequence[EntryView], bufs: Buffers, row: int, slot0: int, staging: Staging | None
) -> list[tuple[int, Callable[[], None]]]:
    """``(chunk index, copy)`` for every stored tensor of the ``fitting`` chunks into row ``row``.
    With an active ``staging``, one layer's keys (or values) over chunks that tile a span decode
    into one host region sent with one copy, unless they dequantize on the device."""
    items: list[tuple[int, int, int, StoredTensor, int, int]] = []  # chunk, layer, role, record, slots
    for j, view in enumerate(fitting):
        h = view.header
        for i, (kv, spec) in enumerate(zip(view.layers, h.layers)):
            if kv is not None:
                lo, hi = slot0 + h.end - spec.length, slot0 + h.end
                items += [(j, i, 0, kv[0], lo, hi), (j, i, 1, kv[1], lo, hi)]
    if staging is None or not staging.active:  # straight into place, in the order they lie in the store
        return [(j, functools.partial(_copy_into, rec, bufs[i][r][row, :, lo:hi])) for j, i, r, rec, lo, hi in items]
    groups: dict[tuple[int, int], list[tuple[int, StoredTensor, int, int]]] = {}
    for j, i, r, rec, lo, hi in items:
        groups.setdefault((i, r), []).append((j, rec, lo, hi))
    tasks: list[tuple[int, Callable[[], None]]] = []
    for (i, r), ps in groups.items():
        buf = bufs[i][r]
        tiled = all(a[3] == b[2] for a, b in zip(ps, ps[1:]))
        if tiled and not any(getattr(rec, "device_decode", False) for _, rec, _, _ in ps):
            lo0 = ps[0][2]
            region = staging.region(buf[row, :, lo0 : ps[-1][3]], len(ps))
            tasks += [(j, functools.partial(region.copy_into, rec, lo - lo0, hi - lo0)) for j, rec, lo, hi in ps]
        else:
            tasks += [(j, functools.partial(staging.copy_into, rec, buf[row, :, lo:hi])) for j, rec, lo, hi in ps]
    return tasks


def _copy_into(record, dest) -> None:
    record.copy_into(dest)


def _warn_corrupt(key: str, exc: Exception) -> None:
    warnings.warn(
        f"kvstore: entry {key[:16]} is corrupt ({exc}); treating it as a miss", CorruptEntryWarning, stacklevel=3
    )


def store_and_reload(
    adapter: ModelHandle, store: KVStore, plan_: ContextPlan, layers: LayerKV, bufs: Buffers, row: int, slot0: int,
    depth: int = 0, writer: Writer | None = None,
) -> None:  # fmt: skip
    """For a lossy codec: encode chunks ``depth..`` of ``plan_`` (``layers`` holding the positions
    from the chunk at ``depth`` on) with the store's codec, hand the bytes to ``writer`` (then the
    context record), and copy the values they decode to into batch row ``row`` of ``bufs``
    (position ``p`` at slot ``slot0 + p``). The answer then comes from exactly what a later run
    loads, whether or not the store can be written."""
    offset = plan_.spans[depth][0]
    # decoded as a load decodes them (on the buffers' device where the codec can), so that a later
    # run's answer is this one's
    staging = Staging(bufs[0][0].device)
    for i, entry in enumerate(chunk_entries(adapter, plan_, layers, depth, offset)):
        blob = store.encode(entry)
        view = decode_entry(blob, key=entry.key)
        h = view.header
        for (kb, vb), kv in zip(bufs, view.layers):
            assert kv is not None
            staging.copy_into(kv[0], kb[row, :, slot0 + h.start : slot0 + h.end])
            staging.copy_into(kv[1], vb[row, :, slot0 + h.start : slot0 + h.end])
        staging.finish()  # release the host tensors chunk by chunk
        if writer is not None:
            writer.put_encoded(entry, blob, overwrite=i == 0)
    if writer is not None:
        writer.put_context(plan_)


@torch.inference_mode()
def extend(adapter: ModelHandle, prefixes: Sequence[LayerKV], rests: Sequence[Sequence[int]]) -> list[LayerKV]:
    """Run ``rests[i]`` (token ids) on top of ``prefixes[i]`` (per layer ``(keys, values)``
    ``[kv_heads, L_i, head_dim]`` of the context's first ``L_i >= 1`` positions), all rows in one
    forward: prefixes left-padded to the longest, rests left-padded after them, explicit
    positions. Returns per row the per-layer keys/values of the rest's tokens (views)."""
    B = len(prefixes)
    lengths = [prefix[0][0].shape[1] for prefix in prefixes]
    sizes = [len(r) for r in rests]
    L, S = max(lengths), max(sizes)
    dev = adapter.device
    bufs = new_buffers(adapter.kv_shapes(), B, L + S, adapter.dtype, dev)
    mask = torch.zeros((B, L + S), dtype=torch.long)
    pos = torch.empty((B, S), dtype=torch.long)
    input_ids = torch.full((B, S), adapter.pad_id, dtype=torch.long)
    for i, (prefix, rest) in enumerate(zip(prefixes, rests)):
        n, s = lengths[i], sizes[i]
        for (kb, vb), (k, v) in zip(bufs, prefix):
            kb[i, :, : L - n].zero_()  # masked pads must be finite: 0 * NaN would still poison
            vb[i, :, : L - n].zero_()
            kb[i, :, L - n : L].copy_(k)
            vb[i, :, L - n : L].copy_(v)
        mask[i, L - n : L] = 1
        mask[i, L + S - s :] = 1
        pos[i] = n  # pad slots: any in-range position, they are masked
        pos[i, S - s :] = torch.arange(n, n + s)
        input_ids[i, S - s :] = torch.as_tensor(rest, dtype=torch.long)
    cache = PreallocatedCache(bufs, L)
    adapter.model(
        input_ids=input_ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
        **{adapter.layout.cache_arg: cache}, use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    return [tuple((kb[i, :, L + S - s :], vb[i, :, L + S - s :]) for kb, vb in bufs) for i, s in enumerate(sizes)]


__all__ = ["ContextPlan", "chunk_entries", "extend", "fits", "load_prefix", "plan"]
