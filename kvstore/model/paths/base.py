"""Cache paths: one strategy object per way kvstore stores and reuses a model's cache, chosen
once per model (:attr:`kvstore.model.handle.ModelHandle.path`, from its cache layout).

* :data:`DENSE` - every layer full attention: a context's keys and values as a chain of chunks,
  copied into left-padded batch buffers with a corrected mask and explicit positions
  (:func:`kvstore.model.pipelines.build.compute_dense`, :func:`kvstore.model.pipelines.sample.decode_cached_dense`,
  :func:`kvstore.model.pipelines.sample.decode_reference_dense`). Everything kvstore offers runs on it.
* :data:`FAMILIES` - sliding-window, chunked-attention, state-space and hybrid models: per-layer
  records (kept windows, recurrent states) and position masks over slots
  (:mod:`kvstore.model.paths.families`). Build and sample are exact here; the features measured only
  on dense caches are not offered.

Orchestration (build, sample, scoring, hooks) calls the chosen path and asks it what it supports
(:meth:`CachePath.supports`) instead of branching on the model; each refusal names the feature.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.model.paths import families as contexts
from kvstore.model.pipelines import build
from kvstore.model.pipelines import sample as decode

# What a path may offer beyond building and sampling exactly.
FEATURES = (
    "lossy",  # lossy codecs (measured on full-attention caches only)
    "compile",  # fixed-shape and compiled decode steps
    "hooks",  # generation contexts, decode-time attention and variant sweeps
    "scoring",  # log-likelihoods from stored contexts
    "load_ahead",  # loading the next batch on a worker while a batch decodes
    "chunked_prefill",  # prefilling a long context in pieces
    "prefill",  # Adapter.prefill: plain per-layer keys and values of a batch
)


@dataclass(frozen=True)
class CachePath:
    """One way of storing and reusing a cache: its name, the :data:`FEATURES` it offers, and the
    three pieces that differ between paths (computing build jobs, answering a batch from stored
    caches, and the no-cache reference)."""

    name: str
    features: frozenset[str]
    compute: Callable[..., None]
    decode_cached: Callable[..., Any]
    decode_reference: Callable[..., Any]

    def supports(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise ValueError(f"unknown cache-path feature {feature!r}")
        return feature in self.features


def _families_compute(adapter, store, jobs, writer, report, batch_size, max_batch_tokens, progress, count) -> None:
    contexts.compute_jobs(
        adapter, store, jobs, writer, report, batch_size, max_batch_tokens, progress, count, build.account
    )


def _families_decode_cached(adapter, plans, q_ids, N, store, writer, stop, return_scores, variants, ahead):
    # one variant (the model as loaded: hooks are dense-only), nothing loaded ahead
    t0 = time.perf_counter()
    tokens, scores, got, computed, labels = contexts.decode_cached(
        adapter, plans, q_ids, N, store, writer, stop, return_scores
    )
    return [(tokens, scores, time.perf_counter() - t0)], got, computed, labels


DENSE = CachePath(
    "dense", frozenset(FEATURES), build.compute_dense, decode.decode_cached_dense, decode.decode_reference_dense
)
FAMILIES = CachePath("families", frozenset(), _families_compute, _families_decode_cached, contexts.decode_reference)


def path_for(dense: bool) -> CachePath:
    """The path of a model whose layout is ``dense`` (every layer full attention) or not."""
    return DENSE if dense else FAMILIES


__all__ = ["DENSE", "FAMILIES", "FEATURES", "CachePath", "path_for"]
