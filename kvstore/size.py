"""How big a model's KV cache is: estimated from its shape, and measured in a store.

::

    bytes per example = 2 (keys, values) x layers x kv_heads x head_dim x tokens x bytes per element

``kv_heads x head_dim`` is the hidden size only without grouped-query attention (Pythia); a GQA
model such as SmolLM2-135M (9 query heads, 3 KV heads) caches a third of that. A sliding-window
layer keeps at most ``window`` tokens (transformers' ``DynamicSlidingWindowLayer`` keeps
``window - 1``, so the cap here is an upper bound by one token per such layer).

Shapes come from the eight built-in Pythia models (no I/O), a ``.gguf`` file (its metadata is
read here directly: ``gguf.GGUFReader`` parses every tensor and tokenizer array and takes ~10 s
on the bundled 98 MB file), a directory holding ``config.json``, or a hub id's ``config.json``.
None of these imports torch, except a config that sets a sliding window without saying which
layers use it: only transformers' config class knows that pattern (Gemma 2 alternates, Gemma 3
slides five layers in six), so it is derived there.

Nothing here imports click or matplotlib at module level; :func:`plot_report` imports matplotlib
when called.
"""
from __future__ import annotations

import csv
import functools
import io
import json
import mmap
import os
import re
import struct
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError, ModelError, ModelNotFoundError
from kvstore.units import human_bytes

DEFAULT_SEQ_LEN = 2048
DEFAULT_EXAMPLES = 225

# Storage width of one cached element, in bits, so that sub-byte widths fit: a quantized codec
# registers its storage width here once it exists.
DTYPE_BITS: dict[str, int] = {"float32": 32, "float16": 16, "bfloat16": 16, "float64": 64}
# What ``--dtype all`` means: the widths a model is run and cached in.
INFERENCE_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "fp64": "float64", "double": "float64"}

FORMULA = "2 (keys, values) x layers x kv_heads x head_dim x tokens x bytes per element"

