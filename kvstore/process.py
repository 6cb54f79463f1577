"""Process-wide state: the one place kvstore keeps anything beyond the objects a caller holds.

Everything else lives in values the caller creates and drops (an :class:`~kvstore.model.adapter.Adapter`
and its handle, a :class:`~kvstore.store.kvstore.KVStore`, options, plans). These do not, and why:

* **transformers' grouped-KV switch** (:mod:`kvstore.model.compute.attention`): the first
  :class:`~kvstore.model.handle.ModelHandle` wraps transformers' module-level ``use_gqa_in_sdpa`` once,
  and it stays wrapped: transformers keeps that function per process, and every handle of the process
  relies on it. The wrapper changes nothing outside a :func:`~kvstore.model.compute.attention.grouped_kv`
  block of the calling thread, except compiled CPU forwards with a 4-D mask (the same arithmetic
  without copying the cache); ``ATTENTION.installed`` records it.
* **attention implementations registered with transformers** (:mod:`kvstore.model.variants.hooks`):
  decode attention, the presses' query capture and per-head masks register functions under
  ``kvstore-*`` names in transformers' ``AttentionInterface`` (process-wide: transformers has no way
  to remove one). Using one is scoped: a model switches to it inside a ``with`` block and back after.
* **the decode thread pool** (:mod:`kvstore.parallel`): one pool, grown to the most threads asked for,
  so that every load of the process shares its threads (``POOL``).
* **LMDB environments** (:mod:`kvstore.store.backends.lmdb_env`): LMDB allows one environment per
  path per process, so every store opened on a path shares one (``LMDB``), counted and closed with
  its last user; a forked child may not use its parent's.

One switch comes from the environment, read in one place (:func:`forced_staging`): ``KVSTORE_FORCE_STAGING``
(set and not ``0``) makes every :class:`~kvstore.model.handle.ModelHandle` made without an explicit
``force_staging`` stage its loads and writes as on an accelerator, on CPU too: the accelerator path
tested from the command line (docs/gpu.md). It is read when a handle is made, not cached.

No module of ``kvstore`` or ``cli`` uses a ``global`` statement: the mutable process-wide values
are the fields of the objects below (a test checks both).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AttentionSwitch:
    """Whether transformers' ``use_gqa_in_sdpa`` is wrapped yet (it is, once, for good)."""

    installed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class ThreadPool:
    """The shared decode pool (a ``ThreadPoolExecutor`` or None) and its size."""

    executor: Any = None
    size: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class LmdbEnvironments:
    """The open LMDB environments by path (``SharedEnv`` values) and the lock over them; a forked
    child replaces the lock (the parent's other threads, which might hold it, are gone)."""

    envs: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


FORCE_STAGING_ENV = "KVSTORE_FORCE_STAGING"


def forced_staging() -> bool:
    """Whether ``KVSTORE_FORCE_STAGING`` is set to anything but empty or ``0`` (see the module
    docstring): the default of a model handle's ``force_staging``."""
    return os.environ.get(FORCE_STAGING_ENV, "") not in ("", "0")


ATTENTION = AttentionSwitch()
POOL = ThreadPool()
LMDB = LmdbEnvironments()

__all__ = [
    "ATTENTION",
    "FORCE_STAGING_ENV",
    "LMDB",
    "POOL",
    "AttentionSwitch",
    "LmdbEnvironments",
    "ThreadPool",
    "forced_staging",
]
