"""The quality gate of the lossy codecs, on a user's own model and text: how far a codec's cache
moves the model from its lossless cache.

For each row (a context, and what follows it: a question, or for plain text the context's last
token) the context is prefilled once (the lossless keys and values, :meth:`Adapter.prefill`), then
the model answers greedily from that cache: the **lossless answer** (``new_tokens`` tokens, no stop
at EOS). Each codec then round-trips the cache through its stored bytes (encoded in chunks of
``chunk_tokens`` as a store writes them, unpacked and decoded by the codec's own reader) and is
measured four ways:

* **next-token KL and top-1**: the lossless answer teacher-forced from the codec's cache; at every
  answer step ``KL(lossless || codec)`` of the next-token distributions (natural log, mean over
  steps and rows) and whether their top tokens agree (as llama.cpp reports KV-quantization damage);
* **keys and values apart**: the same KL and top-1 with only the keys quantized (values lossless),
  then only the values;
* **answers**: the codec's own greedy answer: rows whose ``new_tokens`` tokens equal the lossless
  answer's, and the mean common prefix (tokens before the first difference, over ``new_tokens``);
* **bytes**: the codec's stored payload bytes over the float32 keys and values (and over the model
  dtype's), the cache's own positions only.

Nothing is written to a store. Dense (full-attention) models only; the pre-rotation codecs
(``int4r``, ``int8r``, ``ecq``) take the model's rotary parameters from the adapter.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import CodecError
from kvstore.model.family.families import describe
from kvstore.store.codecs import Codec, get_codec
from kvstore.store.codecs.hadamard import layer_refusal
from kvstore.store.codecs.prerope import needs_rotary, with_rotary
from kvstore.store.entry import kv_tensor_name

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [kv_heads, n, head_dim]
MODES = ("kv", "keys", "values")  # what a codec quantizes: both, only the keys, only the values


@dataclass(frozen=True)
class QualityRow:
    """One row of the gate: the context's token ids (the cache) and the ids fed after it (at least one)."""

    context: tuple[int, ...]
    follow: tuple[int, ...]


@dataclass(frozen=True)
class CodecQuality:
    """One codec against the lossless cache (see the module docstring). ``kl``/``top1`` by mode:
    ``kv`` (keys and values quantized), ``keys`` (only keys), ``values`` (only values)."""

    codec: str
    rows: int
    new_tokens: int
    identical: int
    common_prefix: float  # mean tokens before the first difference / new_tokens
    kl: dict[str, float] = field(default_factory=dict)
    top1: dict[str, float] = field(default_factory=dict)
    size_vs_f32: float = 0.0
    size_vs_dtype: float = 0.0
    kl_floor: float = 0.0  # the mean KL of the lossless cache through the same path: the gate's own noise

    def record(self) -> dict:
        """A JSON-serialisable dict of every field."""
        return {
            "codec": self.codec, "rows": self.rows, "new_tokens": self.new_tokens, "identical": self.identical,
            "common_prefix": self.common_prefix, "kl": dict(self.kl), "top1": dict(self.top1),
            "size_vs_f32": self.size_vs_f32, "size_vs_dtype": self.size_vs_dtype, "kl_floor": self.kl_floor,
        }  # fmt: skip


def rows_of(adapter: Any, contexts: Sequence[str], questions: Sequence[str | None]) -> list[QualityRow]:
    """Rows from texts: each context tokenized as a store keys it (the model's own special tokens, BOS
    where it uses one: :meth:`Adapter.encode_context`); the question (if any, no special tokens) fed
    after it. A row without a question feeds its context's last token. Raises ValueError for a
    context of fewer than 2 tokens."""
    out = []
    for i, (c, q) in enumerate(zip(contexts, questions)):
        ids = adapter.encode_context(c)
        follow = adapter.encode_question(q) if q else []
        if not follow:
            ids, follow = ids[:-1], ids[-1:]
        if len(ids) < 1:
            raise ValueError(f"row {i}: the context has fewer than 2 tokens")
        out.append(QualityRow(tuple(ids), tuple(follow)))
    return out


