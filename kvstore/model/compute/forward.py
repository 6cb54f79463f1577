"""The forward pieces every cache path shares: prefill, batching and the greedy loop.

Plain functions over a :class:`~kvstore.model.handle.ModelHandle` (its model, ids and
dtype/device): prefill, a context's rest on top of its prefix (:func:`extend`), batching and the
greedy loop. They import nothing from the stages, paths or pipelines, which all build on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from kvstore.errors import ModelError
from kvstore.model.compute.cache import LayerKV, PreallocatedCache, new_buffers

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.handle import ModelHandle


@dataclass(frozen=True)
class Decoding:
    """How a batch decodes: ``new_tokens`` greedy tokens per row; a row stops at its first EOS
    (``eos``), or once its text contains one of ``strings`` (the token that completes it is kept,
    as Hugging Face's ``stop_strings`` does); ``steps``: how decode steps run (``dynamic``,
    ``static``, ``compiled``: :mod:`kvstore.model.compute.static`); ``scores``: keep each step's
    logits."""

    new_tokens: int = 1
    eos: bool = True
    strings: tuple[str, ...] = ()
    steps: str = "dynamic"
    scores: bool = False

    @property
    def fixed(self) -> bool:
        """Fixed-shape (static or compiled) steps."""
        return self.steps != "dynamic"

    def hit(self, handle: ModelHandle, ids: Sequence[int]) -> bool:
        """Whether generated ``ids`` (a row so far) end the row."""
        if self.eos and ids and ids[-1] in handle.eos_ids:
            return True
        if self.strings:
            text = handle.tokenizer.decode(list(ids), skip_special_tokens=False)
            return any(s in text for s in self.strings)
        return False


@dataclass(frozen=True)
class DecodeSlots:
    """Where a batch's generated tokens go: generated token ``t`` of row ``r`` sits in slot
    ``first_slot + t`` of ``cache`` at position ``next_pos[r] + t``; ``mask`` is the batch's
    ``[B, slots]`` attention mask (1 on every slot a token may attend to once written). ``step(tokens,
    t)``, if given, runs the model on each row's token ``t`` instead (fixed-shape steps, or the
    families' slots) and returns the next logits."""

    cache: Any
    mask: torch.Tensor | None
    next_pos: torch.Tensor | None
    first_slot: int
    step: Callable[[torch.Tensor, int], torch.Tensor] | None = None


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA (or other accelerator) out-of-memory error, or the CPU allocator's failure."""
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def loaded_ahead(future: Future) -> Any:
    """The result of a load run ahead on a worker, or None when it ran out of memory (the batch then
    loads itself, and halves on its own out-of-memory error)."""
    try:
        return future.result()
    except Exception as exc:
        if is_out_of_memory(exc):
            return None
        raise


