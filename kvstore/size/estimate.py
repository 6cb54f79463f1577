"""KV-cache size estimates from a model's shape, beside what a store actually holds.

::

    bytes per example = 2 (keys, values) x layers x kv_heads x head_dim x tokens x bytes per element

``kv_heads x head_dim`` is the hidden size only without grouped-query attention (Pythia); a GQA
model such as SmolLM2-135M (9 query heads, 3 KV heads) caches a third of that. Sliding-window
layers are capped at their window. State-space and hybrid models add a recurrent state per example
that does not grow with its length (``state_bytes``, included in the per-example bytes).
Rendering (tables, CSV, JSON, plots) is the CLI's business.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvstore import dtypes
from kvstore.size.shapes import PYTHIA, ModelShape, resolve_shape
from kvstore.units import human_bytes

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.summary import GroupStats

DEFAULT_SEQ_LEN = 2048
DEFAULT_EXAMPLES = 225
FORMULA = "2 (keys, values) x layers x kv_heads x head_dim x tokens x bytes per element"
PYTHIA_NOTE = (
    "Pythia configs declare torch_dtype float16, and transformers 5 on its own loads them so "
    '(dtype="auto"; transformers 4 loaded float32). kvstore runs models in float32 unless given '
    "--dtype (exactness is measured in float32), hence the float32 default here; the cache takes the "
    "dtype the model runs in, and --dtype all shows every width."
)
STATE_NOTE = (
    "state-space and hybrid models keep a recurrent state (convolution window and SSM state) per example "
    "whatever its length; it is included in the per-example bytes and shown as state/example (kvstore stores "
    "one at every chunk end of a context)."
)


def kv_bytes_per_token(shape: ModelShape, dtype: str = "float32") -> int:
    """Bytes one token adds to the cache while no sliding window is full."""
    return dtypes.kv_bytes(shape.kv_layers, shape.kv_heads, shape.head_dim, dtype)


def kv_bytes_per_example(shape: ModelShape, seq_len: int, dtype: str = "float32") -> int:
    """Bytes of one ``seq_len``-token example's cache (sliding layers capped at their window), its
    recurrent state included."""
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    kv = dtypes.kv_bytes(shape.cached_layer_tokens(seq_len), shape.kv_heads, shape.head_dim, dtype)
    return kv + shape.state_bytes(dtype)


@dataclass(frozen=True)
class SizeEstimate:
    """One model at one dtype: exact byte counts; ``*_str`` properties give binary units."""

    model: str
    dtype: str
    source: str
    n_layers: int
    kv_heads: int
    head_dim: int
    window: str
    seq_len: int
    examples: int
    bytes_per_token: int
    bytes_per_example: int
    bytes_dataset: int
    bytes_cumulative: int  # this model and every model before it in the list, same dtype
    state_bytes: int = 0  # recurrent state per example (in bytes_per_example), whatever its length
    codec: str = "none"  # the quantizer the estimate assumes (``none``: values stored as they are)
    bits_per_value: float = 0.0  # stored bits per key/value element under that quantizer

    @property
    def per_token_str(self) -> str:
        return human_bytes(self.bytes_per_token)

    @property
    def per_example_str(self) -> str:
        return human_bytes(self.bytes_per_example)

    @property
    def dataset_str(self) -> str:
        return human_bytes(self.bytes_dataset)

    @property
    def cumulative_str(self) -> str:
        return human_bytes(self.bytes_cumulative)


def _quantized(nbytes: int, bits_per_value: float, dtype: str) -> int:
    """``nbytes`` of ``dtype`` values stored at ``bits_per_value`` bits each."""
    return math.ceil(nbytes * bits_per_value / dtypes.bits(dtype))


def estimate_size(
    shapes: Sequence[ModelShape],
    seq_len: int = DEFAULT_SEQ_LEN,
    examples: int = DEFAULT_EXAMPLES,
    dtype_names: Sequence[str] = ("float32",),
    codec: str | None = None,
) -> list[SizeEstimate]:
    """Estimated KV-cache sizes, dtype by dtype, models in the order given (the cumulative column
    adds them up in that order). ``codec``: estimate as stored by that codec's quantizer (e.g.
    ``int8``: 8.5 bits per value); a packing (zstd) is lossless and data-dependent, so it is not
    estimated (``kvstore size --store`` measures it). Raises ValueError for a non-positive
    ``seq_len``/``examples`` and CodecError for an unknown codec."""
    if seq_len < 1 or examples < 1:
        raise ValueError(f"seq_len and examples must be positive, got {seq_len} and {examples}")
    quantizer = None
    if codec is not None:
        from kvstore.store.codecs import get_codec  # imports torch: only when a codec is asked for

        quantizer = get_codec(codec).quantizer
    rows = []
    for dtype in dict.fromkeys(dtypes.parse_kv(d) for d in dtype_names):
        total = 0
        for shape in shapes:
            bpv = (
                float(dtypes.bits(dtype))
                if quantizer is None
                else quantizer.bits_per_value(shape.head_dim, dtypes.bits(dtype), n_layers=shape.n_layers)
            )
            per_token = _quantized(kv_bytes_per_token(shape, dtype), bpv, dtype)
            state = shape.state_bytes(dtype)  # recurrent states are stored as they are, whatever the codec
            per_example = _quantized(kv_bytes_per_example(shape, seq_len, dtype) - state, bpv, dtype) + state
            total += per_example * examples
            rows.append(
                SizeEstimate(
                    model=shape.name,
                    dtype=dtype,
                    source=shape.source,
                    n_layers=shape.n_layers,
                    kv_heads=shape.kv_heads,
                    head_dim=shape.head_dim,
                    window=shape.window_str,
                    seq_len=seq_len,
                    examples=examples,
                    bytes_per_token=per_token,
                    bytes_per_example=per_example,
                    bytes_dataset=per_example * examples,
                    bytes_cumulative=total,
                    state_bytes=state,
                    codec=quantizer.spec if quantizer is not None else "none",
                    bits_per_value=bpv,
                )
            )
    return rows


def measure_store(path: str, **store_options: Any) -> list[GroupStats]:
    """What a store holds per model name and dtype (read-only, headers only). ``store_options``
    go to :class:`kvstore.store.kvstore.KVStore` (e.g. ``cache_dir``). Raises the store's errors
    (e.g. StoreNotFoundError) when it cannot be opened."""
    from kvstore.store.kvstore import KVStore  # imports torch
    from kvstore.store.summary import summarize

    with KVStore(path, readonly=True, **store_options) as store:
        info = store.scan()
    return summarize(info, by=("model_name", "dtype"))


@dataclass(frozen=True)
class SizeReport:
    """Estimates for a list of models, and optionally what a store holds."""

    seq_len: int
    examples: int
    dtypes: tuple[str, ...]
    estimates: tuple[SizeEstimate, ...]
    notes: tuple[str, ...] = ()
    store: str | None = None
    measured: tuple[GroupStats, ...] | None = None
    codec: str | None = None  # the quantizer spec the estimates assume (None: values as they are)

    def records(self) -> list[dict[str, Any]]:
        """One flat dict per row: ``kind`` ``estimated`` (then ``measured`` rows with a store)."""
        out = [{"kind": "estimated", **asdict(r)} for r in self.estimates]
        out += [{"kind": "measured", **m.as_record()} for m in self.measured or ()]
        return out


def size_report(
    models: Sequence[str] = (),
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    examples: int = DEFAULT_EXAMPLES,
    dtype_names: Sequence[str] = ("float32",),
    store: str | None = None,
    codec: str | None = None,
    store_options: Mapping[str, Any] | None = None,
) -> SizeReport:
    """Resolve ``models`` (none: the eight Pythia models), estimate their cache sizes and, with
    ``store`` (opened with ``store_options``), measure what that store holds. Raises
    ModelNotFoundError / ModelError for a model that cannot be resolved and the store's errors for
    a store that cannot be opened."""
    shapes = [resolve_shape(m) for m in models] if models else list(PYTHIA)
    names = tuple(dict.fromkeys(dtypes.parse_kv(d) for d in dtype_names)) or ("float32",)
    notes = (
        [PYTHIA_NOTE] if any(s.name.startswith("pythia-") and s.source.startswith("built-in") for s in shapes) else []
    )
    if any(s.state for s in shapes):
        notes.append(STATE_NOTE)
    estimates = tuple(estimate_size(shapes, seq_len, examples, names, codec))
    return SizeReport(
        seq_len=seq_len,
        examples=examples,
        dtypes=names,
        estimates=estimates,
        notes=tuple(notes),
        store=store,
        measured=tuple(measure_store(store, **(store_options or {}))) if store is not None else None,
        codec=estimates[0].codec if codec is not None and estimates else None,
    )


__all__ = [
    "DEFAULT_EXAMPLES",
    "DEFAULT_SEQ_LEN",
    "FORMULA",
    "SizeEstimate",
    "SizeReport",
    "estimate_size",
    "kv_bytes_per_example",
    "kv_bytes_per_token",
    "measure_store",
    "size_report",
]
