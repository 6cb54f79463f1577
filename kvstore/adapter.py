"""The Adapter: prefill contexts into a store, then answer questions from the stored caches.

Layouts (B rows, exactness depends on them):

* **Prefill** (build): contexts are *right*-padded. Real tokens sit at slots ``0..n-1`` with
  positions ``0..n-1``, so causal attention never lets them see a pad and every pad query still
  has real keys to attend to (a fully masked row turns into NaN under eager fp64 attention, and
  ``0 * NaN`` would poison real rows). Each row's KV is sliced back to its ``n`` real tokens, so a
  stored entry does not depend on its batch-mates.
* **Cached decode**: stored contexts are *left*-padded to the batch's longest ``P`` (pads are zero
  KV, masked), questions are left-padded to the longest ``Q`` and placed after the contexts, then
  ``N`` generated tokens follow: ``[pad | context_i | pad | question_i | new tokens]``. Explicit
  ``position_ids`` continue each row at its own context length (``c_i + j``); without them every row
  would continue at ``P``. The KV buffers are preallocated for ``P + Q + N`` slots, so no decode
  step copies the cache (``DynamicCache`` concatenates, copying it every step).
* **Reference decode** (``use_cache=False``): context + question ids of each row right-padded in
  one sequence, the same preallocated cache, logits taken at each row's last real token.

The two decode paths share the greedy loop and differ in layout, so agreement between them is a
real check of masks and positions.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from kvstore.errors import ContextTooLongError, ModelError
from kvstore.keys import cache_key, model_fingerprint
from kvstore.store import Entry, KVStore

Progress = Callable[[int, int], None]  # (items done since last call, tokens done since last call)
TextOrIds = str | Sequence[int]
DEFAULT_RESERVE_TOKENS = 256


def _label(labels: Sequence[str] | None, i: int) -> str:
    """How errors name row ``i``: the caller's label (e.g. ``file.jsonl:12``) or ``row i``."""
    return labels[i] if labels is not None else f"row {i}"


