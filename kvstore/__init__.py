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
    "Adapter": "kvstore.model.adapter",
    "BuildReport": "kvstore.model.build",
    "SampleResult": "kvstore.model.decode",
    "load_model": "kvstore.model.loading",
    "model_fingerprint": "kvstore.model.identity",
    "KVStore": "kvstore.store.kvstore",
    "Entry": "kvstore.store.entry",
    "EntryView": "kvstore.store.entry",
    "FORMAT_VERSION": "kvstore.store.entry",
    "EntryInfo": "kvstore.store.scan",
    "StoreInfo": "kvstore.store.scan",
    "get_codec": "kvstore.store.codecs",
    "cache_key": "kvstore.store.keys",
    "load_dataset": "kvstore.data.datasets",
    "Dataset": "kvstore.data.datasets",
    "Example": "kvstore.data.datasets",
    "PromptFormat": "kvstore.data.prompts",
    "score": "kvstore.data.metrics",
    "estimate_size": "kvstore.size.estimate",
    "size_report": "kvstore.size.estimate",
}

__all__ = [
    "__version__",
    "Adapter",
    "BuildReport",
    "Dataset",
    "Entry",
    "EntryInfo",
    "EntryView",
    "Example",
    "FORMAT_VERSION",
    "KVStore",
    "PromptFormat",
    "SampleResult",
    "StoreInfo",
    "cache_key",
    "estimate_size",
    "get_codec",
    "load_dataset",
    "load_model",
    "model_fingerprint",
    "score",
    "size_report",
]
assert set(__all__) == {"__version__", *_LAZY}  # one list of public names

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.data.datasets import Dataset, Example, load_dataset
    from kvstore.data.metrics import score
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.adapter import Adapter
    from kvstore.model.build import BuildReport
    from kvstore.model.decode import SampleResult
    from kvstore.model.identity import model_fingerprint
    from kvstore.model.loading import load_model
    from kvstore.size.estimate import estimate_size, size_report
    from kvstore.store.codecs import get_codec
    from kvstore.store.entry import FORMAT_VERSION, Entry, EntryView
    from kvstore.store.keys import cache_key
    from kvstore.store.kvstore import KVStore
    from kvstore.store.scan import EntryInfo, StoreInfo


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
