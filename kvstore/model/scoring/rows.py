"""Scoring's pieces below its paths: batches of rows that keep a context's rows together,
gathering continuation log-probs from logits, and the reference
forward without a cache (context + continuation in one forward, as lm-eval's ``hf`` model runs
it). :mod:`kvstore.model.pipelines.score` builds the cached and sweep paths on them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.model.compute.forward import in_halves, right_padded
from kvstore.model.scoring.scores import ScoredRow
from kvstore.progress import Progress

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle
    from kvstore.model.options import ScoreOptions

# float32 logits one scoring forward may hold ([rows, fed tokens, vocab]); a batch takes fewer rows
# rather than exceed it (one row always runs)
LOGITS_BYTES = 512 << 20


def vocab_size(handle: ModelHandle) -> int:
    out = handle.model.get_output_embeddings()
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    return int(handle.model.config.get_text_config(decoder=True).vocab_size)


def row_batches(
    order: Sequence[int], keys: Sequence[str], sizes: Sequence[int], fed: Sequence[int], batch_size: int,
    max_batch_tokens: int | None, row_logits: int,
) -> Iterator[list[int]]:  # fmt: skip
    """Batches of rows in ``order`` (rows of one key consecutive) that keep a key's rows together
    whenever they fit in one batch: at most ``batch_size`` rows, ``max_batch_tokens`` padded tokens
    (rows x longest ``sizes``) and :data:`LOGITS_BYTES` of logits (rows x longest ``fed`` x
    ``row_logits`` bytes per fed token). A key with more rows than fit is split over batches."""
    runs: list[list[int]] = []
    for i in order:
        if runs and keys[runs[-1][0]] == keys[i]:
            runs[-1].append(i)
        else:
            runs.append([i])

    def fits(batch: list[int]) -> bool:
        if len(batch) > batch_size:
            return False
        if max_batch_tokens and max(sizes[j] for j in batch) * len(batch) > max_batch_tokens and len(batch) > 1:
            return False
        return len(batch) == 1 or max(fed[j] for j in batch) * len(batch) * row_logits <= LOGITS_BYTES

    batch: list[int] = []
    for run in runs:
        if batch and fits(batch + run):
            batch += run
            continue
        if batch:
            yield batch
            batch = []
        for i in run:
            if batch and not fits(batch + [i]):
                yield batch
                batch = []
            batch.append(i)
    if batch:
        yield batch


def gather_logprobs(logits: torch.Tensor, targets: Sequence[int], per_token: bool) -> tuple[float, bool, tuple | None]:
    """``(sum of log-probs, greedy, per-token log-probs)`` of ``targets`` from ``logits`` ``[n, V]``."""
    ftype = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    lp = torch.log_softmax(logits.to(ftype), dim=-1)
    t = torch.as_tensor(list(targets), dtype=torch.long, device=lp.device)
    picked = lp.gather(-1, t[:, None])[:, 0]
    greedy = bool((lp.argmax(dim=-1) == t).all())
    tokens = tuple(picked.double().cpu().tolist()) if per_token else None
    return float(picked.double().sum()), greedy, tokens


@torch.inference_mode()
def score_reference(
    handle: ModelHandle, ctx: Sequence[Sequence[int]], cont: Sequence[Sequence[int]], options: ScoreOptions,
    progress: Progress | None,
) -> list[ScoredRow]:  # fmt: skip
    """The reference without a cache: each row's context + continuation but its last token in one
    forward (as lm-eval's ``hf`` runs it). Returns each row's score, in order."""
    token_logprobs = options.token_logprobs
    n = len(ctx)
    rows: list[ScoredRow | None] = [None] * n
    seqs = [list(ctx[i]) + list(cont[i][:-1]) for i in range(n)]
    order = sorted(range(n), key=lambda i: (len(seqs[i]), i))
    sizes = [len(s) for s in seqs]
    row_logits = vocab_size(handle) * 4
    dev = handle.device

    def run(batch: list[int]) -> list[None]:
        B = len(batch)
        L = max(sizes[i] for i in batch)
        lo = min(len(ctx[i]) - 1 for i in batch)  # first position whose logits are needed
        input_ids, mask = right_padded(handle.pad_id, [seqs[i] for i in batch])
        out = handle.model(
            input_ids=input_ids.to(dev), attention_mask=mask.to(dev),
            position_ids=torch.arange(L, device=dev).expand(B, L), use_cache=False, logits_to_keep=L - lo,
        )  # fmt: skip
        for r, i in enumerate(batch):
            a = len(ctx[i]) - 1 - lo
            total, greedy, per_token = gather_logprobs(out.logits[r, a : a + len(cont[i])], cont[i], token_logprobs)
            rows[i] = ScoredRow(total, greedy, len(cont[i]), per_token, 0)
        del out
        if progress:
            progress(B, sum(sizes[i] for i in batch))
        return []

    keys = [str(i) for i in range(n)]
    for batch in row_batches(order, keys, sizes, sizes, options.batch_size, options.max_batch_tokens, row_logits):
        in_halves(run, batch, handle)
    return [r for r in rows if r is not None]


__all__ = ["LOGITS_BYTES", "gather_logprobs", "row_batches", "score_reference", "vocab_size"]
