"""The per-layer sweep behind ``kvstore quality --sweep``: how much each layer's keys and each
layer's values hurt the model when quantized, on the user's own model and rows, and the ``kvh``
spec that spends a byte budget where it hurts most, measured.

1. **Sensitivity.** For each row (as :func:`kvstore.quality.quality_gate` takes them) the context is
   prefilled and the model's greedy answer teacher-forced once on the lossless cache; then the
   cache is round-tripped through ``kvh`` at the probe widths (keys ``probe_keys`` bits, values
   ``probe_values`` bits, stored bytes as a store writes them), and for every layer and role apart
   (only layer L's keys quantized, every other tensor lossless; then only its values) the mean
   next-token KL against the lossless answer is measured: ``2 x layers`` teacher-forced passes
   per row.
2. **Allocation.** Each layer's keys and values get a width from ``key_widths`` / ``value_widths``:
   starting from the narrowest, the upgrade with the largest predicted KL drop per extra bit is
   taken while the spec's bits per value (``kvh``'s own accounting, the tail included, times the
   probe's measured over nominal bits on these rows: short contexts pay their sinks and partial
   groups, the packing takes a little off) stay within ``budget x 32`` (bytes against float32).
   The predicted KL of a width ``W`` is the probe's KL times ``4 ** (probe - W)`` (each bit halves
   the rounding step and quarters its squared error): a model, used only to rank; what is
   reported is measured.
3. **Measurement.** One candidate per tail in ``tails`` (the tail's 8-bit tokens paid from the
   budget), each a plain ``kvh`` spec (``build --codec`` takes it), measured with the quality gate
   on the same rows: bytes, KL, top-1, identical answers; a candidate whose measured bytes exceed
   the budget is allocated again with its own measured over nominal bits and measured too. The
   recommendation is the candidate with
   the lowest measured KL among those whose measured bytes are within the budget (the smallest, if
   none is).

Rows used to choose a spec are the rows it is measured on: for an honest figure, measure the
recommended spec again with ``kvstore quality`` on rows the sweep did not see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import CodecError
from kvstore.quality import CodecQuality, QualityRow, _forced, _greedy, _kl_top1, quality_gate, stored_round_trip
from kvstore.store.codecs import get_codec
from kvstore.store.codecs.asym import AsymQuantizer, default_group

ROLES = ("keys", "values")


@dataclass(frozen=True)
class SweepOptions:
    """What the sweep tries: the ``budget`` (stored bytes over float32 bytes), the widths each
    layer's keys and values may take, the probe widths sensitivity is measured at, the tails tried
    (``kvh``'s ``t=``), and the gate's ``new_tokens`` and ``chunk_tokens``."""

    budget: float = 0.21
    key_widths: tuple[int, ...] = (3, 4, 5, 6, 8)
    value_widths: tuple[int, ...] = (2, 3, 4, 5, 8)
    probe_keys: int = 4
    probe_values: int = 3
    tails: tuple[int, ...] = (0, 64)
    new_tokens: int = 16
    chunk_tokens: int = 512


@dataclass(frozen=True)
class LayerDamage:
    """One layer's measured KL with only its keys (``keys``) or only its values (``values``)
    quantized at the probe widths, the rest lossless (mean over rows and answer steps)."""

    layer: int
    keys: float
    values: float


@dataclass(frozen=True)
class SweepResult:
    """The sweep's findings: per-layer damage, the measured candidates, and the recommended spec
    (a plain ``kvh`` codec spec, ``best``)."""

    budget: float
    damage: tuple[LayerDamage, ...]
    candidates: tuple[CodecQuality, ...]
    best: str
    bits: dict[str, float] = field(default_factory=dict)  # nominal bits per value of each candidate
    overhead: float = 1.0  # the probe's stored bits over its nominal bits on these rows

    def record(self) -> dict:
        """A JSON-serialisable dict of every field."""
        return {
            "budget": self.budget, "best": self.best, "bits": dict(self.bits), "overhead": self.overhead,
            "damage": [{"layer": d.layer, "keys": d.keys, "values": d.values} for d in self.damage],
            "candidates": [c.record() for c in self.candidates],
        }  # fmt: skip


def layer_damage(adapter: Any, rows: Sequence[QualityRow], options: SweepOptions,
                 progress: Callable[[int], None] | None = None) -> tuple[list[LayerDamage], int, float]:  # fmt: skip
    """Step 1 of the module docstring, the model's head_dim, and the probe's stored bits per value
    on these rows over its nominal bits per value (``kvh``'s accounting: full 512-token chunks):
    what the rows' lengths (sinks, partial groups) and the packing make of the nominal figure.
    ``progress`` is called with 1 per row. Raises CodecError for probe widths ``kvh`` cannot store
    on this model."""
    probe = get_codec(f"kvh:{options.probe_keys}/{options.probe_values}")
    sums: list[list[float]] = []
    head_dim, stored, elems = 0, 0, 0
    with torch.inference_mode():
        for row in rows:
            (layers,) = adapter.prefill([list(row.context)])
            layers = [(k, v) for k, v in layers]
            if not sums:
                sums, head_dim = [[0.0, 0.0] for _ in layers], int(layers[0][0].shape[-1])
            answer, ref = _greedy(adapter, layers, row.follow, options.new_tokens)
            forced, start = list(row.follow) + answer[:-1], len(row.follow) - 1
            lossy, nbytes = stored_round_trip(probe, layers, options.chunk_tokens)
            stored, elems = stored + nbytes, elems + sum(k.numel() + v.numel() for k, v in layers)
            for i in range(len(layers)):
                for j in range(2):
                    mixed = list(layers)
                    mixed[i] = (lossy[i][0], layers[i][1]) if j == 0 else (layers[i][0], lossy[i][1])
                    sums[i][j] += _kl_top1(ref, _forced(adapter, mixed, forced)[start:])[0]
            if progress is not None:
                progress(1)
    n = max(1, len(rows))
    nominal = spec_bits(probe.spec, head_dim, len(sums)) if sums else 1.0
    return (
        [LayerDamage(i, k / n, v / n) for i, (k, v) in enumerate(sums)],
        head_dim,
        8 * stored / max(1, elems) / nominal,
    )


def allocate(damage: Sequence[LayerDamage], options: SweepOptions, head_dim: int, tail: int = 0,
             overhead: float = 1.0) -> str:  # fmt: skip
    """Step 2 of the module docstring: the ``kvh`` spec (with ``t=tail``) whose predicted KL is
    greedily lowest within ``options.budget`` (its bits per value by ``kvh``'s own accounting times
    ``overhead``, the probe's measured over nominal bits). Raises CodecError when even the narrowest
    widths exceed the budget."""
    n = len(damage)
    widths = {"keys": sorted(options.key_widths), "values": sorted(options.value_widths)}
    probe = {"keys": options.probe_keys, "values": options.probe_values}
    chosen = {(d.layer, r): widths[r][0] for d in damage for r in ROLES}
    hurt = {(d.layer, r): getattr(d, r) for d in damage for r in ROLES}
    limit = options.budget * 32 / overhead

    def bits(plan: dict[tuple[int, str], int]) -> float:
        return spec_bits(plan_spec(plan, n, tail), head_dim, n)

    if bits(chosen) > limit:
        least = bits(chosen) * overhead / 32
        raise CodecError(
            f"no kvh spec fits a budget of {options.budget} x float32 (the narrowest takes {least:.3f} on these rows)"
        )
    while True:
        best, best_gain = None, 0.0
        now = bits(chosen)
        for key, w in chosen.items():
            up = [x for x in widths[key[1]] if x > w]
            if not up:
                continue
            trial = {**chosen, key: up[0]}
            after = bits(trial)
            if after > limit:
                continue
            cost = after - now
            gain = hurt[key] * (4.0 ** (probe[key[1]] - w) - 4.0 ** (probe[key[1]] - up[0])) / max(cost, 1e-9)
            if gain > best_gain:
                best, best_gain = trial, gain
        if best is None:
            return plan_spec(chosen, n, tail)
        chosen = best


def plan_spec(plan: dict[tuple[int, str], int], n_layers: int, tail: int = 0) -> str:
    """The ``kvh`` spec of a per-layer plan ``{(layer, role): bits}``: each role's most common width
    as the base (in its default groups), the other layers listed (``kW=``/``vW=``)."""
    base, lists = {}, []
    for role, tag in (("keys", "k"), ("values", "v")):
        ws = [plan[i, role] for i in range(n_layers)]
        base[role] = max(sorted(set(ws), reverse=True), key=ws.count)
        for w in sorted(set(ws) - {base[role]}, reverse=True):
            lists.append(f"{tag}{w}=" + ".".join(str(i) for i in range(n_layers) if plan[i, role] == w))
    kb, vb = base["keys"], base["values"]
    head = f"kvh:{kb}/{vb}:{default_group('keys', kb)}/{default_group('values', vb)}"
    return ":".join([head, *([f"t={tail}"] if tail else []), *lists])


def spec_bits(spec: str, head_dim: int, n_layers: int) -> float:
    """``kvh``'s bits per value of ``spec`` on a model of ``n_layers`` layers of ``head_dim``."""
    q = get_codec(spec).quantizer
    assert isinstance(q, AsymQuantizer)
    return q.bits_per_value(head_dim, 32, n_layers=n_layers)


def sweep(adapter: Any, rows: Sequence[QualityRow], options: SweepOptions = SweepOptions(),
          progress: Callable[[int], None] | None = None) -> SweepResult:  # fmt: skip
    """The whole sweep (module docstring) on ``rows``. ``progress`` is called with 1 per row
    measured (``len(rows) * (1 + len(options.tails))``, and as many again when a candidate is
    refitted). Raises CodecError when no spec fits the budget or the model's head_dim cannot be
    stored, ModelError for a model kvstore cannot prefill."""
    if not rows:
        raise ValueError("the sweep needs at least one row")
    damage, head_dim, overhead = layer_damage(adapter, rows, options, progress)
    n = len(damage)
    tails = {allocate(damage, options, head_dim, t, overhead): t for t in options.tails}
    measured = _measure(adapter, rows, list(tails), options, progress)
    # a candidate over the budget: allocated again with its own stored over nominal bits (wider codes
    # pack worse than the probe's), then measured too
    refit = []
    for q, spec in zip(measured, list(tails)):
        if q.size_vs_f32 > options.budget:
            try:
                again = allocate(
                    damage, options, head_dim, tails[spec], q.size_vs_f32 * 32 / spec_bits(spec, head_dim, n)
                )
            except CodecError:
                continue
            if again not in tails:
                tails[again] = tails[spec]
                refit.append(again)
    if refit:
        measured += _measure(adapter, rows, refit, options, progress)
    fits = [q for q in measured if q.size_vs_f32 <= options.budget]
    best = min(fits, key=lambda q: q.kl["kv"]) if fits else min(measured, key=lambda q: q.size_vs_f32)
    bits = {q.codec: spec_bits(s, head_dim, n) for q, s in zip(measured, list(tails))}
    return SweepResult(options.budget, tuple(damage), tuple(measured), best.codec, bits, overhead)


def _measure(adapter: Any, rows: Sequence[QualityRow], specs: list[str], options: SweepOptions,
             progress: Callable[[int], None] | None) -> list[CodecQuality]:  # fmt: skip
    return quality_gate(adapter, rows, specs, new_tokens=options.new_tokens, chunk_tokens=options.chunk_tokens,
                        progress=progress)  # fmt: skip


__all__ = ["LayerDamage", "SweepOptions", "SweepResult", "allocate", "layer_damage", "spec_bits", "plan_spec", "sweep"]