def stored_round_trip(codec: Codec, layers: Layers, chunk_tokens: int) -> tuple[Layers, int]:
    """``layers`` as ``codec`` gives them back from its stored bytes (encoded in chunks of
    ``chunk_tokens`` starting at position 0, each layer's keys and values in one payload per chunk),
    and the payload bytes. Raises CodecError for what the codec cannot store."""
    out: Layers = []
    total = 0
    q = codec.quantizer
    for i, (k, v) in enumerate(layers):
        n = k.shape[1]
        kk, vv = torch.empty_like(k, device="cpu"), torch.empty_like(v, device="cpu")
        kn, vn = kv_tensor_name(i, "keys"), kv_tensor_name(i, "values")  # as a store names them
        for a in range(0, n, chunk_tokens):
            b = min(n, a + chunk_tokens)
            parts = [(kn, k[:, a:b].cpu(), "keys"), (vn, v[:, a:b].cpu(), "values")]
            payload, params, raw = codec.encode(parts, {}, start=a)
            total += len(payload)
            records = codec.packing.unpack(payload, params, raw, threads=1).tensors
            q.reader("keys", kn, records, tuple(parts[0][1].shape), k.dtype, start=a).copy_into(kk[:, a:b])
            q.reader("values", vn, records, tuple(parts[1][1].shape), v.dtype, start=a).copy_into(vv[:, a:b])
        out.append((kk.to(k.device), vv.to(v.device)))
    return out, total


def _cache(layers: Layers) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k[None].clone(), v[None].clone(), i)
    return cache


def _forward(adapter: Any, cache: Any, n: int, ids: Sequence[int]) -> torch.Tensor:
    """Log-softmax ``[len(ids), vocab]`` (float32, CPU) of the model fed ``ids`` at positions ``n..``
    on top of ``cache`` (which grows by them)."""
    handle = adapter.handle
    dev = handle.device
    logits = handle.model(
        input_ids=torch.tensor([list(ids)], device=dev),
        position_ids=torch.arange(n, n + len(ids), device=dev)[None],
        **{handle.layout.cache_arg: cache},
        use_cache=True,
    ).logits[0]
    return logits.float().log_softmax(-1).cpu()


def _forced(adapter: Any, layers: Layers, ids: Sequence[int]) -> torch.Tensor:
    """:func:`_forward` of ``ids`` on a fresh cache of ``layers``."""
    return _forward(adapter, _cache(layers), layers[0][0].shape[1], ids)


