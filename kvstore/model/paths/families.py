"""The families path: windowed, state-space and hybrid models. Loading, computing and storing
their contexts' caches, and decoding from them (:class:`FamiliesPath`; dense models take
:mod:`kvstore.model.paths.dense`).

Every chunk of a context is stored as the model's layers need it (:mod:`kvstore.model.family.layout`):
keys and values of the tokens later ones can still attend to, and the recurrent states at the
chunk's end, so a chain can be resumed at any of its boundaries. Models with states are therefore
computed chunk by chunk (one :meth:`Slots.run` per chunk, states read after each); pure attention
models in one pass, their chunks cut from it.

A context's cache in memory is a :class:`RowCache`: loaded from its longest stored prefix
(:func:`load_cache`), extended by what is missing (:func:`compute`), then placed in the batch's slots for
the question and the answer (:func:`decode_cached`). The reference without a cache
(:func:`decode_reference`) runs each row's context and question through the same slots from
nothing: it shares the masks, never the stored tensors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstore.facts import WINDOWED_KINDS
from kvstore.model.compute.forward import DecodeSlots, Decoding, batches, greedy_loop
from kvstore.model.io.chains import Chain, fits
from kvstore.model.paths.base import BatchAnswers, BatchSetup, BuildCounts, CachePath
from kvstore.model.paths.slots import KV, RowCache, Slots
from kvstore.model.plan.batch import BatchPlan
from kvstore.model.stages.answer import Answer
from kvstore.model.stages.load import Loaded
from kvstore.store.codecs import spec_of
from kvstore.store.entry import Entry
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.io.writer import Writer
    from kvstore.model.options import BuildOptions
    from kvstore.progress import Progress


@dataclass(frozen=True)
class Computed:
    """What :func:`compute` produced for one context: the keys/values of positions ``[start,
    end)`` per layer (every token, windowed layers too; None for layers without keys), the states
    at each chunk end it crossed (by position), and the context's cache at ``end``."""

    start: int
    kv: tuple[KV | None, ...]
    states: dict[int, tuple[dict[str, torch.Tensor] | None, ...]]
    cache: RowCache


def load_cache(
    handle: ModelHandle, store: KVStore, chain: Chain, depth: int | None = None, codecs: list[str] | None = None
) -> RowCache | None:
    """The longest verified stored prefix of ``chain`` (at most ``depth`` chunks) as a
    :class:`RowCache` (materialized on the CPU), or None when nothing of it is stored. The codec
    spec of each chunk used is appended to ``codecs``."""
    layout = handle.layout
    keys = chain.keys if depth is None else chain.keys[:depth]
    with store.open_chain(keys) as views:
        fitting = []
        for j, view in enumerate(views):
            if not fits(handle, view, chain, j):
                break
            fitting.append(view)
        if not fitting:
            return None
        if codecs is not None:
            codecs += [spec_of(view.header.codec) for view in fitting]
        end = fitting[-1].header.end
        kv: list[KV | None] = []
        for i, lay in enumerate(layout.layers):
            if not lay.has_kv:
                kv.append(None)
                continue
            lo = end - lay.keep(0, end)  # chunk tails from here on cover what a later token sees
            empty = torch.zeros((lay.kv_heads, 0, lay.head_dim), dtype=handle.dtype)
            ks, vs = [empty], [empty]
            for view in fitting:
                h, spec = view.header, view.header.layers[i]
                first = h.end - spec.length
                if h.end <= lo or spec.length == 0:
                    continue
                k, v = view.layer(i)
                ks.append(k.materialize()[:, max(lo, first) - first :])
                vs.append(v.materialize()[:, max(lo, first) - first :])
            kv.append((torch.cat(ks, 1), torch.cat(vs, 1)))
            assert kv[-1][0].shape[1] == end - lo, "chained chunks do not cover the window"  # type: ignore[index]
        last = fitting[-1]
        states = tuple(None if s is None else {n: r.materialize() for n, r in s.items()} for s in last.states)
    return RowCache(end, tuple(kv), states)


