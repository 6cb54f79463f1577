"""The dense path: full-attention models, whose contexts are chains of KV chunks.

Building (:meth:`DensePath.compute`): contexts with nothing stored are prefilled in right-padded
batches (real tokens at slots ``0..n-1``, so causal attention never lets them see a pad, and each
row's KV is sliced back to its real tokens, so a stored chunk does not depend on its
batch-mates); the others are computed on top of their stored prefix
(:func:`kvstore.model.compute.forward.extend`).

Answering (:meth:`DensePath.prepare`, :meth:`DensePath.answer`) runs the stages on a batch's plan:
the planned pressed entries opened (one that turns out corrupt or foreign is a miss: its context is
loaded densely instead), load (or the load done ahead) and complete of the contexts the plan needs
densely, then per variant transform (a press, from its entries or the dense cache) and answer.
Scoring (:meth:`DensePath.score`) is the same with the score stage last. The reference
(:meth:`DensePath.reference`) prefills the contexts densely in memory and answers every variant the
same way, so cached == no-cache under any variant; with a single plain variant it runs each row's
context and question together in one forward instead, sharing nothing with the cached layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import PreallocatedCache, new_buffers
from kvstore.model.compute.forward import DecodeSlots, Decoding, batches, extend, greedy_loop, prefill, right_padded
from kvstore.model.compute.static import StaticSteps, bucket_slots
from kvstore.model.io.chains import Chain
from kvstore.model.io.probes import load_prefix_kv
from kvstore.model.paths.base import FEATURES, BatchAnswers, BatchScores, BatchSetup, BuildCounts, CachePath
from kvstore.model.plan.batch import BatchPlan
from kvstore.model.press.select import PressMemo
from kvstore.model.press.stored import StoredScores, open_pressed
from kvstore.model.stages.answer import Answer, QuestionMemo, answer, prefill_contexts
from kvstore.model.stages.complete import Completed, complete
from kvstore.model.stages.load import Loaded, load
from kvstore.model.stages.score import keep_rows, score_fed, scored_contexts
from kvstore.model.stages.transform import transform
from kvstore.store.codecs import Codec
from kvstore.store.kvstore import KVStore
from kvstore.store.owned import DerivedView

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.io.writer import Writer
    from kvstore.model.options import BuildOptions
    from kvstore.progress import Progress


class DensePath(CachePath["Prepared"]):
    """Full-attention caches (see the module docstring)."""

    name = "dense"
    features = frozenset(FEATURES)

    def compute(
        self, handle: ModelHandle, store: KVStore, jobs: Sequence[tuple[Chain, int]], writer: Writer,
        options: BuildOptions, progress: Progress | None, count: bool,
    ) -> BuildCounts:  # fmt: skip
        assert options.batch_size is not None
        size, budget = options.batch_size, options.max_batch_tokens
        done = BuildCounts()
        fresh = [p for p, d in jobs if d == 0]
        lengths = [p.n_tokens for p in fresh]
        for batch in batches(sorted(range(len(fresh)), key=lambda i: lengths[i]), lengths, size, budget):
            for i, layers in zip(batch, prefill(handle, [fresh[i].ids for i in batch])):
                writer.put_chunks(handle, fresh[i], layers, record=count)
            done += _counted([fresh[i].n_tokens for i in batch], 0, count, progress)
        partial = [(p, d) for p, d in jobs if d > 0]
        sizes = [p.n_tokens for p, _ in partial]
        for batch in batches(sorted(range(len(partial)), key=lambda i: sizes[i]), sizes, size, budget):
            prefixes, todo = [], []
            for i in batch:
                chain, depth = partial[i]
                kv = load_prefix_kv(handle, store, chain, depth)
                if kv is None:  # the prefix went away meanwhile: compute the whole context
                    done += self.compute(handle, store, [(chain, 0)], writer, options, progress, count)
                    continue
                prefixes.append(kv)
                todo.append(i)
            if todo:
                starts = [partial[i][0].spans[partial[i][1] - 1][1] for i in todo]
                rests = extend(handle, prefixes, [partial[i][0].ids[s:] for i, s in zip(todo, starts)])
                for i, s, layers in zip(todo, starts, rests):
                    writer.put_chunks(handle, partial[i][0], layers, partial[i][1], s, record=count)
                done += _counted(
                    [partial[i][0].n_tokens - s for i, s in zip(todo, starts)], sum(starts), count, progress
                )
        return done

    def prepare(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup, loaded: Loaded | None) -> Prepared:
        stack = contextlib.ExitStack()
        try:
            entries, bad = _open_entries(handle, plan, work, stack)
            if bad:  # a corrupt or foreign pressed entry is a miss: that context is loaded densely
                plan, loaded = plan.with_dense(bad), None
            got = loaded if loaded is not None else load(handle, plan, work.store, work.writer)
            return Prepared(plan, complete(handle, plan, got, work.store, work.writer), entries, stack)
        except BaseException:
            stack.close()
            raise

    def answer(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup, prepared: Prepared) -> BatchAnswers:
        with prepared.stack:
            plan, done = prepared.plan, prepared.completed
            memo = _memo(handle, plan, work)
            questions_memo = QuestionMemo()
            out = []
            for v in work.variants:
                mine = transform(handle, plan, done.cache, v, memo, prepared.entries.get(v.name, {}), _codec(work))
                out.append(answer(handle, mine, plan.fed, work.decoding, v, questions_memo))
        return BatchAnswers(tuple(out), _loaded(plan, done), done.computed, _labels(plan, prepared), memo.tokens)

    def score(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup, prepared: Prepared) -> BatchScores:
        assert work.scoring is not None
        job = work.scoring
        with prepared.stack:
            plan, done = prepared.plan, prepared.completed
            dense = scored_contexts(done.cache) if done.cache is not None else None
            memo = _memo(handle, plan, work)
            targets = [job.targets[i] for i in plan.rows]
            rows, kept, nbytes = [], [], []
            keeping = bool(job.keep) and work.writer is not None and work.store is not None
            for v in work.variants:  # each variant writes only the fed slots, from P on: contexts stay
                mine = transform(handle, plan, dense, v, memo, prepared.entries.get(v.name, {}), _codec(work))
                rows.append(tuple(score_fed(handle, mine, plan.fed, targets, v, job.token_logprobs)))
                kept.append(mine.kept_tokens)
                nbytes.append(mine.nbytes())
                if keeping and v.dense and done.cache is not None:  # the model's own fed KV, before another
                    assert work.store is not None and work.writer is not None  # variant writes those slots
                    keep_rows(handle, work.store, work.writer, plan, done.cache, job.keep)
                    keeping = False
        return BatchScores(tuple(rows), tuple(kept), tuple(nbytes), _loaded(plan, done), done.computed, memo.tokens)

    def reference(self, handle: ModelHandle, plan: BatchPlan, work: BatchSetup) -> BatchAnswers:
        contexts = [p.ids for p in plan.contexts]
        computed = sum(len(c) for c in contexts)
        none = (0,) * len(contexts)
        if len(work.variants) == 1 and work.variants[0].dense:
            one = _reference_together(handle, contexts, plan.fed, work.decoding)
            return BatchAnswers((one,), none, computed, (None,) * len(contexts))
        tail = plan.fed_slots + work.decoding.new_tokens
        cache = prefill_contexts(handle, contexts, tail, work.decoding.fixed)
        memo, questions_memo = PressMemo(), QuestionMemo()
        answers = tuple(
            answer(
                handle, transform(handle, plan, cache, v, memo, {}, None), plan.fed, work.decoding, v, questions_memo
            )
            for v in work.variants
        )
        return BatchAnswers(answers, none, computed, (None,) * len(contexts), memo.tokens)


def _counted(tokens: Sequence[int], reused: int, count: bool, progress: Progress | None) -> BuildCounts:
    """The counts of computed contexts (``count``) or of a shared prefix (tokens only)."""
    if count and progress:
        progress(len(tokens), sum(tokens))
    return BuildCounts(len(tokens) if count else 0, sum(tokens), reused if count else 0)


@dataclass(frozen=True)
class Prepared:
    """A dense-path batch ready to answer or score: the plan it kept (a pressed entry found bad
    moves its context to ``dense``), its completed dense contexts, the open pressed entries by
    variant name and context key, and the stack that keeps them open until the batch is done."""

    plan: BatchPlan
    completed: Completed
    entries: Mapping[str, Mapping[str, DerivedView]]
    stack: contextlib.ExitStack


def _open_entries(
    handle: ModelHandle, plan: BatchPlan, work: BatchSetup, stack: contextlib.ExitStack
) -> tuple[dict[str, dict[str, DerivedView]], frozenset[str]]:
    """The plan's pressed entries, verified and open on ``stack``; and the contexts whose entry
    turned out missing, corrupt or foreign."""
    entries: dict[str, dict[str, DerivedView]] = {}
    bad: set[str] = set()
    if work.store is None:
        return entries, frozenset()
    filed = dict(zip(plan.keys, plan.derived_chains))
    for name, per_context in plan.pressed.items():
        for key, dkey in per_context.items():
            view = open_pressed(work.store, handle, filed[key], dkey, stack)
            if view is None:
                bad.add(key)
            else:
                entries.setdefault(name, {})[key] = view
    return entries, frozenset(bad)


def _memo(handle: ModelHandle, plan: BatchPlan, work: BatchSetup) -> PressMemo:
    """A batch's press memo, reading and (on a writable store) saving stored scores."""
    if work.store is None:
        return PressMemo()
    return PressMemo(stored=StoredScores(handle, work.store, plan.derived_chains, work.writer is not None))