def _greedy(adapter: Any, layers: Layers, follow: Sequence[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The greedy answer (``new_tokens`` ids, no stop at EOS) from ``layers`` after ``follow``, and
    the log-softmax each answer token was chosen from ``[new_tokens, vocab]``."""
    cache, n = _cache(layers), layers[0][0].shape[1]
    step = _forward(adapter, cache, n, follow)[-1:]
    n += len(follow)
    answer: list[int] = []
    dists = []
    for _ in range(new_tokens):
        dists.append(step)
        answer.append(int(step[0].argmax()))
        if len(answer) < new_tokens:
            step = _forward(adapter, cache, n, answer[-1:])
            n += 1
    return answer, torch.cat(dists)


# KL of two proper distributions is >= 0 (Gibbs); in float64 what cancels leaves at most ~1e-15 per
# step. A step below -KL_ROUNDING is not rounding: raised, never clamped away.
KL_ROUNDING = 1e-10


def _kl_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean ``KL(ref || got)`` over the steps (rows of log-probabilities ``[steps, vocab]``) and the
    share of steps whose top tokens agree. Computed in float64 on both renormalized (float32
    log-softmax sums to 1 only to within its rounding, which made near-equal distributions' KL come
    out negative); a step's KL within ``KL_ROUNDING`` below 0 counts as 0. Raises ArithmeticError
    for one further below (a bug, not rounding)."""
    p, q = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    if kl.numel() and float(kl.min()) < -KL_ROUNDING:
        raise ArithmeticError(f"KL of {float(kl.min()):.3g} < 0: the gate's arithmetic is wrong")
    return float(kl.clamp(min=0).mean()), float((ref.argmax(-1) == got.argmax(-1)).float().mean())


def unique_codecs(codecs: Sequence[str | Codec]) -> tuple[list[Codec], list[tuple[str, str]]]:
    """The codecs of ``codecs`` in order, each canonical codec (its ``spec``: ``int4h`` and
    ``int4h:32/64`` are one) once, and ``(as given, canonical spec)`` of each one dropped as a
    repeat. Raises CodecError for an unknown spec."""
    seen: set[str] = set()
    out, repeats = [], []
    for given in codecs:
        codec = get_codec(given)
        if codec.spec in seen:
            repeats.append((given if isinstance(given, str) else codec.spec, codec.spec))
            continue
        seen.add(codec.spec)
        out.append(codec)
    return out, repeats


def _gated_codecs(adapter: Any, codecs: Sequence[str | Codec]) -> list[Codec]:
    """The distinct codecs of ``codecs``, each with the model's rotary parameters; CodecError for a
    lossless one, one naming a layer the model lacks, or one that needs rotary parameters it has not."""
    chosen = []
    n_layers = len(describe(adapter.handle.model.config).kinds)
    for codec in unique_codecs(codecs)[0]:
        why = layer_refusal(codec, n_layers)
        if why is not None:
            raise CodecError(why)
        if codec.lossless:
            raise CodecError(f"{codec.spec} is lossless: the gate measures lossy codecs against it")
        if needs_rotary(codec) and adapter.rotary is None:
            raise CodecError(f"{codec.spec} needs the model's rotary parameters; this model has none kvstore undoes")
        chosen.append(with_rotary(codec, adapter.rotary))
    return chosen


def quality_gate(
    adapter: Any, rows: Sequence[QualityRow], codecs: Sequence[str | Codec], *, new_tokens: int = 16,
    chunk_tokens: int = 512, progress: Callable[[int], None] | None = None,
) -> list[CodecQuality]:  # fmt: skip
    """Measure each codec of ``codecs`` against the lossless cache on ``rows`` (module docstring);
    a codec given twice (the same canonical spec, :func:`unique_codecs`) is measured once. Every
    result carries ``kl_floor``, the reference path against itself. ``progress`` is called with 1 per
    row and codec done. Raises CodecError for a lossless or unknown codec or one the model cannot use
    (a layer it lacks: ``int4h:k8=L``), ModelError for a model kvstore cannot prefill."""
    chosen = _gated_codecs(adapter, codecs)
    per: dict[str, dict[str, Any]] = {
        c.spec: {"same": 0, "prefix": [], "kl": {m: [] for m in MODES}, "top1": {m: [] for m in MODES}, "bytes": 0}
        for c in chosen
    }
    raw_f32 = raw_dtype = 0
    floor: list[float] = []
    with torch.inference_mode():
        for row in rows:
            (layers,) = adapter.prefill([list(row.context)])
            layers = [(k, v) for k, v in layers]
            elems = sum(k.numel() + v.numel() for k, v in layers)
            raw_f32 += 4 * elems
            raw_dtype += elems * layers[0][0].element_size()
            ref_answer, ref_dist = _greedy(adapter, layers, row.follow, new_tokens)
            forced = list(row.follow) + ref_answer[:-1]
            start = len(row.follow) - 1
            # the floor: the lossless cache through the codecs' path (teacher-forced at once) against the
            # reference (step by step): not 0 where the two differ in rounding (bfloat16: 1e-4 and more)
            floor.append(_kl_top1(ref_dist, _forced(adapter, layers, forced)[start:])[0])
            for codec in chosen:
                acc = per[codec.spec]
                lossy, nbytes = stored_round_trip(codec, layers, chunk_tokens)
                acc["bytes"] += nbytes
                for mode in MODES:
                    mixed = [
                        (qk if mode != "values" else k, qv if mode != "keys" else v)
                        for (k, v), (qk, qv) in zip(layers, lossy)
                    ]
                    kl, top1 = _kl_top1(ref_dist, _forced(adapter, mixed, forced)[start:])
                    acc["kl"][mode].append(kl)
                    acc["top1"][mode].append(top1)
                answer, _ = _greedy(adapter, lossy, row.follow, new_tokens)
                same = next((j for j, (a, b) in enumerate(zip(ref_answer, answer)) if a != b), new_tokens)
                acc["same"] += same == new_tokens
                acc["prefix"].append(same / new_tokens)
                if progress is not None:
                    progress(1)
    return [
        CodecQuality(
            codec=spec,
            rows=len(rows),
            new_tokens=new_tokens,
            identical=acc["same"],
            common_prefix=statistics.mean(acc["prefix"]) if rows else 0.0,
            kl={m: statistics.mean(v) for m, v in acc["kl"].items()} if rows else {},
            top1={m: statistics.mean(v) for m, v in acc["top1"].items()} if rows else {},
            size_vs_f32=acc["bytes"] / raw_f32 if raw_f32 else 0.0,
            size_vs_dtype=acc["bytes"] / raw_dtype if raw_dtype else 0.0,
            kl_floor=statistics.mean(floor) if rows else 0.0,
        )  # fmt: skip
        for spec, acc in per.items()
    ]


__all__ = ["CodecQuality", "QualityRow", "quality_gate", "rows_of", "stored_round_trip", "unique_codecs"]
