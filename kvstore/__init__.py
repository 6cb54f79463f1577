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

# The public names, listed here once: name -> module that defines it (imported on first use).
# The TYPE_CHECKING imports below repeat them for type checkers and IDEs only (nothing runs them);
# tests/test_public_names.py keeps the two the same.
_LAZY = {
    "Adapter": "kvstore.model.adapter",
    "Press": "kvstore.model.press.spec",
    "ScoreOptions": "kvstore.model.options",
    "Variant": "kvstore.model.variants.variant",
    "answer_metrics": "kvstore.data.metrics",
    "BuildOptions": "kvstore.model.options",
    "BuildReport": "kvstore.model.pipelines.build",
    "Dataset": "kvstore.data.datasets",
    "Entry": "kvstore.store.entry",
    "EntryInfo": "kvstore.store.infos",
    "EntryView": "kvstore.store.entry",
    "Example": "kvstore.data.datasets",
    "FORMAT_VERSION": "kvstore.store.frame",
    "KVStore": "kvstore.store.kvstore",
    "PromptFormat": "kvstore.data.prompts",
    "SampleOptions": "kvstore.model.options",
    "SampleResult": "kvstore.model.pipelines.sample",
    "ScoreResult": "kvstore.model.scoring.scores",
    "StoreInfo": "kvstore.store.scan",
    "cache_key": "kvstore.store.keys",
    "estimate_size": "kvstore.size.estimate",
    "get_codec": "kvstore.store.codecs",
    "load_dataset": "kvstore.data.datasets",
    "load_model": "kvstore.model.load.loading",
    "model_fingerprint": "kvstore.model.load.identity",
    "size_report": "kvstore.size.estimate",
    "register_press": "kvstore.model.press.registry",
    "register_budget": "kvstore.model.press.registry",
    "unregister_press": "kvstore.model.press.registry",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.data.datasets import Dataset as Dataset
    from kvstore.data.datasets import Example as Example
    from kvstore.data.datasets import load_dataset as load_dataset
    from kvstore.data.metrics import answer_metrics as answer_metrics
    from kvstore.data.prompts import PromptFormat as PromptFormat
    from kvstore.model.adapter import Adapter as Adapter
    from kvstore.model.load.identity import model_fingerprint as model_fingerprint
    from kvstore.model.load.loading import load_model as load_model
    from kvstore.model.options import BuildOptions as BuildOptions
    from kvstore.model.options import SampleOptions as SampleOptions
    from kvstore.model.options import ScoreOptions as ScoreOptions
    from kvstore.model.pipelines.build import BuildReport as BuildReport
    from kvstore.model.pipelines.sample import SampleResult as SampleResult
    from kvstore.model.press.registry import register_budget as register_budget
    from kvstore.model.press.registry import register_press as register_press
    from kvstore.model.press.registry import unregister_press as unregister_press
    from kvstore.model.press.spec import Press as Press
    from kvstore.model.scoring.scores import ScoreResult as ScoreResult
    from kvstore.model.variants.variant import Variant as Variant
    from kvstore.size.estimate import estimate_size as estimate_size
    from kvstore.size.estimate import size_report as size_report
    from kvstore.store.codecs import get_codec as get_codec
    from kvstore.store.entry import Entry as Entry
    from kvstore.store.entry import EntryView as EntryView
    from kvstore.store.frame import FORMAT_VERSION as FORMAT_VERSION
    from kvstore.store.infos import EntryInfo as EntryInfo
    from kvstore.store.keys import cache_key as cache_key
    from kvstore.store.kvstore import KVStore as KVStore
    from kvstore.store.scan import StoreInfo as StoreInfo


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