@torch.inference_mode()
def compute(handle: ModelHandle, jobs: Sequence[tuple[Chain, RowCache | None]]) -> list[Computed]:
    """Compute the rest of each ``(chain, stored prefix or None)``, all in one batch of slots.
    Models with states run chunk by chunk (rows whose chunks have equal lengths together)."""
    layout = handle.layout
    segments: list[list[tuple[int, int]]] = []
    for chain, prefix in jobs:
        start = prefix.end if prefix is not None else 0
        if start >= chain.n_tokens:
            raise ValueError("nothing to compute: the stored prefix is the whole context")
        cuts = [e for _, e in chain.spans if e > start] if layout.has_state else [chain.n_tokens]
        segments.append(list(zip([start] + cuts[:-1], cuts)))
    steps = max(len(s) for s in segments)
    tail = sum(max((e - s for seg in segments if k < len(seg) for s, e in [seg[k]]), default=0) for k in range(steps))
    slots = Slots(handle, layout, [prefix for _, prefix in jobs], tail)
    states: list[dict[int, Any]] = [{} for _ in jobs]
    for k in range(steps):
        rows = [r for r, seg in enumerate(segments) if k < len(seg)]
        slots.run(rows, [jobs[r][0].ids[segments[r][k][0] : segments[r][k][1]] for r in rows])
        if layout.has_state:
            for r in rows:
                states[r][segments[r][k][1]] = slots.row_states(r)
    out = []
    for r, (chain, prefix) in enumerate(jobs):
        start, end = segments[r][0][0], chain.n_tokens
        rest = slots.appended_kv(r)
        kv: list[KV | None] = []
        for i, lay in enumerate(layout.layers):
            part = rest[i]
            if part is None:
                kv.append(None)
                continue
            if prefix is not None:
                old = prefix.kv[i]
                assert old is not None
                dev = part[0].device
                part = (torch.cat([old[0].to(dev), part[0]], 1), torch.cat([old[1].to(dev), part[1]], 1))
            n = lay.keep(0, end)
            kv.append((part[0][:, part[0].shape[1] - n :], part[1][:, part[1].shape[1] - n :]))
        final = states[r].get(end) or tuple(None for _ in layout.layers)
        out.append(Computed(start, rest, states[r], RowCache(end, tuple(kv), final)))
    return out


def entries(handle: ModelHandle, chain: Chain, computed: Computed) -> list[Entry]:
    """The entries of ``chain``'s chunks from ``computed.start`` on."""
    layout = handle.layout
    kinds = tuple(lay.kind for lay in layout.layers)
    windows = tuple(lay.window if lay.kind in WINDOWED_KINDS else None for lay in layout.layers)
    out = []
    for j, (s, e) in enumerate(chain.spans):
        if s < computed.start:
            continue
        layers: list[KV | None] = []
        for lay, kv in zip(layout.layers, computed.kv):
            if kv is None:
                layers.append(None)
                continue
            a, b = e - lay.keep(s, e) - computed.start, e - computed.start
            layers.append((kv[0][:, a:b].cpu(), kv[1][:, a:b].cpu()))
        states = computed.states.get(e) if layout.has_state else None
        if states is not None:
            states = tuple(None if st is None else {n: t.cpu() for n, t in st.items()} for st in states)
        out.append(
            Entry(
                chain.keys[j],
                handle.fingerprint,
                handle.name,
                torch.as_tensor(chain.ids[s:e], dtype=torch.int64),
                tuple(layers),
                parent=chain.keys[j - 1] if j else "",
                start=s,
                states=states,
                kinds=kinds,
                windows=windows,
                numerics=handle.numerics,
                kv_dtype=handle.dtype,
            )  # fmt: skip
        )
    return out


def _write(writer: Writer, handle: ModelHandle, chain: Chain, computed: Computed, record: bool) -> None:
    # the first chunk computed is written even if present: it was missing or corrupt (a repair)
    for i, entry in enumerate(entries(handle, chain, computed)):
        writer.put(entry, overwrite=i == 0)
    if record:
        writer.put_context(chain)


def compute_jobs(
    handle: ModelHandle, store: KVStore, jobs: Sequence[tuple[Chain, int]], writer: Writer,
    options: BuildOptions, progress: Progress | None, count: bool,
) -> BuildCounts:  # fmt: skip
    """:meth:`CachePath.compute` for these models: each ``(chain, stored depth)`` job's chunks from
    its depth on, in batches, then (with ``count``) its record."""
    assert options.batch_size is not None
    sizes = [chain.n_tokens for chain, _ in jobs]
    done = BuildCounts()
    order = sorted(range(len(jobs)), key=lambda i: sizes[i])
    for batch in batches(order, sizes, options.batch_size, options.max_batch_tokens):
        todo = []
        for i in batch:
            chain, depth = jobs[i]
            prefix = load_cache(handle, store, chain, depth) if depth else None  # None: it went away meanwhile
            todo.append((chain, prefix))
        for (chain, _), got in zip(todo, compute(handle, todo)):
            _write(writer, handle, chain, got, count)
        starts = [prefix.end if prefix is not None else 0 for _, prefix in todo]
        tokens = [chain.n_tokens - s for (chain, _), s in zip(todo, starts)]
        if count and progress:
            progress(len(tokens), sum(tokens))
        done += BuildCounts(len(tokens) if count else 0, sum(tokens), sum(starts) if count else 0)
    return done