def in_halves(run: Callable[[list[int]], list[Any]], items: list[int], handle: ModelHandle) -> list[Any]:
    """``run(items)``; on an out-of-memory error, ``run`` on each half of ``items`` in turn (and
    so on, down to one item): the one retry of sampling and scoring, whose results do not depend
    on the batch."""
    try:
        return run(items)
    except Exception as exc:
        if not is_out_of_memory(exc) or len(items) == 1:
            raise
        del exc
        if handle.device.type == "cuda":
            torch.cuda.empty_cache()
        half = len(items) // 2
        return in_halves(run, items[:half], handle) + in_halves(run, items[half:], handle)


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
def prefill(handle: ModelHandle, batch: Sequence[Sequence[int]]) -> list[LayerKV]:
    """Run the model over a batch of token-id lists (right-padded together); per row, the
    per-layer ``(keys, values)`` ``[kv_heads, n_i, head_dim]`` of its own tokens only (views).

    A batch longer than ``handle.prefill_piece`` runs in pieces of that many positions on top of a
    preallocated cache (chunked prefill), so activations and attention scratch grow with the
    piece, not the context; the cache is written in place."""
    lengths = [len(ids) for ids in batch]
    B, L = len(batch), max(lengths)
    dev = handle.device
    input_ids, mask = right_padded(handle.pad_id, batch)
    piece = handle.prefill_piece
    chunked = bool(piece) and L > piece and handle.layout.dense  # windowed and recurrent layers: one forward
    # pieces write into buffers allocated once; one forward keeps the tensors the model returns
    cache: Any = DynamicCache()
    if chunked:
        cache = PreallocatedCache(new_buffers(handle.kv_shapes(), B, L, handle.dtype, dev), 0)
    step = piece if chunked else L
    input_ids, mask = input_ids.to(dev), mask.to(dev)
    for a in range(0, L, step):
        b = min(L, a + step)
        handle.model(
            input_ids=input_ids[:, a:b],
            attention_mask=mask[:, :b],
            position_ids=torch.arange(a, b, device=dev).expand(B, b - a),
            **{handle.layout.cache_arg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
    layers: list[Any] = list(cache.layers)
    if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
        raise ModelError(
            f"{type(handle.model).__name__} returned no attention cache; kvstore needs an attention KV cache"
        )
    return [tuple((layer.keys[i, :, :n], layer.values[i, :, :n]) for layer in layers) for i, n in enumerate(lengths)]


@torch.inference_mode()
def extend(handle: ModelHandle, prefixes: Sequence[LayerKV], rests: Sequence[Sequence[int]]) -> list[LayerKV]:
    """Run ``rests[i]`` (token ids) on top of ``prefixes[i]`` (per layer ``(keys, values)``
    ``[kv_heads, L_i, head_dim]`` of the context's first ``L_i >= 1`` positions), all rows in one
    forward: prefixes left-padded to the longest, rests left-padded after them, explicit
    positions. Returns per row the per-layer keys/values of the rest's tokens (views)."""
    B = len(prefixes)
    lengths = [prefix[0][0].shape[1] for prefix in prefixes]
    sizes = [len(r) for r in rests]
    L, S = max(lengths), max(sizes)
    dev = handle.device
    bufs = new_buffers(handle.kv_shapes(), B, L + S, handle.dtype, dev)
    mask = torch.zeros((B, L + S), dtype=torch.long)
    pos = torch.empty((B, S), dtype=torch.long)
    input_ids = torch.full((B, S), handle.pad_id, dtype=torch.long)
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
    handle.model(
        input_ids=input_ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
        **{handle.layout.cache_arg: cache}, use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    return [tuple((kb[i, :, L + S - s :], vb[i, :, L + S - s :]) for kb, vb in bufs) for i, s in enumerate(sizes)]


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


def row_length(handle: ModelHandle, row: torch.Tensor, decoding: Decoding) -> int:
    """Tokens of a generated row up to and including the one that stopped it (all of them if none did)."""
    ids = row.tolist()
    for j in range(len(ids)):
        if decoding.hit(handle, ids[: j + 1]):
            return j + 1
    return len(ids)


def greedy_loop(
    handle: ModelHandle, logits: torch.Tensor, slots: DecodeSlots, decoding: Decoding
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Greedy decoding from the logits of each row's last prompt token, into ``slots``. Returns
    ``(tokens [B, new_tokens] int64 on the host, per row [steps, vocab] float32 logits or None)``."""
    B, N = logits.shape[0], decoding.new_tokens
    dev = logits.device
    cache_kw = {handle.layout.cache_arg: slots.cache}
    tokens = torch.full((B, N), handle.pad_id, dtype=torch.long, device=dev)
    scores: list[torch.Tensor] | None = [] if decoding.scores else None
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    eos = torch.tensor(sorted(handle.eos_ids), dtype=torch.long, device=dev) if handle.eos_ids else None
    for t in range(N):
        if scores is not None:
            scores.append(logits.float().cpu())
        nxt = logits.argmax(dim=-1)
        nxt = torch.where(done, torch.full_like(nxt, handle.pad_id), nxt)
        tokens[:, t] = nxt
        if decoding.eos and eos is not None:
            done |= torch.isin(nxt, eos)
        if decoding.strings:
            rows = tokens[:, : t + 1].tolist()
            for r in range(B):
                if not bool(done[r]) and decoding.hit(handle, rows[r]):
                    done[r] = True
        if (decoding.eos or decoding.strings) and bool(done.all()):
            break
        if t == N - 1:
            break
        if slots.step is not None:
            logits = slots.step(nxt, t)
            continue
        assert slots.mask is not None and slots.next_pos is not None
        out = handle.model(
            input_ids=nxt[:, None],
            attention_mask=slots.mask[:, : slots.first_slot + t + 1],
            position_ids=(slots.next_pos + t)[:, None],
            **cache_kw,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]
    host = tokens.cpu()
    per_row: list[torch.Tensor | None] = [None] * B
    if scores is not None:
        per_row = [torch.stack([s[r] for s in scores]) for r in range(B)]
    return host, per_row


__all__ = [
    "DecodeSlots",
    "Decoding",
    "batches",
    "extend",
    "greedy_loop",
    "in_halves",
    "loaded_ahead",
    "is_out_of_memory",
    "prefill",
    "right_padded",
    "row_length",
]
