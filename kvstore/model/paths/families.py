"""Windowed, state-space and hybrid models: loading, computing and storing their contexts'
caches, and decoding from them (dense models keep :mod:`kvstore.model.pipelines.build`'s and
:mod:`kvstore.model.pipelines.sample`'s own paths; those hand these models over to this module).

Every chunk of a context is stored as the model's layers need it (:mod:`kvstore.model.family.layout`):
keys and values of the tokens later ones can still attend to, and the recurrent states at the
chunk's end, so a chain can be resumed at any of its boundaries. Models with states are therefore
computed chunk by chunk (one :meth:`Slots.run` per chunk, states read after each); pure attention
models in one pass, their chunks cut from it.

A context's cache in memory is a :class:`RowCache`: loaded from its longest stored prefix
(:func:`load`), extended by what is missing (:func:`compute`), then placed in the batch's slots for
the question and the answer (:func:`decode_cached`). The reference without a cache
(:func:`decode_reference`) runs each row's context and question through the same slots from
nothing: it shares the masks, never the stored tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstore.facts import WINDOWED_KINDS
from kvstore.model.compute.forward import batches, greedy_loop
from kvstore.model.paths.slots import KV, RowCache, Slots
from kvstore.model.plan import chains
from kvstore.model.plan.chains import ContextPlan
from kvstore.store.codecs import spec_of
from kvstore.store.entry import Entry
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.compute.writer import BuildReport, Writer
    from kvstore.model.handle import ModelHandle
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


def load(
    adapter: ModelHandle, store: KVStore, plan: ContextPlan, depth: int | None = None, codecs: list[str] | None = None
) -> RowCache | None:
    """The longest verified stored prefix of ``plan`` (at most ``depth`` chunks) as a
    :class:`RowCache` (materialized on the CPU), or None when nothing of it is stored. The codec
    spec of each chunk used is appended to ``codecs``."""
    layout = adapter.layout
    keys = plan.keys if depth is None else plan.keys[:depth]
    with store.open_chain(keys) as views:
        fitting = []
        for j, view in enumerate(views):
            if not chains.fits(adapter, view, plan, j):
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
            empty = torch.zeros((lay.kv_heads, 0, lay.head_dim), dtype=adapter.dtype)
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
def compute(adapter: ModelHandle, jobs: Sequence[tuple[ContextPlan, RowCache | None]]) -> list[Computed]:
    """Compute the rest of each ``(plan, stored prefix or None)``, all in one batch of slots.
    Models with states run chunk by chunk (rows whose chunks have equal lengths together)."""
    layout = adapter.layout
    segments: list[list[tuple[int, int]]] = []
    for plan, prefix in jobs:
        start = prefix.end if prefix is not None else 0
        if start >= plan.n_tokens:
            raise ValueError("nothing to compute: the stored prefix is the whole context")
        cuts = [e for _, e in plan.spans if e > start] if layout.has_state else [plan.n_tokens]
        segments.append(list(zip([start] + cuts[:-1], cuts)))
    steps = max(len(s) for s in segments)
    tail = sum(max((e - s for seg in segments if k < len(seg) for s, e in [seg[k]]), default=0) for k in range(steps))
    slots = Slots(adapter, layout, [prefix for _, prefix in jobs], tail)
    states: list[dict[int, Any]] = [{} for _ in jobs]
    for k in range(steps):
        rows = [r for r, seg in enumerate(segments) if k < len(seg)]
        slots.run(rows, [jobs[r][0].ids[segments[r][k][0] : segments[r][k][1]] for r in rows])
        if layout.has_state:
            for r in rows:
                states[r][segments[r][k][1]] = slots.row_states(r)
    out = []
    for r, (plan, prefix) in enumerate(jobs):
        start, end = segments[r][0][0], plan.n_tokens
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


def entries(adapter: ModelHandle, plan: ContextPlan, computed: Computed) -> list[Entry]:
    """The entries of ``plan``'s chunks from ``computed.start`` on."""
    layout = adapter.layout
    kinds = tuple(lay.kind for lay in layout.layers)
    windows = tuple(lay.window if lay.kind in WINDOWED_KINDS else None for lay in layout.layers)
    out = []
    for j, (s, e) in enumerate(plan.spans):
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
                plan.keys[j],
                adapter.fingerprint,
                adapter.name,
                torch.as_tensor(plan.ids[s:e], dtype=torch.int64),
                tuple(layers),
                parent=plan.keys[j - 1] if j else "",
                start=s,
                states=states,
                kinds=kinds,
                windows=windows,
                numerics=adapter.numerics,
                kv_dtype=adapter.dtype,
            )  # fmt: skip
        )
    return out