@torch.inference_mode()
def decode_cached(handle: ModelHandle, plan: BatchPlan, store: KVStore | None, writer: Writer | None,
                  decoding: Decoding) -> BatchAnswers:  # fmt: skip
    """A batch from stored caches: each distinct context loaded (its longest stored prefix) and
    completed, then the questions and the answers in the batch's slots."""
    t0 = time.perf_counter()
    distinct = [plan.context_of(k) for k in plan.distinct]
    caches: dict[str, RowCache] = {}
    loaded: dict[str, int] = {}
    codecs: dict[str, list[str]] = {p.key: [] for p in distinct}
    todo = []
    for ctx in distinct:
        found = load_cache(handle, store, ctx, codecs=codecs[ctx.key]) if store is not None else None
        loaded[ctx.key] = found.end if found is not None else 0
        if found is not None and found.end == ctx.n_tokens:
            caches[ctx.key] = found
        else:
            todo.append((ctx, found))
    if todo:
        for (ctx, _), got in zip(todo, compute(handle, todo)):
            caches[ctx.key] = got.cache
            if writer is not None:
                _write(writer, handle, ctx, got, True)
            if store is not None:
                codecs[ctx.key].append(store.codec.spec)
    if min(len(q) for q in plan.fed) == 0:
        raise ValueError("every question needs at least one token")
    slots = Slots(handle, handle.layout, [caches[p.key] for p in plan.contexts], plan.fed_slots + decoding.new_tokens)
    tokens, scores = _answer(handle, slots, plan.fed, decoding)
    computed = sum(p.n_tokens - loaded[p.key] for p in distinct)
    labels = tuple(",".join(dict.fromkeys(codecs[p.key])) or None for p in plan.contexts)
    kept = tuple(p.n_tokens for p in plan.contexts)
    one = Answer(tokens, scores, time.perf_counter() - t0, kept, 0)
    return BatchAnswers((one,), tuple(loaded[p.key] for p in plan.contexts), computed, labels)


@torch.inference_mode()
def decode_reference(handle: ModelHandle, plan: BatchPlan, decoding: Decoding) -> BatchAnswers:
    """A batch without a store: each row's context and question from nothing, in the same slots
    and masks."""
    t0 = time.perf_counter()
    full = [list(p.ids) + list(q) for p, q in zip(plan.contexts, plan.fed)]
    slots = Slots(handle, handle.layout, [None] * len(full), max(map(len, full)) + decoding.new_tokens)
    tokens, scores = _answer(handle, slots, full, decoding)
    kept = tuple(p.n_tokens for p in plan.contexts)
    one = Answer(tokens, scores, time.perf_counter() - t0, kept, 0)
    computed = sum(kept)
    return BatchAnswers((one,), (0,) * len(full), computed, (None,) * len(full))


def _answer(handle: ModelHandle, slots: Slots, prompts: Sequence[Sequence[int]], decoding: Decoding):
    rows = list(range(len(prompts)))
    logits = slots.run(rows, prompts)

    def step(nxt: torch.Tensor, t: int) -> torch.Tensor:
        return slots.run(rows, [[x] for x in nxt.tolist()])

    return greedy_loop(handle, logits, DecodeSlots(None, None, None, 0, step), decoding)


class FamiliesPath(CachePath[None]):
    """Sliding-window, chunked-attention, state-space and hybrid caches (see the module docstring)."""

    name = "families"
    features: frozenset[str] = frozenset()

    def compute(
        self, handle: ModelHandle, store: KVStore, jobs: Sequence[tuple[Chain, int]], writer: Writer,
        options: BuildOptions, progress: Progress | None, count: bool,
    ) -> BuildCounts:  # fmt: skip
        return compute_jobs(handle, store, jobs, writer, options, progress, count)

    def prepare(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup, loaded: Loaded | None) -> None:
        return None  # loaded and completed row by row in answer: one variant, nothing ahead

    def answer(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup, prepared: None) -> BatchAnswers:
        return decode_cached(handle, plan, work.store, work.writer, work.decoding)

    def reference(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup) -> BatchAnswers:
        return decode_reference(handle, plan, work.decoding)


FAMILIES_PATH = FamiliesPath()

__all__ = [
    "FAMILIES_PATH",
    "Computed",
    "FamiliesPath",
    "compute",
    "compute_jobs",
    "decode_cached",
    "decode_reference",
    "entries",
    "load_cache",
]
