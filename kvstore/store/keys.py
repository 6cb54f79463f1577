"""Content addressing: the keys of stored caches.

**Format 2 (chains).** A context is stored as a chain of chunks. A chunk's key is the sha256 of its
parent's key and its own token ids; the first chunk's parent is the chain *seed*, the sha256 of
everything that changes the tensors besides the tokens:

* the format version, the model fingerprint (``kvstore.model.load.identity``) and the dtype;
* the numerics the KV was computed with: device type (``cpu``, ``cuda``...) and attention
  implementation (``sdpa``, ``eager``...): other kernels give other low-order bits, and a cache
  must never stand in for a computation it did not come from;
* a lossy codec's spec (``int8:64``...), so a quantized cache never answers a lossless request
  (lossless codecs are not part of it: entries under different lossless codecs are interchangeable).

Two contexts that start with the same tokens therefore share the keys of their common chunks, so
a shared prefix is stored once, and a context that extends a stored one finds its chunks.

Chunk boundaries (:func:`chunk_spans`) fall every ``chunk_tokens`` tokens, restarting at explicit
boundaries (the end of a prompt's fixed head, e.g. a chat template's system turn), so a shared
prefix of any length ends on a boundary.

**Format 1** keyed a whole context as one entry: sha256 of the format version, fingerprint, dtype
and token ids (:func:`cache_key`); such entries are still read, for their exact context.

Everything is hashed from canonical bytes (token ids as u32 little-endian) with sha256: never
Python's ``hash()`` (seeded per process), never pickle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvstore import dtypes

CHAIN_FORMAT = 2
DEFAULT_CHUNK_TOKENS = 512  # measured: bench_ttft --chunk-sweep (README, "Time to first token")


def token_bytes(token_ids: Sequence[int] | Any) -> bytes:
    """Token ids as u32 little-endian bytes. Raises ValueError for ids outside [0, 2**32)."""
    ids = np.asarray(token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= 2**32)):
        raise ValueError("token ids must be a flat sequence of integers in [0, 2**32)")
    return ids.astype("<u4").tobytes()


def cache_key(fingerprint: str, dtype: Any, token_ids: Sequence[int] | Any) -> str:
    """Format 1: sha256 (hex) naming one whole context's KV cache for one model and dtype."""
    h = hashlib.sha256()
    h.update(b"kvstore-key\x00")
    h.update((1).to_bytes(4, "little"))
    h.update(fingerprint.encode("ascii") + b"\x00")
    h.update(dtypes.parse_kv(dtype).encode("ascii") + b"\x00")
    h.update(token_bytes(token_ids))
    return h.hexdigest()


def chain_seed(fingerprint: str, dtype: Any, *, device: str, attn: str, lossy: str = "") -> str:
    """The seed of a model's chains (hex): what every chunk key descends from. ``device`` is a
    device *type* (``cpu``, ``cuda``, ``mps``), ``attn`` the attention implementation, ``lossy``
    the spec of a lossy codec (``""`` for lossless)."""
    h = hashlib.sha256()
    h.update(b"kvstore-chain\x00")
    h.update(CHAIN_FORMAT.to_bytes(4, "little"))
    for part in (fingerprint, dtypes.parse_kv(dtype), device, attn, lossy):
        h.update(part.encode("utf-8") + b"\x00")
    return h.hexdigest()


def passage_seed(seed: str) -> str:
    """The seed (hex) of a *passage*'s chain under the chain seed ``seed``: a passage is stored
    alone, computed at positions ``0..n-1`` with no context before it, to be placed at any offset
    of a composed context (:mod:`kvstore.model.compose`). Its own seed keeps its chunks apart from
    a context's that starts with the same tokens (those attended to nothing before them only at
    position 0 of an ordinary chain, and a passage is never answered as one)."""
    h = hashlib.sha256()
    h.update(b"kvstore-passage\x00")
    h.update(bytes.fromhex(seed))
    return h.hexdigest()


def chunk_key(parent: str, token_ids: Sequence[int] | Any) -> str:
    """The key (hex) of a chunk holding ``token_ids`` after ``parent`` (a chunk key, or the seed)."""
    h = hashlib.sha256()
    h.update(b"kvstore-chunk\x00")
    h.update(bytes.fromhex(parent))
    h.update(token_bytes(token_ids))
    return h.hexdigest()


def chunk_spans(n_tokens: int, chunk_tokens: int, boundaries: Iterable[int] = ()) -> list[tuple[int, int]]:
    """``[start, end)`` spans covering ``n_tokens`` tokens: ``chunk_tokens`` each, restarting at
    every explicit boundary in ``(0, n_tokens)``; a span before a boundary or at the end may be
    shorter."""
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be at least 1")
    cuts = sorted({b for b in boundaries if 0 < b < n_tokens} | {n_tokens})
    spans, start = [], 0
    for cut in cuts:
        while start < cut:
            end = min(start + chunk_tokens, cut)
            spans.append((start, end))
            start = end
    return spans


def chain_keys(seed: str, token_ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[str]:
    """The key of every chunk of a context: chunk ``i`` holds ``token_ids[spans[i][0]:spans[i][1]]``."""
    keys, parent = [], seed
    for start, end in spans:
        parent = chunk_key(parent, token_ids[start:end])
        keys.append(parent)
    return keys


__all__ = [
    "CHAIN_FORMAT",
    "DEFAULT_CHUNK_TOKENS",
    "cache_key",
    "chain_keys",
    "chain_seed",
    "chunk_key",
    "chunk_spans",
    "passage_seed",
    "token_bytes",
]