PYTHIA_NOTE = (
    "Pythia configs declare torch_dtype float16, and transformers 5 on its own loads them so "
    '(dtype="auto"; transformers 4 loaded float32). kvstore runs models in float32 unless given '
    "--dtype (exactness is measured in float32), hence the float32 default here; the cache takes the "
    "dtype the model runs in, and --dtype all shows every width."
)


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What fixes the size of a model's KV cache.

    ``windows``: per layer, the most tokens that layer caches (``None`` = all of them, ``0`` = it
    caches none, e.g. a linear-attention layer); ``None`` when every layer caches every token.
    ``config_dtype``: the dtype the model's config declares, if it declares one.
    """

    name: str
    n_layers: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] | None = None
    source: str = "built-in"
    config_dtype: str | None = None

    def __post_init__(self) -> None:
        for field_ in ("n_layers", "kv_heads", "head_dim"):
            value = getattr(self, field_)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{self.name}: {field_} must be a positive integer, got {value!r}")
        if self.windows is not None and len(self.windows) != self.n_layers:
            raise ModelError(f"{self.name}: {len(self.windows)} layer windows for {self.n_layers} layers")

    @property
    def kv_layers(self) -> int:
        """Layers that cache keys and values."""
        if self.windows is None:
            return self.n_layers
        return sum(1 for w in self.windows if w != 0)

    @property
    def window_str(self) -> str:
        """``-`` without sliding layers, else e.g. ``4,096 on 21/42 layers``."""
        if self.windows is None:
            return "-"
        caps = sorted({w for w in self.windows if w})
        parts = [f"{w:,} on {sum(1 for x in self.windows if x == w)}/{self.n_layers} layers" for w in caps]
        none = sum(1 for w in self.windows if w == 0)
        if none:
            parts.append(f"no KV on {none}/{self.n_layers} layers")
        return "; ".join(parts) or "-"

    def cached_layer_tokens(self, seq_len: int) -> int:
        """Sum over layers of the tokens each layer caches for a ``seq_len``-token example."""
        if self.windows is None:
            return self.n_layers * seq_len
        return sum(seq_len if w is None else min(seq_len, w) for w in self.windows)


def _pythia(size: str, layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(
        name=f"pythia-{size}",
        n_layers=layers,
        kv_heads=heads,  # no grouped-query attention: kv_heads x head_dim = hidden size
        head_dim=hidden // heads,
        source=f"built-in (EleutherAI/pythia-{size} config)",
        config_dtype="float16",
    )


# From the published configs (num_hidden_layers, hidden_size, num_attention_heads), smallest first.
PYTHIA: tuple[ModelShape, ...] = (
    _pythia("70m", 6, 512, 8),
    _pythia("160m", 12, 768, 12),
    _pythia("410m", 24, 1024, 16),
    _pythia("1b", 16, 2048, 8),
    _pythia("1.4b", 24, 2048, 16),
    _pythia("2.8b", 32, 2560, 32),
    _pythia("6.9b", 32, 4096, 32),
    _pythia("12b", 36, 5120, 40),
)
_PYTHIA_BY_NAME = {s.name: s for s in PYTHIA}

BUNDLED_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_ALIASES = {"default", "bundled", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}

# layer_types (transformers' names) -> how many tokens the layer caches
_FULL_LAYERS = {"full_attention", "indexed_attention", "hybrid"}
_SLIDING_LAYERS = {"sliding_attention", "hybrid_sliding", "reference_sliding_attention"}
_NO_KV_LAYERS = {"linear_attention", "conv", "dummy", "moe", "mlp"}


def _lookup(cfg: Any, *names: str) -> Any:
    for name in names:
        value = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _text_part(config: Any) -> Any:
    """The decoder's config of a composite (vision-language) config, else the config itself."""
    if isinstance(config, Mapping):
        if _lookup(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers") is None:
            text = config.get("text_config")
            if isinstance(text, Mapping):
                return text
        return config
    get_text = getattr(config, "get_text_config", None)
    return get_text(decoder=True) if callable(get_text) else config


def _dtype_of(cfg: Any) -> str | None:
    value = _lookup(cfg, "dtype", "torch_dtype")
    if value is None:
        return None
    value = str(value).removeprefix("torch.")
    return value if value in DTYPE_BITS else None


def _layer_windows(
    name: str, layer_types: Sequence[str] | None, n_layers: int, sliding: int | None, chunk: int | None
) -> tuple[int | None, ...] | None:
    if layer_types is None:
        # transformers' rule (cache_utils.get_layer_types_and_kwargs) when a config lists no types
        if sliding is not None:
            return (int(sliding),) * n_layers
        if chunk is not None:
            return (int(chunk),) * n_layers
        return None
    layer_types = list(layer_types)
    if len(layer_types) != n_layers:
        raise ModelError(f"{name}: config lists {len(layer_types)} layer_types for {n_layers} layers")
    caps: list[int | None] = []
    for kind in layer_types:
        if kind in _FULL_LAYERS:
            caps.append(None)
        elif kind in _SLIDING_LAYERS or kind == "chunked_attention":
            window = sliding if kind != "chunked_attention" else chunk
            if window is None:
                raise ModelError(f"{name}: config has {kind} layers but no window size; set sliding_window in its config")
            caps.append(int(window))
        elif kind in _NO_KV_LAYERS:
            caps.append(0)
        else:
            raise ModelError(f"{name}: layer type {kind!r} has no KV-size formula here; only full, sliding and chunked attention do")
    return None if all(c is None for c in caps) else tuple(caps)


def _config_with_transformers(config: Mapping[str, Any], name: str) -> Any:
    """Build transformers' config object from a config dict, which derives ``layer_types``."""
    model_type = config.get("model_type")
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    except (ImportError, ValueError, TypeError, KeyError) as exc:
        raise ModelError(
            f"{name}: its config sets a sliding window but no layer_types, and transformers cannot derive them "
            f"for model_type {model_type!r} ({exc}); add layer_types to its config.json"
        ) from None


def shape_from_config(config: Mapping[str, Any] | Any, name: str | None = None, source: str = "config") -> ModelShape:
    """The KV shape of a model from its config: a ``config.json`` dict or a transformers config.

    Reads layers, attention heads, KV heads (``num_key_value_heads``, defaulting to the attention
    heads; GPT-NeoX/GPT-2/Falcon spellings too), ``head_dim`` (default hidden / heads) and the
    sliding-window layout (``layer_types`` with ``sliding_window`` / ``attention_chunk_size``).
    Raises ModelError for configs this formula does not describe (e.g. multi-head latent attention).
    """
    name = name or str(_lookup(config, "name_or_path", "_name_or_path") or "model")
    cfg = _text_part(config)
    n_layers = _lookup(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    heads = _lookup(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads")
    hidden = _lookup(cfg, "hidden_size", "n_embd", "d_model")
    if n_layers is None or heads is None:
        raise ModelError(f"{name}: its config gives no layer count or attention-head count; is it a decoder language model?")
    if _lookup(cfg, "kv_lora_rank") is not None:
        raise ModelError(f"{name}: multi-head latent attention (kv_lora_rank) caches keys and values of different widths; not covered")
    kv_heads = _lookup(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
    if kv_heads is None:
        kv_heads = 1 if _lookup(cfg, "multi_query") else heads
    head_dim = _lookup(cfg, "head_dim")
    if head_dim is None:
        if hidden is None or hidden % heads:
            raise ModelError(f"{name}: its config gives no head_dim and hidden size {hidden} does not split into {heads} heads")
        head_dim = hidden // heads

    layer_types = _lookup(cfg, "layer_types")
    sliding = _lookup(cfg, "sliding_window")
    chunk = _lookup(cfg, "attention_chunk_size")
    if _lookup(cfg, "use_sliding_window") is False:  # Qwen2 family: the window is configured but off
        sliding = None
    if isinstance(config, Mapping) and layer_types is None and (sliding is not None or chunk is not None):
        return shape_from_config(_config_with_transformers(config, name), name=name, source=source)

    return ModelShape(
        name=name,
        n_layers=int(n_layers),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        windows=_layer_windows(name, layer_types, int(n_layers), sliding, chunk),
        source=source,
        config_dtype=_dtype_of(config) or _dtype_of(cfg),
    )


# -- GGUF -------------------------------------------------------------------------------------
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_ARRAY = 1 << 16  # read per-layer arrays; skip vocabularies and merges without decoding them


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3, either byte order), tensors not read.

    Arrays longer than 65,536 elements (vocabularies) are skipped and reported as ``None``.
    Raises ModelError when the file is not a readable GGUF file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse_gguf(mm, path)
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as exc:
        raise ModelError(f"{path} is not a readable GGUF file ({exc}); re-download or re-convert it") from None


def _parse_gguf(mm: mmap.mmap, path: Path) -> dict[str, Any]:
    if mm[:4] != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (no GGUF magic); pass a .gguf model file")
    end = "<"
    (version,) = struct.unpack_from("<I", mm, 4)
    if version & 0xFFFF == 0:  # written big-endian
        end = ">"
        (version,) = struct.unpack_from(">I", mm, 4)
    if version < 2:
        raise ModelError(f"{path} is GGUF version {version}; convert it with a current llama.cpp (version 2 or later)")
    _, n_kv = struct.unpack_from(end + "QQ", mm, 8)
    off = 24

    def string(off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(end + "Q", mm, off)
        off += 8
        if off + n > len(mm):
            raise ValueError("string runs past the end of the file")
        return bytes(mm[off : off + n]).decode("utf-8"), off + n

    def value(vtype: int, off: int, keep: bool = True) -> tuple[Any, int]:
        if vtype in _GGUF_SCALARS:
            fmt = end + _GGUF_SCALARS[vtype]
            return (struct.unpack_from(fmt, mm, off)[0] if keep else None), off + struct.calcsize(fmt)
        if vtype == _GGUF_STRING:
            if keep:
                return string(off)
            (n,) = struct.unpack_from(end + "Q", mm, off)
            return None, off + 8 + n
        if vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from(end + "IQ", mm, off)
            off += 12
            keep = keep and count <= _GGUF_MAX_ARRAY
            if etype in _GGUF_SCALARS:
                fmt = end + _GGUF_SCALARS[etype]
                size = struct.calcsize(fmt) * count
                if off + size > len(mm):
                    raise ValueError("array runs past the end of the file")
                items = list(struct.unpack_from(f"{end}{count}{_GGUF_SCALARS[etype]}", mm, off)) if keep else None
                return items, off + size
            items = [] if keep else None
            for _ in range(count):
                item, off = value(etype, off, keep)
                if keep:
                    items.append(item)
            return items, off
        raise ValueError(f"unknown value type {vtype}")

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, off = string(off)
        (vtype,) = struct.unpack_from(end + "I", mm, off)
        meta[key], off = value(vtype, off + 4)
    return meta


def shape_from_gguf(path: str | os.PathLike, name: str | None = None) -> ModelShape:
    """The KV shape of a GGUF model from ``{arch}.block_count``, ``.attention.head_count``,
    ``.attention.head_count_kv``, ``.attention.key_length`` (default embedding / heads) and the
    sliding-window keys. Raises ModelError when the metadata lacks them."""
    path = Path(path)
    name = name or path.name.removesuffix(".gguf")
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")

    def get(key: str) -> Any:
        return meta.get(f"{arch}.{key}")

    n_layers, heads = get("block_count"), get("attention.head_count")
    if not isinstance(arch, str) or n_layers is None or heads is None:
        raise ModelError(f"{path}: GGUF metadata gives no block_count or attention.head_count; is it a language model?")
    if get("attention.kv_lora_rank") is not None:
        raise ModelError(f"{name}: multi-head latent attention (kv_lora_rank) caches keys and values of different widths; not covered")
    if isinstance(heads, list):
        heads = max(heads)
    kv = get("attention.head_count_kv")
    kv = heads if kv is None else kv
    windows: list[int | None] | None = None
    if isinstance(kv, list):  # per layer; 0 = a layer without attention
        nonzero = {k for k in kv if k}
        if len(nonzero) != 1:
            raise ModelError(f"{name}: GGUF lists KV head counts {sorted(nonzero)} per layer; only one count per model is covered")
        windows = [None if k else 0 for k in kv]
        kv = nonzero.pop()
    key_len, value_len = get("attention.key_length"), get("attention.value_length")
    if key_len is not None and value_len is not None and key_len != value_len:
        raise ModelError(f"{name}: keys ({key_len}) and values ({value_len}) have different widths; not covered")
    head_dim = key_len
    if head_dim is None:
        hidden = get("embedding_length")
        if hidden is None or hidden % heads:
            raise ModelError(
                f"{path}: GGUF metadata gives no attention.key_length and embedding_length {hidden} does not split into {heads} heads"
            )
        head_dim = hidden // heads

    sliding = get("attention.sliding_window")
    if sliding:
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            slides = [bool(p) for p in pattern]
        elif isinstance(pattern, int) and pattern > 0:  # every pattern-th layer is global (llama.cpp, transformers)
            slides = [(i + 1) % pattern != 0 for i in range(n_layers)]
        else:
            raise ModelError(
                f"{name}: the GGUF gives a sliding window but not which layers use it; pass the model's hub id or config directory instead"
            )
        if len(slides) != n_layers:
            raise ModelError(f"{name}: sliding_window_pattern has {len(slides)} entries for {n_layers} layers")
        windows = [(0 if (windows and windows[i] == 0) else (int(sliding) if s else None)) for i, s in enumerate(slides)]
    if windows is not None and all(w is None for w in windows):
        windows = None
    return ModelShape(
        name=name,
        n_layers=int(n_layers),
        kv_heads=int(kv),
        head_dim=int(head_dim),
        windows=tuple(windows) if windows is not None else None,
        source=f"gguf: {path}",
    )


# -- names ------------------------------------------------------------------------------------
def _hub_config(repo_id: str) -> tuple[dict, str]:
    """``config.json`` of a hub model: from the local hub cache, else one plain request (no
    retries: huggingface_hub retries five times over ~25 s when offline)."""
    tried = ["the built-in names", "a local path"]
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        raise ModelNotFoundError(
            f"unknown model {repo_id!r}: not a built-in name and huggingface_hub is not installed to look it up; "
            "pass a directory holding its config.json"
        ) from None
    cached = try_to_load_from_cache(repo_id, "config.json")
    tried.append("the hub cache")
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text()), f"hub cache: {cached}"
    if not constants.HF_HUB_OFFLINE:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        tried.append("huggingface.co")
        try:
            response = get_session().get(hf_hub_url(repo_id, "config.json"), headers=build_hf_headers(), timeout=10, follow_redirects=True)
            if response.status_code == 200:
                return response.json(), f"hub: {repo_id}"
        except Exception:  # noqa: BLE001 - any network failure means "not found"; the message says so
            pass
    raise ModelNotFoundError(
        f"no config for {repo_id!r} (tried {', '.join(tried)}): use a built-in name (kvstore size lists them), "
        "a .gguf file, or a directory holding its config.json"
    )


@functools.lru_cache(maxsize=1)
def _bundled_shape() -> ModelShape:
    from kvstore.models import bundled_gguf_path  # light: imports no torch

    return shape_from_gguf(bundled_gguf_path(), name=BUNDLED_NAME)


def _normalise_hub_id(repo_id: str) -> str:
    return repo_id.lower().strip().rstrip("/")


def resolve_shape(name: str) -> ModelShape:
    """The KV shape of a model named any way kvstore accepts.

    In order: a built-in Pythia name (``pythia-70m``, ``EleutherAI/pythia-70m``, any case, with or
    without ``-deduped``); the bundled model (``default``, ``bundled``, ``smollm2-135m``); a
    ``.gguf`` file; a directory holding ``config.json`` (or that file); a hub id (its
    ``config.json`` from the hub cache or the hub). Raises ModelNotFoundError naming what was tried.
    """
    key = _normalise_hub_id(name)
    bare = re.sub(r"-deduped$", "", key.removeprefix("eleutherai/"))
    if bare in _PYTHIA_BY_NAME:
        return _PYTHIA_BY_NAME[bare]
    if key in _BUNDLED_ALIASES:
        return _bundled_shape()
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist; check the path")
        return shape_from_gguf(path)
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise ModelNotFoundError(f"directory {path} holds no config.json; point kvstore size at a model directory or a .gguf file")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"{config_file} is not readable JSON ({exc}); fix or re-download it") from None
        label = path.name if path.is_dir() else path.parent.name
        return shape_from_config(config, name=label or str(path), source=f"config: {config_file}")
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", name.strip()) and not path.exists():
        config, source = _hub_config(name.strip())
        return shape_from_config(config, name=name.strip(), source=source)
    raise ModelNotFoundError(
        f"unknown model {name!r}: not a built-in name (pythia-70m ... pythia-12b, default), a .gguf file, "
        "a directory with config.json, or a hub id (owner/name)"
    )


# --------------------------------------------------------------------------------------------
# Estimates
# --------------------------------------------------------------------------------------------
def normalize_dtype(dtype: str) -> str:
    """Canonical dtype name (``fp16`` -> ``float16``). Raises ModelError for unknown widths."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BITS:
        raise ModelError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BITS)} (or all)")
    return name


def _bytes(elements: int, dtype: str) -> int:
    return -(-elements * DTYPE_BITS[normalize_dtype(dtype)] // 8)


def kv_bytes_per_token(shape: ModelShape, dtype: str = "float32") -> int:
    """Bytes one token adds to the cache while no sliding window is full:
    ``2 x kv_layers x kv_heads x head_dim x bytes per element``."""
    return _bytes(2 * shape.kv_layers * shape.kv_heads * shape.head_dim, dtype)


def kv_bytes_per_example(shape: ModelShape, seq_len: int, dtype: str = "float32") -> int:
    """Bytes of one ``seq_len``-token example's cache (sliding layers capped at their window)."""
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    return _bytes(2 * shape.kv_heads * shape.head_dim * shape.cached_layer_tokens(seq_len), dtype)


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


def estimate_size(
    shapes: Sequence[ModelShape],
    seq_len: int = DEFAULT_SEQ_LEN,
    examples: int = DEFAULT_EXAMPLES,
    dtypes: Sequence[str] = ("float32",),
) -> list[SizeEstimate]:
    """Estimated KV-cache sizes, dtype by dtype, models in the order given (the cumulative column
    adds them up in that order). Raises ValueError for a non-positive ``seq_len``/``examples``."""
    if seq_len < 1 or examples < 1:
        raise ValueError(f"seq_len and examples must be positive, got {seq_len} and {examples}")
    rows = []
    for dtype in dict.fromkeys(normalize_dtype(d) for d in dtypes):
        total = 0
        for shape in shapes:
            per_example = kv_bytes_per_example(shape, seq_len, dtype)
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
                    bytes_per_token=kv_bytes_per_token(shape, dtype),
                    bytes_per_example=per_example,
                    bytes_dataset=per_example * examples,
                    bytes_cumulative=total,
                )
            )
    return rows


