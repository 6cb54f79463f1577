"""Model shapes: what fixes the size of a model's KV cache, from built-in Pythia configs, a
``config.json``, a ``.gguf`` file's metadata, or a hub id's config.

A sliding-window layer keeps at most ``window`` tokens (transformers' ``DynamicSlidingWindowLayer``
keeps ``window - 1``, so the cap here is an upper bound by one token per such layer). None of
this imports torch, except for a config that sets a sliding window without saying which layers use
it: only transformers' config class knows that pattern (Gemma 2 alternates, Gemma 3 slides five
layers in six), so it is derived there.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore import dtypes
from kvstore.errors import DtypeError, ModelError, ModelNotFoundError
from kvstore.facts import FULL_KV_KINDS, LAYER_TYPES, SLIDING, STATE, STATE_FORMULA_TYPES, WINDOWED_KINDS
from kvstore.model.load.gguf import read_gguf_metadata
from kvstore.size.states import model_state, state_dtype


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What fixes the size of a model's KV cache.

    ``windows``: per layer, the most tokens that layer caches (``None`` = all of them, ``0`` = it
    caches none, e.g. a linear-attention layer); ``None`` when every layer caches every token.
    ``config_dtype``: the dtype the model's config declares, if it declares one. ``state``: the
    recurrent state a state-space or hybrid model keeps per example whatever its length, as
    ``(elements, dtype rule)`` per tensor (:mod:`kvstore.size.states`); a model of only such layers has
    ``kv_heads`` and ``head_dim`` 0.
    """

    name: str
    n_layers: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] | None = None
    source: str = "built-in"
    config_dtype: str | None = None
    state: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        no_kv = self.windows is not None and not any(w != 0 for w in self.windows)
        for field_ in ("n_layers", "kv_heads", "head_dim"):
            value = getattr(self, field_)
            low = 0 if (no_kv and field_ != "n_layers") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
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

    def state_bytes(self, dtype: str = "float32") -> int:
        """Bytes of the recurrent state one example keeps, for a model running in ``dtype``."""
        return sum(n * dtypes.bits(state_dtype(d, dtype)) // 8 for n, d in self.state)

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
_BUNDLED_ALIASES = {
    "default",
    "bundled",
    "smollm2-135m",
    "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct",
}


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
    try:
        return dtypes.parse_kv(value)
    except DtypeError:
        return None


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
        cached = LAYER_TYPES.get(kind)  # how many tokens the layer caches follows from its kind
        if cached in FULL_KV_KINDS:
            caps.append(None)
        elif cached in WINDOWED_KINDS:
            window = sliding if cached == SLIDING else chunk
            if window is None:
                raise ModelError(
                    f"{name}: config has {kind} layers but no window size; set sliding_window in its config"
                )
            caps.append(int(window))
        elif cached is not None:  # a recurrent state or nothing: no keys and values
            caps.append(0)
        else:
            raise ModelError(
                f"{name}: layer type {kind!r} has no KV-size formula here; only full, sliding and chunked attention do"
            )
    return None if all(c is None for c in caps) else tuple(caps)


def _special_floats(value: Any) -> Any:
    """transformers writes infinity as ``{"__float__": "Infinity"}`` in a config.json."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].lower().replace("infinity", "inf"))
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def _config_with_transformers(config: Mapping[str, Any], name: str) -> Any:
    """Build transformers' config object from a config dict, which derives ``layer_types`` (a
    sliding window's pattern, a hybrid's attention layers)."""
    model_type = config.get("model_type")
    try:
        from transformers import AutoConfig

        fields = {k: _special_floats(v) for k, v in config.items() if k != "model_type"}
        return AutoConfig.for_model(str(model_type), **fields)
    except (ImportError, ValueError, TypeError, KeyError) as exc:
        raise ModelError(
            f"{name}: its config sets a sliding window or recurrent layers but no layer_types, and transformers cannot "
            "derive them "
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
    model_type = str(_lookup(cfg, "model_type") or "")
    recurrent = model_type in STATE_FORMULA_TYPES
    if isinstance(config, Mapping) and recurrent and _lookup(cfg, "layer_types") is None:
        return shape_from_config(_config_with_transformers(config, name), name=name, source=source)
    layer_types = _lookup(cfg, "layer_types")
    n_layers = _lookup(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    if recurrent and n_layers and layer_types is not None and all(LAYER_TYPES.get(t) == STATE for t in layer_types):
        return _state_only_shape(cfg, name, source, model_type, list(layer_types), int(n_layers), config)
    heads = _lookup(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads")
    hidden = _lookup(cfg, "hidden_size", "n_embd", "d_model")
    if n_layers is None or heads is None:
        raise ModelError(
            f"{name}: its config gives no layer count or attention-head count; is it a decoder language model?"
        )
    if _lookup(cfg, "kv_lora_rank") is not None:
        raise ModelError(
            f"{name}: multi-head latent attention (kv_lora_rank) caches keys and values of different widths; not "
            "covered"
        )
    kv_heads = _lookup(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
    if kv_heads is None:
        kv_heads = 1 if _lookup(cfg, "multi_query") else heads
    head_dim = _lookup(cfg, "head_dim")
    if head_dim is None:
        if hidden is None or hidden % heads:
            raise ModelError(
                f"{name}: its config gives no head_dim and hidden size {hidden} does not split into {heads} heads"
            )
        head_dim = hidden // heads

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
        state=model_state(cfg, model_type, layer_types),
    )


def _state_only_shape(
    cfg: Any, name: str, source: str, model_type: str, layer_types: list[str], n_layers: int, config: Any
) -> ModelShape:
    """A model whose layers keep only recurrent states (Mamba, Mamba-2): no keys and values."""
    if len(layer_types) != n_layers:
        raise ModelError(f"{name}: config lists {len(layer_types)} layer_types for {n_layers} layers")
    return ModelShape(
        name=name, n_layers=n_layers, kv_heads=0, head_dim=0, windows=(0,) * n_layers, source=source,
        config_dtype=_dtype_of(config) or _dtype_of(cfg), state=model_state(cfg, model_type, layer_types),
    )  # fmt: skip


# -- GGUF -------------------------------------------------------------------------------------
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
        raise ModelError(
            f"{name}: multi-head latent attention (kv_lora_rank) caches keys and values of different widths; not "
            "covered"
        )
    if isinstance(heads, list):
        heads = max(heads)
    kv = get("attention.head_count_kv")
    kv = heads if kv is None else kv
    windows: list[int | None] | None = None
    if isinstance(kv, list):  # per layer; 0 = a layer without attention
        nonzero = {k for k in kv if k}
        if len(nonzero) != 1:
            raise ModelError(
                f"{name}: GGUF lists KV head counts {sorted(nonzero)} per layer; only one count per model is covered"
            )
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
                f"{path}: GGUF metadata gives no attention.key_length and embedding_length {hidden} does not split "
                f"into {heads} heads"
            )
        head_dim = hidden // heads

    windows = _gguf_windows(name, get, int(n_layers), windows)
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


def _gguf_windows(
    name: str, get: Callable[[str], Any], n_layers: int, windows: list[int | None] | None
) -> list[int | None] | None:
    """Each layer's window from a GGUF's ``attention.sliding_window`` and its pattern (``windows``:
    0 for the layers without attention, as the KV head counts said; None: every layer global).
    Raises ModelError when the GGUF names a window but not which layers use it."""
    sliding = get("attention.sliding_window")
    if sliding:
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            slides = [bool(p) for p in pattern]
        elif isinstance(pattern, int) and pattern > 0:  # every pattern-th layer is global (llama.cpp, transformers)
            slides = [(i + 1) % pattern != 0 for i in range(n_layers)]
        else:
            raise ModelError(
                f"{name}: the GGUF gives a sliding window but not which layers use it; pass the model's hub id or "
                "config directory instead"
            )
        if len(slides) != n_layers:
            raise ModelError(f"{name}: sliding_window_pattern has {len(slides)} entries for {n_layers} layers")
        windows = [
            (0 if (windows and windows[i] == 0) else (int(sliding) if s else None)) for i, s in enumerate(slides)
        ]
    return windows


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
            response = get_session().get(
                hf_hub_url(repo_id, "config.json"), headers=build_hf_headers(), timeout=10, follow_redirects=True
            )
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
    from kvstore.model.load.loading import bundled_gguf_path  # light: imports no torch

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
            raise ModelNotFoundError(
                f"directory {path} holds no config.json; point kvstore size at a model directory or a .gguf file"
            )
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


__all__ = [
    "BUNDLED_NAME",
    "PYTHIA",
    "ModelShape",
    "resolve_shape",
    "shape_from_config",
    "shape_from_gguf",
]
