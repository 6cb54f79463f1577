"""The forward pieces every cache path shares: prefill, batching and the greedy loop.

Plain functions over a model handle (an :class:`~kvstore.model.adapter.Adapter`, used only for its
model, ids and dtype/device); they import nothing from the orchestration modules
(:mod:`~kvstore.model.pipelines.build`, :mod:`~kvstore.model.pipelines.sample`, :mod:`~kvstore.model.paths.families`),
which all build on them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from kvstore.errors import ModelError
from kvstore.model.compute.cache import LayerKV, PreallocatedCache, new_buffers

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


@dataclass(frozen=True)
class Stop:
    """How a batch decodes: a row stops at its first EOS (``eos``), or once its text contains one
    of ``strings`` (the token that completes it is kept, as Hugging Face's ``stop_strings`` does);
    ``steps``: how decode steps run (see :func:`greedy_sample`)."""

    eos: bool = True
    strings: tuple[str, ...] = ()
    steps: str = "dynamic"  # one of STEPS (kvstore.model.compute.static for the fixed-shape ones)

    def hit(self, adapter: ModelHandle, ids: Sequence[int]) -> bool:
        """Whether generated ``ids`` (a row so far) end the row."""
        if self.eos and ids and ids[-1] in adapter.eos_ids:
            return True
        if self.strings:
            text = adapter.tokenizer.decode(list(ids), skip_special_tokens=False)
            return any(s in text for s in self.strings)
        return False


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA (or other accelerator) out-of-memory error, or the CPU allocator's failure."""
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def right_padded(pad_id: int, seqs: Sequence[Sequence[int]], width: int | None = None):
    """``(input_ids, mask)`` on the host for token-id lists laid out from slot 0: ids ``[B, L]``
    (``L`` the longest) padded with ``pad_id``, mask ``[B, width or L]`` set over each row's tokens."""
    L = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width or L), dtype=torch.long)
    for r, ids in enumerate(seqs):
        input_ids[r, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        mask[r, : len(ids)] = 1
    return input_ids, mask


@torch.inference_mode()
def prefill(adapter: ModelHandle, batch: Sequence[Sequence[int]]) -> list[LayerKV]:
    """Run the model over a batch of token-id lists (right-padded together); per row, the
    per-layer ``(keys, values)`` ``[kv_heads, n_i, head_dim]`` of its own tokens only (views).

    A batch longer than ``adapter.prefill_piece`` runs in pieces of that many positions on top of a
    preallocated cache (chunked prefill), so activations and attention scratch grow with the
    piece, not the context; the cache is written in place."""
    lengths = [len(ids) for ids in batch]
    B, L = len(batch), max(lengths)
    dev = adapter.device
    input_ids, mask = right_padded(adapter.pad_id, batch)
    piece = adapter.prefill_piece
    chunked = bool(piece) and L > piece and adapter.path.supports("chunked_prefill")
    # pieces write into buffers allocated once; one forward keeps the tensors the model returns
    cache: Any = DynamicCache()
    if chunked:
        cache = PreallocatedCache(new_buffers(adapter.kv_shapes(), B, L, adapter.dtype, dev), 0)
    step = piece if chunked else L
    input_ids, mask = input_ids.to(dev), mask.to(dev)
    for a in range(0, L, step):
        b = min(L, a + step)
        adapter.model(
            input_ids=input_ids[:, a:b],
            attention_mask=mask[:, :b],
            position_ids=torch.arange(a, b, device=dev).expand(B, b - a),
            **{adapter.layout.cache_arg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
    layers: list[Any] = list(cache.layers)
    if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
        raise ModelError(
            f"{type(adapter.model).__name__} returned no attention cache; kvstore needs an attention KV cache"
        )
    return [tuple((layer.keys[i, :, :n], layer.values[i, :, :n]) for layer in layers) for i, n in enumerate(lengths)]


def batches(
    order: Sequence[int], lengths: Sequence[int], batch_size: int, max_batch_tokens: int | None
) -> Iterator[list[int]]:
    """Consecutive runs of ``order`` of at most ``batch_size`` rows and ``max_batch_tokens``
    padded tokens (rows x longest)."""
    batch: list[int] = []
    for idx in order:
        longest = max([lengths[j] for j in batch] + [lengths[idx]])
        if batch and (len(batch) >= batch_size or (max_batch_tokens and longest * (len(batch) + 1) > max_batch_tokens)):
            yield batch
            batch = []
        batch.append(idx)
    if batch:
        yield batch


def row_length(adapter: ModelHandle, row: torch.Tensor, stop: Stop) -> int:
    """Tokens of a generated row up to and including the one that stopped it (all of them if none did)."""
    ids = row.tolist()
    for j in range(len(ids)):
        if stop.hit(adapter, ids[: j + 1]):
            return j + 1
    return len(ids)


def greedy_loop(
    adapter: ModelHandle, cache, mask, logits, next_pos, first_slot, N, stop: Stop, return_scores, step=None
):
    """Greedy decoding from the logits of each row's last prompt token. Slot ``first_slot + t``
    holds generated token ``t`` at position ``next_pos + t``. ``step(tokens, t)``, if given,
    runs the model on each row's token ``t`` instead and returns the next logits."""
    B = logits.shape[0]
    dev = logits.device
    cache_kw = {adapter.layout.cache_arg: cache}
    tokens = torch.full((B, N), adapter.pad_id, dtype=torch.long, device=dev)
    scores: list[torch.Tensor] | None = [] if return_scores else None
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    eos = torch.tensor(sorted(adapter.eos_ids), dtype=torch.long, device=dev) if adapter.eos_ids else None
    for t in range(N):
        if scores is not None:
            scores.append(logits.float().cpu())
        nxt = logits.argmax(dim=-1)
        nxt = torch.where(done, torch.full_like(nxt, adapter.pad_id), nxt)
        tokens[:, t] = nxt
        if stop.eos and eos is not None:
            done |= torch.isin(nxt, eos)
        if stop.strings:
            rows = tokens[:, : t + 1].tolist()
            for r in range(B):
                if not bool(done[r]) and stop.hit(adapter, rows[r]):
                    done[r] = True
        if (stop.eos or stop.strings) and bool(done.all()):
            break
        if t == N - 1:
            break
        if step is not None:
            logits = step(nxt, t)
            continue
        out = adapter.model(
            input_ids=nxt[:, None],
            attention_mask=mask[:, : first_slot + t + 1],
            position_ids=(next_pos + t)[:, None],
            **cache_kw,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]
    tokens = tokens.cpu()
    per_row = [torch.stack([s[r] for s in scores]) for r in range(B)] if scores is not None else [None] * B
    return tokens, per_row


__all__ = ["Stop", "batches", "greedy_loop", "is_out_of_memory", "prefill", "row_length"]