# --------------------------------------------------------------------------------------------
# Measured in a store
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredSize:
    """What a store holds for one (model name, dtype): totals over its entries, and the stored
    bytes per token against the estimate from the entries' own shapes (ratio < 1: the codec saves)."""

    model: str
    dtype: str
    codec: str
    entries: int
    tokens: int
    estimated_bytes: int  # sum over entries of the formula at each entry's length
    raw_bytes: int  # uncompressed payloads (KV + token ids + safetensors headers)
    stored_bytes: int  # what the entries occupy in the store, headers and checksums included

    @property
    def estimated_per_token(self) -> float:
        return self.estimated_bytes / self.tokens if self.tokens else 0.0

    @property
    def stored_per_token(self) -> float:
        return self.stored_bytes / self.tokens if self.tokens else 0.0

    @property
    def ratio(self) -> float:
        """Stored bytes / estimated bytes."""
        return self.stored_bytes / self.estimated_bytes if self.estimated_bytes else 0.0

    @property
    def stored_str(self) -> str:
        return human_bytes(self.stored_bytes)


def summarize_entries(entries: Iterable[Any]) -> list[StoredSize]:
    """Group scanned entries (``kvstore.store.EntryInfo``) by (model_name, dtype), in order of first
    appearance."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for e in entries:
        groups.setdefault((e.model_name, e.dtype), []).append(e)
    out = []
    for (model, dtype), items in groups.items():
        out.append(
            StoredSize(
                model=model,
                dtype=dtype,
                codec=", ".join(sorted({str(e.codec) for e in items})),
                entries=len(items),
                tokens=sum(e.n_tokens for e in items),
                estimated_bytes=sum(_bytes(2 * e.n_layers * e.kv_heads * e.head_dim * e.n_tokens, e.dtype) for e in items),
                raw_bytes=sum(e.raw_bytes for e in items),
                stored_bytes=sum(e.stored_bytes for e in items),
            )
        )
    return out


def measure_store(path: str) -> list[StoredSize]:
    """Scan a store (read-only, headers only) and summarize it per model and dtype.
    Raises the store's errors (e.g. StoreNotFoundError) when it cannot be opened."""
    from kvstore.store import KVStore  # imports torch

    with KVStore(path, readonly=True) as store:
        info = store.scan()
    return summarize_entries(info.entries)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SizeReport:
    """Estimates for a list of models, and optionally what a store holds. Render with
    :meth:`to_table`, :meth:`to_csv`, :meth:`to_json`, or :func:`plot_report`."""

    seq_len: int
    examples: int
    dtypes: tuple[str, ...]
    estimates: tuple[SizeEstimate, ...]
    notes: tuple[str, ...] = ()
    store: str | None = None
    measured: tuple[StoredSize, ...] | None = None

    # -- table --------------------------------------------------------------------------------
    def to_table(self) -> str:
        """Aligned text: exact integers with thousands separators and binary units beside them."""
        lines = [
            f"KV cache per example = {FORMULA}",
            f"{self.seq_len:,} tokens per example, {self.examples:,} examples; cumulative adds the models in the order listed.",
            "",
        ]
        windowed = any(r.window != "-" for r in self.estimates)
        headers = ["model", "dtype", "layers", "kv_heads x head_dim"] + (["window"] if windowed else [])
        for title in ("bytes/token", f"per example ({self.seq_len:,} tokens)", f"dataset ({self.examples:,} examples)", "cumulative"):
            headers += [title, ""]  # the exact number, then its binary units
        body: list[list[str] | None] = []
        for i, r in enumerate(self.estimates):
            if i and r.dtype != self.estimates[i - 1].dtype:
                body.append(None)
            row = [r.model, r.dtype, str(r.n_layers), f"{r.kv_heads} x {r.head_dim}"] + ([r.window] if windowed else [])
            for exact, human in ((r.bytes_per_token, r.per_token_str), (r.bytes_per_example, r.per_example_str),
                                 (r.bytes_dataset, r.dataset_str), (r.bytes_cumulative, r.cumulative_str)):
                row += [f"{exact:,}", f"({human})"]
            body.append(row)
        right = {2} | set(range(len(headers) - 8, len(headers), 2))  # numbers right, their units left
        lines += _render(headers, body, right)
        for note in self.notes:
            lines += ["", textwrap.fill(note, 100, initial_indent="note: ", subsequent_indent="      ")]
        if self.measured is not None:
            lines += ["", f"Measured in store {self.store}: stored bytes per token (after compression, with headers) vs the estimate", ""]
            if not self.measured:
                lines.append("(the store holds no readable entries)")
            else:
                mh = ["model", "dtype", "codec", "entries", "tokens", "estimated/token", "stored/token", "stored", "", "stored/estimate"]
                mb = [
                    [m.model, m.dtype, m.codec, f"{m.entries:,}", f"{m.tokens:,}", _number(m.estimated_per_token),
                     _number(m.stored_per_token), f"{m.stored_bytes:,}", f"({m.stored_str})", f"{m.ratio:.3f}"]
                    for m in self.measured
                ]
                lines += _render(mh, mb, {3, 4, 5, 6, 7, 9})
        return "\n".join(lines) + "\n"

    # -- csv / json ---------------------------------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        """One flat dict per row: ``kind`` ``estimated`` (then ``measured`` rows with ``--store``)."""
        out = [{"kind": "estimated", **asdict(r)} for r in self.estimates]
        for m in self.measured or ():
            out.append({"kind": "measured", **asdict(m), "estimated_per_token": m.estimated_per_token,
                        "stored_per_token": m.stored_per_token, "stored_to_estimate": m.ratio})
        return out

    def to_csv(self) -> str:
        """CSV with a header row; measured rows (``kind=measured``) follow estimated ones and fill
        their own columns."""
        rows = self.records()
        fields = list(dict.fromkeys(k for r in rows for k in r))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()

    def to_json(self) -> str:
        """JSON object: parameters, formula, notes, ``estimated`` rows, and ``measured`` rows with a store."""
        doc: dict[str, Any] = {
            "formula": FORMULA,
            "seq_len": self.seq_len,
            "examples": self.examples,
            "dtypes": list(self.dtypes),
            "notes": list(self.notes),
            "estimated": [asdict(r) for r in self.estimates],
        }
        if self.measured is not None:
            doc["store"] = self.store
            doc["measured"] = [r for r in self.records() if r.pop("kind") == "measured"]
        return json.dumps(doc, indent=2) + "\n"