def _write(writer: Writer, adapter: ModelHandle, plan: ContextPlan, computed: Computed, record: bool) -> None:
    # the first chunk computed is written even if present: it was missing or corrupt (a repair)
    for i, entry in enumerate(entries(adapter, plan, computed)):
        writer.put(entry, overwrite=i == 0)
    if record:
        writer.put_context(plan)


def compute_jobs(
    adapter: ModelHandle, store: KVStore, jobs: Sequence[tuple[ContextPlan, int]], writer: Writer, report: BuildReport,
    batch_size: int, max_batch_tokens: int | None, progress: Progress | None, count: bool,
    account: Callable[[BuildReport, Sequence[int], bool, Progress | None], None],
) -> None:  # fmt: skip
    """:func:`kvstore.model.pipelines.build.compute` for these models: each ``(plan, stored depth)`` job's
    chunks from its depth on, in batches, then (with ``count``) its record."""
    sizes = [plan.n_tokens for plan, _ in jobs]
    for batch in batches(sorted(range(len(jobs)), key=lambda i: sizes[i]), sizes, batch_size, max_batch_tokens):
        todo = []
        for i in batch:
            plan, depth = jobs[i]
            prefix = load(adapter, store, plan, depth) if depth else None  # None: it went away meanwhile
            todo.append((plan, prefix))
        for (plan, _), done in zip(todo, compute(adapter, todo)):
            _write(writer, adapter, plan, done, count)
        starts = [prefix.end if prefix is not None else 0 for _, prefix in todo]
        if count:
            report.tokens_reused += sum(starts)
        account(report, [plan.n_tokens - s for (plan, _), s in zip(todo, starts)], count, progress)


@torch.inference_mode()
def decode_cached(adapter: ModelHandle, plans, q_ids, N, store, writer, stop, return_scores):
    """:func:`kvstore.model.pipelines.sample.decode_cached` for these models (same arguments and results)."""
    distinct = list({p.key: p for p in plans}.values())
    caches: dict[str, RowCache] = {}
    loaded: dict[str, int] = {}
    codecs: dict[str, list[str]] = {p.key: [] for p in distinct}
    todo = []
    for plan in distinct:
        found = load(adapter, store, plan, codecs=codecs[plan.key]) if store is not None else None
        loaded[plan.key] = found.end if found is not None else 0
        if found is not None and found.end == plan.n_tokens:
            caches[plan.key] = found
        else:
            todo.append((plan, found))
    if todo:
        for (plan, _), done in zip(todo, compute(adapter, todo)):
            caches[plan.key] = done.cache
            if writer is not None:
                _write(writer, adapter, plan, done, True)
            if store is not None:
                codecs[plan.key].append(store.codec.spec)
    Q = max(len(q) for q in q_ids)
    if min(len(q) for q in q_ids) == 0:
        raise ValueError("every question needs at least one token")
    slots = Slots(adapter, adapter.layout, [caches[p.key] for p in plans], Q + N)
    tokens, scores = _answer(adapter, slots, q_ids, N, stop, return_scores, greedy_loop)
    computed = sum(p.n_tokens - loaded[p.key] for p in distinct)
    labels = [",".join(dict.fromkeys(codecs[p.key])) or None for p in plans]
    return tokens, scores, [loaded[p.key] for p in plans], computed, labels


@torch.inference_mode()
def decode_reference(adapter: ModelHandle, full_ids, N, stop, return_scores):
    """:func:`kvstore.model.pipelines.sample.decode_reference` for these models: each row's context and
    question from nothing, in the same slots and masks."""
    slots = Slots(adapter, adapter.layout, [None] * len(full_ids), max(map(len, full_ids)) + N)
    return _answer(adapter, slots, full_ids, N, stop, return_scores, greedy_loop)


def _answer(adapter, slots: Slots, prompts, N, stop, return_scores, greedy_loop):
    rows = list(range(len(prompts)))
    logits = slots.run(rows, prompts)

    def step(nxt: torch.Tensor, t: int) -> torch.Tensor:
        return slots.run(rows, [[x] for x in nxt.tolist()])

    return greedy_loop(adapter, None, None, logits, None, 0, N, stop, return_scores, step=step)


__all__ = ["Computed", "compute", "compute_jobs", "decode_cached", "decode_reference", "entries", "load"]