def _codec(work: BatchSetup) -> Codec | None:
    return work.store.codec if work.store is not None else None


def _loaded(plan: BatchPlan, done: Completed) -> tuple[int, ...]:
    """Per row, the context tokens that came from the store: its dense tokens loaded, or its whole
    context where every variant read a stored pressed entry."""
    return tuple(done.tokens_loaded[c.key] if c.key in plan.dense else c.n_tokens for c in plan.contexts)


def _labels(plan: BatchPlan, prepared: Prepared) -> tuple[str | None, ...]:
    """Per row, the codec its context came from: the dense chunks', else its pressed entries'."""
    out = []
    for r, c in enumerate(plan.contexts):
        label = prepared.completed.codecs[r]
        if label is None and c.key not in plan.dense:
            specs = [m[c.key].header.codec_spec for m in prepared.entries.values() if c.key in m]
            label = ",".join(dict.fromkeys(specs)) or None
        out.append(label)
    return tuple(out)


@torch.inference_mode()
def _reference_together(
    handle: ModelHandle, contexts: Sequence[Sequence[int]], questions: Sequence[Sequence[int]], decoding: Decoding
) -> Answer:
    """Each row's context and question through the model together (no cache, one forward,
    right-padded), then the greedy loop."""
    import time

    t0 = time.perf_counter()
    full = [list(c) + list(q) for c, q in zip(contexts, questions)]
    B = len(full)
    lens = [len(x) for x in full]
    L = max(lens)
    T = L + decoding.new_tokens
    dev = handle.device
    bufs = new_buffers(handle.kv_shapes(), B, bucket_slots(T, decoding.fixed), handle.dtype, dev)
    for kb, vb in bufs:
        kb.zero_()
        vb.zero_()
    input_ids, mask = right_padded(handle.pad_id, full, T)
    mask[:, L:] = 1
    mask = mask.to(dev)
    out = handle.model(
        input_ids=input_ids.to(dev),
        attention_mask=mask[:, :L],
        position_ids=torch.arange(L, device=dev).expand(B, L),
        **{handle.layout.cache_arg: PreallocatedCache(bufs, 0)},
        use_cache=True,
        logits_to_keep=torch.tensor([[n - 1] for n in lens], device=dev),
    )
    next_pos = torch.tensor(lens, device=dev)
    step = (
        StaticSteps(handle, bufs, mask, L, next_pos, compiled=decoding.steps == "compiled") if decoding.fixed else None
    )
    slots = DecodeSlots(PreallocatedCache(bufs, L), mask, next_pos, L, step)
    tokens, scores = greedy_loop(handle, out.logits[:, -1], slots, decoding)
    kept = tuple(len(c) for c in contexts)
    return Answer(tokens, scores, time.perf_counter() - t0, kept, sum(kept) * handle.kv_bytes_per_token())


DENSE_PATH = DensePath()

__all__ = ["DENSE_PATH", "DensePath"]