def _number(x: float) -> str:
    """``46080.0 -> '46,080'``, ``40521.63 -> '40,521.6'``."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _render(headers: list[str], rows: list[list[str] | None], right: set[int]) -> list[str]:
    """Aligned lines from rows of cells (``None``: a blank line). A column headed ``""`` is the
    unit of the column before it: one space apart, under that column's title."""
    n = len(headers)
    has_unit = [j + 1 < n and headers[j + 1] == "" for j in range(n)]
    widths = [max((len(r[j]) for r in rows if r), default=0) for j in range(n)]
    for j, title in enumerate(headers):
        span = widths[j] + (1 + widths[j + 1] if has_unit[j] else 0)
        widths[j] += max(0, len(title) - span)

    titles = []
    for j in (j for j in range(n) if headers[j]):
        span = widths[j] + (1 + widths[j + 1] if has_unit[j] else 0)
        titles.append(headers[j].rjust(span) if j in right else headers[j].ljust(span))
    lines = ["  ".join(titles).rstrip()]
    for row in rows:
        if row is None:
            lines.append("")
            continue
        out = "".join(
            ("" if j == 0 else " " if headers[j] == "" else "  ") + (c.rjust(widths[j]) if j in right else c.ljust(widths[j]))
            for j, c in enumerate(row)
        )
        lines.append(out.rstrip())
    return lines


