"""Content addressing: the key of a context's cache.

A key is the sha256 of canonical bytes naming everything that changes the cached tensors: the
entry format version, the model fingerprint (see ``kvstore.model.identity``), the dtype the KV was
computed in, and the context's token ids (u32 little-endian). Never Python's ``hash()`` (seeded
per process), never pickle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore import dtypes
from kvstore.store.entry import FORMAT_VERSION


def token_bytes(token_ids: Sequence[int] | Any) -> bytes:
    """Token ids as u32 little-endian bytes. Raises ValueError for ids outside [0, 2**32)."""
    ids = np.asarray(token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= 2**32)):
        raise ValueError("token ids must be a flat sequence of integers in [0, 2**32)")
    return ids.astype("<u4").tobytes()


def cache_key(fingerprint: str, dtype: Any, token_ids: Sequence[int] | Any) -> str:
    """sha256 (hex) naming one context's KV cache for one model and dtype."""
    h = hashlib.sha256()
    h.update(b"kvstore-key\x00")
    h.update(FORMAT_VERSION.to_bytes(4, "little"))
    h.update(fingerprint.encode("ascii") + b"\x00")
    h.update(dtypes.parse_kv(dtype).encode("ascii") + b"\x00")
    h.update(token_bytes(token_ids))
    return h.hexdigest()


__all__ = ["cache_key", "token_bytes"]
