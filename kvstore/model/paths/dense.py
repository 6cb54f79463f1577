"""The dense path: full-attention models, whose contexts are chains of KV chunks.

Building (:meth:`DensePath.compute`): contexts with nothing stored are prefilled in right-padded
batches (real tokens at slots ``0..n-1``, so causal attention never lets them see a pad, and each
row's KV is sliced back to its real tokens, so a stored chunk does not depend on its
batch-mates); the others are computed on top of their stored prefix
(:func:`kvstore.model.compute.forward.extend`).

Answering (:meth:`DensePath.answer`) runs the stages on a batch's plan: load (or the load done
ahead), complete, then per variant transform (a press) and answer. The reference
(:meth:`DensePath.reference`) prefills the contexts densely in memory and answers every variant the
same way, so cached == no-cache under any variant; with a single plain variant it runs each row's
context and question together in one forward instead, sharing nothing with the cached layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.cache import BatchCache, PreallocatedCache, new_buffers
from kvstore.model.compute.forward import DecodeSlots, Decoding, batches, extend, greedy_loop, prefill, right_padded
from kvstore.model.compute.static import StaticSteps, bucket_slots
from kvstore.model.paths.base import FEATURES, BatchAnswers, BuildCounts, CachePath, Work
from kvstore.model.plan.batch import BatchPlan
from kvstore.model.plan.chains import Chain
from kvstore.model.press.select import PressMemo
from kvstore.model.press.spec import ScoringTokens
from kvstore.model.stages.answer import Answer, QuestionMemo, answer, prefill_contexts
from kvstore.model.stages.complete import Completed, complete
from kvstore.model.stages.load import Loaded, load, load_prefix_kv
from kvstore.model.stages.transform import transform
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.compute.writer import Writer
    from kvstore.model.handle import ModelHandle
    from kvstore.model.options import BuildOptions
    from kvstore.progress import Progress


class DensePath(CachePath):
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

    def prepare(self, handle: ModelHandle, chain: BatchPlan, work: Work, loaded: Loaded | None) -> Completed:
        got = loaded if loaded is not None else load(handle, chain, work.store, work.writer)
        return complete(handle, chain, got, work.store, work.writer)

    def answer(self, handle: ModelHandle, chain: BatchPlan, work: Work, prepared: object) -> BatchAnswers:
        done = prepared
        assert isinstance(done, Completed)
        answers, window = _answer_variants(handle, done.cache, chain.fed, work)
        return BatchAnswers(answers, tuple(done.loaded[k] for k in chain.keys), done.computed, done.codecs, window)

    def reference(self, handle: ModelHandle, chain: BatchPlan, work: Work) -> BatchAnswers:
        contexts = [p.ids for p in chain.contexts]
        computed = sum(len(c) for c in contexts)
        none = (0,) * len(contexts)
        if len(work.variants) == 1 and work.variants[0].dense:
            one = _reference_together(handle, contexts, chain.fed, work.decoding)
            return BatchAnswers((one,), none, computed, (None,) * len(contexts))
        tail = chain.fed_slots + work.decoding.new_tokens
        cache = prefill_contexts(handle, contexts, tail, work.decoding.fixed)
        answers, window = _answer_variants(handle, cache, chain.fed, work)
        return BatchAnswers(answers, none, computed, (None,) * len(contexts), window)


def _counted(tokens: Sequence[int], reused: int, count: bool, progress: Progress | None) -> BuildCounts:
    """The counts of computed contexts (``count``) or of a shared prefix (tokens only)."""
    if count and progress:
        progress(len(tokens), sum(tokens))
    return BuildCounts(len(tokens) if count else 0, sum(tokens), reused if count else 0)


def _answer_variants(
    handle: ModelHandle, cache: BatchCache, questions: Sequence[Sequence[int]], work: Work
) -> tuple[tuple[Answer, ...], ScoringTokens]:
    """Every variant's answers from the same contexts (each pressed, if it presses, from the dense
    cache), and the tokens the presses' scoring forwards ran."""
    presses, questions_memo = PressMemo(), QuestionMemo()
    out = []
    for v in work.variants:
        mine = transform(handle, cache, v, presses)
        out.append(answer(handle, mine, questions, work.decoding, v, questions_memo))
    return tuple(out), presses.tokens


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