def size_report(
    models: Sequence[str] = (),
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    examples: int = DEFAULT_EXAMPLES,
    dtypes: Sequence[str] = ("float32",),
    store: str | None = None,
) -> SizeReport:
    """Resolve ``models`` (none: the eight Pythia models), estimate their cache sizes and, with
    ``store``, measure what that store holds. Raises ModelNotFoundError / ModelError for a model
    that cannot be resolved and the store's errors for a store that cannot be opened."""
    shapes = [resolve_shape(m) for m in models] if models else list(PYTHIA)
    dtypes = tuple(dict.fromkeys(normalize_dtype(d) for d in dtypes)) or ("float32",)
    notes = []
    if any(s.name in _PYTHIA_BY_NAME for s in shapes):
        notes.append(PYTHIA_NOTE)
    return SizeReport(
        seq_len=seq_len,
        examples=examples,
        dtypes=dtypes,
        estimates=tuple(estimate_size(shapes, seq_len, examples, dtypes)),
        notes=tuple(notes),
        store=store,
        measured=tuple(measure_store(store)) if store is not None else None,
    )


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------
def plot_report(report: SizeReport, path: str | os.PathLike) -> Path:
    """Grouped bars of bytes per example (log scale) per model, one bar per storage width
    (dtypes of equal width share a bar), saved as an image at ``path``. Needs matplotlib
    (``pip install 'kvstore[plot]'``); raises KVStoreError without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError:
        raise KVStoreError("--plot needs matplotlib: pip install 'kvstore[plot]' (or pip install matplotlib)") from None

    models = list(dict.fromkeys(r.model for r in report.estimates))
    by_width: dict[int, dict[str, int]] = {}
    labels: dict[int, list[str]] = {}
    for r in report.estimates:
        width = DTYPE_BITS[r.dtype]
        by_width.setdefault(width, {})[r.model] = r.bytes_per_example
        labels.setdefault(width, [])
        if r.dtype not in labels[width]:
            labels[width].append(r.dtype)
    widths = sorted(by_width, reverse=True)

    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(models) + 2), 5.2), dpi=120)
    bar = 0.8 / max(1, len(widths))
    values = [v for w in widths for v in by_width[w].values() if v > 0] or [1]
    for k, width in enumerate(widths):
        xs = [i + (k - (len(widths) - 1) / 2) * bar for i in range(len(models))]
        ys = [by_width[width].get(m, 0) for m in models]
        bars = ax.bar(xs, ys, bar * 0.95, label=" / ".join(labels[width]))
        for rect, y in zip(bars, ys):
            if y:
                ax.annotate(human_bytes(y), (rect.get_x() + rect.get_width() / 2, y), xytext=(0, 3),
                            textcoords="offset points", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_yscale("log", base=2)
    lo, hi = min(values), max(values)
    ticks = [2**e for e in range(int(lo).bit_length() - 2, int(hi).bit_length() + 3) if e % 2 == 0]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels([human_bytes(t).replace(".0 ", " ") for t in ticks])
    ax.set_ylim(lo / 2, hi * 8)
    ax.set_xticks(range(len(models)))
    long_names = max(map(len, models)) > 12
    ax.set_xticklabels(models, rotation=20 if long_names else 0, ha="right" if long_names else "center")
    ax.set_ylabel(f"KV cache per example ({report.seq_len:,} tokens), log scale")
    ax.set_title(f"KV-cache size per example at {report.seq_len:,} tokens\n{FORMULA}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(title="dtype", loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


__all__ = [
    "DEFAULT_EXAMPLES",
    "DEFAULT_SEQ_LEN",
    "DTYPE_BITS",
    "INFERENCE_DTYPES",
    "ModelShape",
    "PYTHIA",
    "SizeEstimate",
    "SizeReport",
    "StoredSize",
    "bundled_gguf",
    "estimate_size",
    "kv_bytes_per_example",
    "kv_bytes_per_token",
    "measure_store",
    "normalize_dtype",
    "plot_report",
    "read_gguf_metadata",
    "resolve_shape",
    "shape_from_config",
    "shape_from_gguf",
    "size_report",
    "summarize_entries",
]