class PreallocatedLayer(DynamicLayer):
    """A cache layer over preallocated ``[B, kv_heads, capacity, head_dim]`` buffers.

    ``update`` writes the new keys/values in place and returns views of the filled prefix, so a
    decode step costs only the new tokens (DynamicLayer concatenates: a full copy per step)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self._kbuf, self._vbuf = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.length = length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # buffers exist from the start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self._kbuf.shape[-2]:
            raise RuntimeError(f"preallocated cache holds {self._kbuf.shape[-2]} slots; step needs {end}")
        self._kbuf[:, :, self.length : end].copy_(key_states)
        self._vbuf[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class PreallocatedCache(DynamicCache):
    """A ``DynamicCache`` whose layers are :class:`PreallocatedLayer` (built from buffers)."""

    def __init__(self, buffers: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int):
        Cache.__init__(self, layers=[PreallocatedLayer(k, v, length) for k, v in buffers])


@dataclass
class BuildReport:
    """What :meth:`Adapter.generate_kv_cache` did. Sizes are bytes; times are seconds."""

    contexts: int = 0  # contexts given (with duplicates)
    distinct: int = 0
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


@dataclass
class SampleResult:
    """Tokens from :meth:`Adapter.greedy_sample` with ``return_details=True``.

    ``tokens``: ``[n_rows, num_new_tokens]`` int64; after a row's EOS the rest is ``fill_id``.
    ``scores``: per step ``[n_rows, vocab]`` float32 logits (only with ``return_scores``).
    ``cache_hit``: per row, whether its context came from the store.
    ``prefill_tokens_computed``: context tokens run through the model (each missing context once
    per batch; with ``use_cache=False``, every row's context). ``prefill_tokens_saved``: context
    tokens the no-cache path would have computed and this run did not.
    """

    tokens: torch.Tensor
    lengths: list[int]
    cache_hit: list[bool]
    scores: list[torch.Tensor] | None = None
    prefill_tokens_saved: int = 0
    prefill_tokens_computed: int = 0


class _Writer:
    """Encodes and writes entries on a background thread so that storing overlaps compute."""

    def __init__(self, store: KVStore, report: BuildReport | None):
        self.store, self.report = store, report
        self.q: queue.Queue = queue.Queue(maxsize=2)
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
                r.raw_bytes += sum(2 * k.numel() * k.element_size() for k, _ in entry.layers) + 8 * entry.n_tokens
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


class Adapter:
    """Wraps a Hugging Face causal LM and its tokenizer.

    ``Adapter(model, tokenizer)`` takes any loaded model; :meth:`from_pretrained` loads one by name
    (default: the bundled SmolLM2-135M-Instruct). The model is put in eval mode.
    ``reserve_tokens``: positions kept free for question and answer when limiting contexts.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        name: str | None = None,
        weight_files: Sequence = (),
        fingerprint: str | None = None,
        reserve_tokens: int = DEFAULT_RESERVE_TOKENS,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._weight_files = tuple(weight_files)
        self.reserve_tokens = reserve_tokens
        self._fingerprint = fingerprint
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None)
        if getattr(cfg, "sliding_window", None) and any(
            t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["sliding_attention"])
        ):
            self.sliding_window = cfg.sliding_window
        else:
            self.sliding_window = None
        eos = getattr(tokenizer, "eos_token_id", None)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {i for i in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])) if i is not None}
        self.eos_ids: frozenset[int] = frozenset(ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id: int = pad if pad is not None else (eos if eos is not None else 0)

    @classmethod
    def from_pretrained(
        cls,
        name: str | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        attn_implementation: str = "sdpa",
    ) -> Adapter:
        """Load a model by name: ``None`` (bundled SmolLM2-135M-Instruct), a hub id, a local
        directory or a ``.gguf`` file. Raises ModelNotFoundError / ModelError."""
        from kvstore.models import load_model

        loaded = load_model(name, dtype=dtype, device=device, attn_implementation=attn_implementation)
        return cls(loaded.model, loaded.tokenizer, name=loaded.name, weight_files=loaded.weight_files)

    # -- identity -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def fingerprint(self) -> str:
        """The model fingerprint (computed on first use, memoized by weight-file identity)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model, weight_files=self._weight_files)
        return self._fingerprint

    def key(self, context_ids: Sequence[int]) -> str:
        """The store key of a tokenized context for this model and dtype."""
        return cache_key(self.fingerprint, self.dtype, context_ids)

    # -- tokenization ---------------------------------------------------------------------------
    def encode_context(self, context: TextOrIds, *, special_tokens: bool = True) -> list[int]:
        """Token ids of a context: with the model's own special tokens (BOS where it uses one).
        A list of ints is taken as ids already."""
        if not isinstance(context, str):
            return [int(t) for t in context]
        return list(self.tokenizer(context, add_special_tokens=special_tokens)["input_ids"])

    def encode_question(self, question: TextOrIds) -> list[int]:
        """Token ids of a question: no special tokens (no second BOS mid-sequence)."""
        if not isinstance(question, str):
            return [int(t) for t in question]
        return list(self.tokenizer(question, add_special_tokens=False)["input_ids"])

    def context_limit(self, max_context_tokens: int | None = None) -> int | None:
        """Most tokens a context may have: ``max_context_tokens`` if given, else the model's
        positions minus :attr:`reserve_tokens` (room for a question and its answer). It depends
        on the context alone, so build and sample truncate (and key) a context the same way."""
        if max_context_tokens is not None:
            return max_context_tokens
        if self.max_positions:
            return max(1, self.max_positions - self.reserve_tokens)
        return None

    def _limit_context(self, ids: list[int], row: str, truncate: bool, max_context_tokens: int | None) -> list[int]:
        limit = self.context_limit(max_context_tokens)
        if limit is not None and len(ids) > limit:
            if not truncate:
                raise ContextTooLongError(
                    f"{row}: context has {len(ids)} tokens but at most {limit} fit "
                    f"(model positions {self.max_positions}, {self.reserve_tokens} kept for question and answer); "
                    "shorten it or ask for left-truncation (truncate=True / --truncate)"
                )
            ids = ids[len(ids) - limit :]
        if not ids:
            raise ContextTooLongError(f"{row}: context is empty after tokenization")
        return ids

    def _contexts_ids(self, contexts, special_tokens, truncate, max_context_tokens, labels) -> list[list[int]]:
        return [
            self._limit_context(self.encode_context(c, special_tokens=special_tokens), _label(labels, i), truncate, max_context_tokens)
            for i, c in enumerate(contexts)
        ]

    # -- prefill --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, batch: Sequence[Sequence[int]]) -> list[tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
        """Run the model over a batch of token-id lists (right-padded together); per row, the
        per-layer ``(keys, values)`` ``[kv_heads, n_i, head_dim]`` of its own tokens only."""
        lengths = [len(ids) for ids in batch]
        B, L = len(batch), max(lengths)
        dev = self.device
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            mask[i, : len(ids)] = 1
        cache = DynamicCache()
        self.model(
            input_ids=input_ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=torch.arange(L, device=dev).expand(B, L),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if len(cache.layers) == 0 or any(getattr(layer, "keys", None) is None for layer in cache.layers):
            raise ModelError(f"{type(self.model).__name__} returned no attention cache; kvstore needs an attention KV cache")
        return [tuple((layer.keys[i, :, :n], layer.values[i, :, :n]) for layer in cache.layers) for i, n in enumerate(lengths)]

    def _batches(self, order: list[int], lengths: list[int], batch_size: int, max_batch_tokens: int | None):
        batch: list[int] = []
        for idx in order:
            longest = max([lengths[j] for j in batch] + [lengths[idx]])
            if batch and (len(batch) >= batch_size or (max_batch_tokens and longest * (len(batch) + 1) > max_batch_tokens)):
                yield batch
                batch = []
            batch.append(idx)
        if batch:
            yield batch

    def generate_kv_cache(
        self,
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
    ) -> BuildReport:
        """Prefill every distinct context not yet in ``store`` and store its KV cache.

        Contexts are tokenized with the model's special tokens (``special_tokens=False`` when the
        text already contains them, as a rendered chat template does), deduplicated by key, sorted
        by length and run in batches of up to ``batch_size`` rows and ``max_batch_tokens`` padded
        tokens. Encoding and writing happen on a background thread. Contexts longer than
        :meth:`context_limit` are an error.

        ``labels`` name the rows in error messages (default ``row i``).

        Raises ContextTooLongError (naming the row) unless ``truncate`` is set, which keeps the
        last tokens of a context that is too long, or ``skip_errors`` is set, which counts the row
        in ``report.failed`` (with its message in ``report.errors``) and builds the others.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        t_start = time.perf_counter()
        report = BuildReport(contexts=len(contexts))
        ids: list[list[int]] = []
        for i, c in enumerate(contexts):
            try:
                ids.append(
                    self._limit_context(self.encode_context(c, special_tokens=special_tokens), _label(labels, i), truncate, max_context_tokens)
                )
            except ContextTooLongError as exc:
                if not skip_errors:
                    raise
                report.errors.append(str(exc))
                ids.append([])
        report.keys = [self.key(x) if x else "" for x in ids]
        first: dict[str, int] = {}
        for i, k in enumerate(report.keys):
            if k:
                first.setdefault(k, i)
        report.failed = sum(1 for x in ids if not x)
        report.distinct = len(first)
        todo = [i for k, i in first.items() if not store.is_intact(k)]  # corrupt entries are rebuilt
        report.skipped = report.distinct - len(todo)
        if progress and report.skipped:
            progress(report.skipped, 0)
        lengths = [len(x) for x in ids]
        order = sorted(todo, key=lambda i: lengths[i])
        writer = _Writer(store, report)
        try:
            for batch in self._batches(order, lengths, batch_size, max_batch_tokens):
                rows = self.prefill([ids[i] for i in batch])
                for i, layers in zip(batch, rows):
                    writer.put(Entry(report.keys[i], self.fingerprint, self.name, torch.as_tensor(ids[i]), layers))
                report.tokens += sum(lengths[i] for i in batch)
                if progress:
                    progress(len(batch), sum(lengths[i] for i in batch))
        finally:
            try:
                writer.close()
            finally:
                report.seconds = time.perf_counter() - t_start
        return report

    # -- decoding -------------------------------------------------------------------------------
    def greedy_sample(
        self,
        contexts: Sequence[TextOrIds],
        questions: Sequence[TextOrIds],
        num_new_tokens: int = 20,
        *,
        use_cache: bool = True,
        store: KVStore | None = None,
        batch_size: int = 8,
        stop_at_eos: bool = True,
        special_tokens: bool = True,
        truncate: bool = False,
        max_context_tokens: int | None = None,
        return_details: bool = False,
        return_scores: bool = False,
        labels: Sequence[str] | None = None,
        progress: Progress | None = None,
    ) -> torch.Tensor | SampleResult:
        """Greedy answers to ``questions[i]`` about ``contexts[i]``.

        Returns ``[n_rows, num_new_tokens]`` int64 token ids (a :class:`SampleResult` with
        ``return_details``). A row that produced EOS keeps it and is filled with the pad id
        (``self.pad_id``) after it when ``stop_at_eos``; decoding stops once every row has.

        ``use_cache=True`` reads each context's KV from ``store`` (computing, storing and using
        from memory the ones that are missing; without a store everything is computed in memory).
        ``use_cache=False`` is the reference: context and question run through the model together.
        Both give the same tokens (exactly in float64; in float32 up to rounding near ties).
        """
        if len(contexts) != len(questions):
            raise ValueError(f"{len(contexts)} contexts but {len(questions)} questions")
        if num_new_tokens < 1 or batch_size < 1:
            raise ValueError("num_new_tokens and batch_size must be at least 1")
        q_ids = [self.encode_question(q) for q in questions]
        c_ids = self._contexts_ids(contexts, special_tokens, truncate, max_context_tokens, labels)
        n = len(c_ids)
        if self.max_positions:
            for i in range(n):
                if len(c_ids[i]) + len(q_ids[i]) + num_new_tokens > self.max_positions:
                    raise ContextTooLongError(
                        f"{_label(labels, i)}: context ({len(c_ids[i])}) + question ({len(q_ids[i])}) + {num_new_tokens} new tokens "
                        f"exceed the model's {self.max_positions} positions; use a shorter question, fewer new tokens or a lower max_context_tokens"
                    )
        out = torch.full((n, num_new_tokens), self.pad_id, dtype=torch.long)
        lengths = [0] * n
        hits = [False] * n
        scores: list[torch.Tensor] | None = [torch.empty(0)] * n if return_scores else None
        saved = computed = 0
        keys = [self.key(c) for c in c_ids] if use_cache else [""] * n
        # cluster rows of equal contexts, then by length, to share loads and waste little padding
        order = sorted(range(n), key=lambda i: (len(c_ids[i]), keys[i], i))
        writer = _Writer(store, None) if (use_cache and store is not None and not store.readonly) else None
        try:
            for start in range(0, n, batch_size):
                rows = order[start : start + batch_size]
                if use_cache:
                    tokens, step_scores, row_hits = self._decode_cached(
                        [c_ids[i] for i in rows], [q_ids[i] for i in rows], [keys[i] for i in rows],
                        num_new_tokens, store, writer, stop_at_eos, return_scores,
                    )
                    for i, hit in zip(rows, row_hits):
                        hits[i] = hit
                    missing = {keys[i]: len(c_ids[i]) for i, h in zip(rows, row_hits) if not h}
                    computed += sum(missing.values())
                    saved += sum(len(c_ids[i]) for i in rows) - sum(missing.values())
                else:
                    tokens, step_scores = self._decode_reference(
                        [c_ids[i] + q_ids[i] for i in rows], num_new_tokens, stop_at_eos, return_scores
                    )
                    computed += sum(len(c_ids[i]) for i in rows)
                for j, i in enumerate(rows):
                    out[i] = tokens[j]
                    lengths[i] = self._row_length(tokens[j], stop_at_eos)
                    if scores is not None:
                        scores[i] = step_scores[j]
                if progress:
                    progress(len(rows), sum(len(c_ids[i]) + len(q_ids[i]) for i in rows))
        finally:
            if writer is not None:
                writer.close()
        if not return_details:
            return out
        return SampleResult(out, lengths, hits, scores, saved, computed)

    def _row_length(self, row: torch.Tensor, stop_at_eos: bool) -> int:
        if stop_at_eos:
            for j, t in enumerate(row.tolist()):
                if t in self.eos_ids:
                    return j + 1
        return int(row.numel())

    def _new_buffers(self, B: int, T: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Uninitialized per-layer KV buffers ``[B, kv_heads, T, head_dim]`` on the model's device."""
        dev, dt = self.device, self.dtype
        return [
            (torch.empty((B, h, T, dk), dtype=dt, device=dev), torch.empty((B, h, T, dv), dtype=dt, device=dev))
            for h, dk, dv in self._kv_shapes()
        ]

    def _kv_shapes(self) -> list[tuple[int, int, int]]:
        """Per layer (kv_heads, key head_dim, value head_dim), from one tiny forward if needed."""
        if getattr(self, "_shapes", None) is None:
            layers = self.prefill([[self.pad_id]])[0]
            self._shapes = [(k.shape[0], k.shape[-1], v.shape[-1]) for k, v in layers]
        return self._shapes

    @torch.inference_mode()
    def _decode_cached(self, c_ids, q_ids, keys, N, store, writer, stop_at_eos, return_scores):
        B = len(c_ids)
        c_len = [len(c) for c in c_ids]
        q_len = [len(q) for q in q_ids]
        P, Q = max(c_len), max(q_len)
        if Q == 0:
            raise ValueError("every question needs at least one token")
        T = P + Q + N
        dev = self.device
        shapes = self._kv_shapes()
        bufs = self._new_buffers(B, T)
        rows_of: dict[str, list[int]] = {}
        for r, k in enumerate(keys):
            rows_of.setdefault(k, []).append(r)
        hits = [False] * B
        missing: list[str] = []
        for k, rs in rows_of.items():
            c = c_len[rs[0]]
            got = False
            if store is not None:
                with store.open_entry(k) as view:
                    if view is not None and self._fits(view, c_ids[rs[0]], shapes):
                        r0 = rs[0]
                        for li, (kb, vb) in enumerate(bufs):
                            kr, vr = view.layer(li)
                            kr.copy_into(kb[r0, :, P - c : P])
                            vr.copy_into(vb[r0, :, P - c : P])
                        got = True
            if got:
                for r in rs:
                    hits[r] = True
            else:
                missing.append(k)
        if missing:
            rows = self.prefill([c_ids[rows_of[k][0]] for k in missing])
            for k, layers in zip(missing, rows):
                r0, c = rows_of[k][0], c_len[rows_of[k][0]]
                for (kb, vb), (kl, vl) in zip(bufs, layers):
                    kb[r0, :, P - c : P].copy_(kl)
                    vb[r0, :, P - c : P].copy_(vl)
                if writer is not None:
                    writer.put(Entry(k, self.fingerprint, self.name, torch.as_tensor(c_ids[r0]), layers))
        for k, rs in rows_of.items():
            r0, c = rs[0], c_len[rs[0]]
            for kb, vb in bufs:
                kb[r0, :, : P - c].zero_()  # pads must be finite: masked, but 0 * NaN would still poison
                vb[r0, :, : P - c].zero_()
                for r in rs[1:]:
                    kb[r, :, :P].copy_(kb[r0, :, :P])
                    vb[r, :, :P].copy_(vb[r0, :, :P])
        cache = PreallocatedCache(bufs, P)
        mask = torch.zeros((B, T), dtype=torch.long)
        pos = torch.empty((B, Q), dtype=torch.long)
        input_ids = torch.full((B, Q), self.pad_id, dtype=torch.long)
        for r in range(B):
            c, q = c_len[r], q_len[r]
            mask[r, P - c : P] = 1
            mask[r, P + Q - q : P + Q] = 1
            pos[r] = c  # pad slots: any in-range position, they are masked
            pos[r, Q - q :] = torch.arange(c, c + q)
            input_ids[r, Q - q :] = torch.as_tensor(q_ids[r], dtype=torch.long)
        mask[:, P + Q :] = 1
        mask = mask.to(dev)
        out = self.model(
            input_ids=input_ids.to(dev),
            attention_mask=mask[:, : P + Q],
            position_ids=pos.to(dev),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        next_pos = torch.tensor([c + q for c, q in zip(c_len, q_len)], device=dev)
        tokens, scores = self._greedy_loop(cache, mask, out.logits[:, -1], next_pos, P + Q, N, stop_at_eos, return_scores)
        return tokens, scores, hits

    def _fits(self, view, ids: Sequence[int], shapes) -> bool:
        """A stored entry must be this model's, in its dtype, of these tokens, in the layout it
        produces (else: treat as a miss). The key already says all that; the entry must agree, so
        that a misfiled or forged entry never feeds another model's tensors to this one."""
        header = view.header
        return (
            header.n_tokens == len(ids)
            and header.model == self.fingerprint
            and header.dtype == str(self.dtype).removeprefix("torch.")
            and header.n_layers == len(shapes)
            and all(s == (header.kv_heads, header.head_dim, header.head_dim) for s in shapes)
            and view.records["token_ids"].materialize().tolist() == list(ids)
        )

    @torch.inference_mode()
    def _decode_reference(self, full_ids, N, stop_at_eos, return_scores):
        B = len(full_ids)
        lens = [len(x) for x in full_ids]
        L = max(lens)
        T = L + N
        dev = self.device
        bufs = self._new_buffers(B, T)
        for kb, vb in bufs:
            kb.zero_()
            vb.zero_()
        cache = PreallocatedCache(bufs, 0)
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for r, ids in enumerate(full_ids):
            input_ids[r, : lens[r]] = torch.as_tensor(ids, dtype=torch.long)
            mask[r, : lens[r]] = 1
        mask[:, L:] = 1
        mask = mask.to(dev)
        out = self.model(
            input_ids=input_ids.to(dev),
            attention_mask=mask[:, :L],
            position_ids=torch.arange(L, device=dev).expand(B, L),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=torch.tensor([[n - 1] for n in lens], device=dev),
        )
        next_pos = torch.tensor(lens, device=dev)
        return self._greedy_loop(cache, mask, out.logits[:, -1], next_pos, L, N, stop_at_eos, return_scores)

    def _greedy_loop(self, cache, mask, logits, next_pos, first_slot, N, stop_at_eos, return_scores):
        """Greedy decoding from the logits of each row's last prompt token. Slot ``first_slot + t``
        holds generated token ``t`` at position ``next_pos + t``."""
        B = logits.shape[0]
        dev = logits.device
        tokens = torch.full((B, N), self.pad_id, dtype=torch.long, device=dev)
        scores = [] if return_scores else None
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=dev) if self.eos_ids else None
        for t in range(N):
            if scores is not None:
                scores.append(logits.float().cpu())
            nxt = logits.argmax(dim=-1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            tokens[:, t] = nxt
            if stop_at_eos and eos is not None:
                done |= torch.isin(nxt, eos)
                if bool(done.all()):
                    break
            if t == N - 1:
                break
            out = self.model(
                input_ids=nxt[:, None],
                attention_mask=mask[:, : first_slot + t + 1],
                position_ids=(next_pos + t)[:, None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1]
        tokens = tokens.cpu()
        per_row = [torch.stack([s[r] for s in scores]) for r in range(B)] if scores is not None else [None] * B
        return tokens, per_row

    # -- convenience ----------------------------------------------------------------------------
    def decode(self, tokens: torch.Tensor | Sequence[int]) -> str:
        """Text of one row of generated ids, up to (not including) its first EOS."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        for j, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[:j]
                break
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def kv_bytes_per_token(self) -> int:
        """Uncompressed KV bytes one context token takes for this model and dtype."""
        return sum(h * (dk + dv) for h, dk, dv in self._kv_shapes()) * self.dtype.itemsize


__all__ = ["Adapter", "BuildReport", "PreallocatedCache", "SampleResult"]
