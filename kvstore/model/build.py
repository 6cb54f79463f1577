"""Building caches: prefill contexts in batches and store each one's keys/values.

Prefill layout: contexts are *right*-padded. Real tokens sit at slots ``0..n-1`` with positions
``0..n-1``, so causal attention never lets them see a pad and every pad query still has real keys
to attend to (a fully masked row turns into NaN under eager fp64 attention, and ``0 * NaN`` would
poison real rows). Each row's KV is sliced back to its ``n`` real tokens, so a stored entry does
not depend on its batch-mates.

Encoding and writing run on a background thread (:class:`Writer`), so storing overlaps compute.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from kvstore.errors import ContextTooLongError, ModelError
from kvstore.progress import Progress
from kvstore.store.entry import Entry
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.model.adapter import Adapter, TextOrIds

LayerKV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values) [kv_heads, n, head_dim]
WRITER_QUEUE = 2  # entries waiting for the writer; bounds the memory a fast prefill can pile up


@dataclass
class BuildReport:
    """What :meth:`Adapter.generate_kv_cache` did. Sizes are bytes; times are seconds."""

    contexts: int = 0  # contexts given (with duplicates)
    distinct: int = 0  # in this shard
    other_shards: int = 0  # distinct contexts left to the other shards
    built: int = 0
    skipped: int = 0  # already in the store
    failed: int = 0
    tokens: int = 0  # tokens prefilled
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    store_seconds: float = 0.0  # encode + write, on the writer thread (overlaps compute)
    store_wait_seconds: float = 0.0  # time the compute thread waited for the writer
    errors: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # key of each given context, in input order

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "keys"}
        return d | {"ratio": round(self.ratio, 4), "tokens_per_second": round(self.tokens_per_second, 1)}


class Writer:
    """Encodes and writes entries on a background thread so that storing overlaps compute.
    Errors are re-raised on the caller's thread (at the next ``put`` or at ``close``)."""

    def __init__(self, store: KVStore, report: BuildReport | None, maxsize: int = WRITER_QUEUE):
        self.store, self.report = store, report
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kvstore-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            entry = self.q.get()
            if entry is None:
                return
            if self.error is not None:
                continue
            t0 = time.perf_counter()
            try:
                blob = self.store.encode(entry)
                self.store.put_bytes(entry.key, blob)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                self.error = exc
                continue
            if self.report is not None:
                r = self.report
                r.stored_bytes += len(blob)
                r.raw_bytes += entry.kv_bytes + 8 * entry.n_tokens
                r.store_seconds += time.perf_counter() - t0
                r.built += 1

    def put(self, entry: Entry) -> None:
        self._check()
        t0 = time.perf_counter()
        self.q.put(entry)
        if self.report is not None:
            self.report.store_wait_seconds += time.perf_counter() - t0

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        t0 = time.perf_counter()
        self.q.put(None)
        self.thread.join()
        if self.report is not None:
            self.report.store_wait_seconds += time.perf_counter() - t0
        self._check()


@torch.inference_mode()
def prefill(adapter: Adapter, batch: Sequence[Sequence[int]]) -> list[LayerKV]:
    """Run the model over a batch of token-id lists (right-padded together); per row, the
    per-layer ``(keys, values)`` ``[kv_heads, n_i, head_dim]`` of its own tokens only (views)."""
    lengths = [len(ids) for ids in batch]
    B, L = len(batch), max(lengths)
    dev = adapter.device
    input_ids = torch.full((B, L), adapter.pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, ids in enumerate(batch):
        input_ids[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1
    cache = DynamicCache()
    adapter.model(
        input_ids=input_ids.to(dev),
        attention_mask=mask.to(dev),
        position_ids=torch.arange(L, device=dev).expand(B, L),
        past_key_values=cache,
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


def in_shard(key: str, i: int, n: int) -> bool:
    """Whether shard ``i`` of ``n`` builds ``key``: its first 16 hex digits, read as a number,
    are ``i`` modulo ``n`` (keys are sha256 hex, so shards get near-equal shares)."""
    return int(key[:16], 16) % n == i


def build_caches(
    adapter: Adapter,
    contexts: Sequence[TextOrIds],
    store: KVStore,
    *,
    batch_size: int = 8,
    max_batch_tokens: int | None = 16384,
    special_tokens: bool = True,
    truncate: bool = False,
    max_context_tokens: int | None = None,
    skip_errors: bool = False,
    labels: Sequence[str] | None = None,
    progress: Progress | None = None,
    shard: tuple[int, int] | None = None,
) -> BuildReport:
    """Prefill every distinct context not yet (intact) in ``store`` and store its KV cache.
    See :meth:`kvstore.model.adapter.Adapter.generate_kv_cache`."""
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard {shard[0]}/{shard[1]}: need 0 <= I < N")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    t_start = time.perf_counter()
    report = BuildReport(contexts=len(contexts))
    ids: list[list[int]] = []
    for i, c in enumerate(contexts):
        try:
            ids.append(
                adapter.context_ids(
                    c,
                    special_tokens=special_tokens,
                    truncate=truncate,
                    max_context_tokens=max_context_tokens,
                    label=adapter.row_label(labels, i),
                )
            )
        except ContextTooLongError as exc:
            if not skip_errors:
                raise
            report.errors.append(str(exc))
            ids.append([])
    report.keys = [adapter.key(x) if x else "" for x in ids]
    first: dict[str, int] = {}
    for i, k in enumerate(report.keys):
        if k:
            first.setdefault(k, i)
    if shard is not None:
        mine = {k: i for k, i in first.items() if in_shard(k, *shard)}
        report.other_shards = len(first) - len(mine)
        first = mine
    report.failed = sum(1 for x in ids if not x)
    report.distinct = len(first)
    todo = [i for k, i in first.items() if not store.is_intact(k)]  # corrupt entries are rebuilt
    report.skipped = report.distinct - len(todo)
    if progress and report.skipped + report.other_shards:
        progress(report.skipped + report.other_shards, 0)  # nothing to do for these here
    lengths = [len(x) for x in ids]
    order = sorted(todo, key=lambda i: lengths[i])
    writer = Writer(store, report)
    try:
        for batch in batches(order, lengths, batch_size, max_batch_tokens):
            rows = prefill(adapter, [ids[i] for i in batch])
            for i, layers in zip(batch, rows):
                writer.put(adapter.entry(report.keys[i], ids[i], layers))
            report.tokens += sum(lengths[i] for i in batch)
            if progress:
                progress(len(batch), sum(lengths[i] for i in batch))
    finally:
        try:
            writer.close()
        finally:
            report.seconds = time.perf_counter() - t_start
    return report


__all__ = ["BuildReport", "LayerKV", "Writer", "batches", "build_caches", "in_shard", "prefill"]
