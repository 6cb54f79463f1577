"""kvstore: a disk-backed KV-cache store for precomputed contexts.

Build each distinct context's attention keys/values once, store them content-addressed
(safetensors + zstd inside LMDB), and answer many questions against them with batched greedy
decoding that gives the same tokens as running the model without any cache.

Heavy modules (torch, transformers) load lazily on first use of the names that need them, so
``import kvstore`` stays cheap and never imports click.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it (imported on first attribute access)
_LAZY = {
    "Adapter": "kvstore.adapter",
    "BuildReport": "kvstore.adapter",
    "KVStore": "kvstore.store",
    "Entry": "kvstore.store",
    "EntryInfo": "kvstore.store",
    "StoreInfo": "kvstore.store",
    "FORMAT_VERSION": "kvstore.entry",
    "get_codec": "kvstore.codec",
    "cache_key": "kvstore.keys",
    "model_fingerprint": "kvstore.keys",
    "load_model": "kvstore.models",
    "load_dataset": "kvstore.datasets",
    "Dataset": "kvstore.datasets",
    "Example": "kvstore.datasets",
    "PromptFormat": "kvstore.prompts",
    "score": "kvstore.metrics",
    "estimate_size": "kvstore.size",
}

__all__ = ["__version__", *sorted(_LAZY)]

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.adapter import Adapter, BuildReport
    from kvstore.codec import get_codec
    from kvstore.datasets import Dataset, Example, load_dataset
    from kvstore.metrics import score
    from kvstore.prompts import PromptFormat
    from kvstore.size import estimate_size
    from kvstore.entry import FORMAT_VERSION
    from kvstore.keys import cache_key, model_fingerprint
    from kvstore.models import load_model
    from kvstore.store import Entry, EntryInfo, KVStore, StoreInfo


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
