"""KVStore: content-addressed KV caches in a backend (LMDB by default).

::

    with KVStore("cache/store") as store:
        store.put(entry)                      # an Entry (see below), encoded with the store's codec
        entry = store.get(key)                # verified; None if missing *or* corrupt (with a warning)
        with store.open_entry(key) as view:   # zero-copy variant for the load path
            view.records["layers.0.keys"].copy_into(dest)
        info = store.scan()                   # headers only; scan(verify=True) checks every byte

Backend keys: ``e/<key>`` entries, ``a/<key>`` last access time (float64 seconds, written in one
batch when the store closes), ``meta`` the store's own description (format version, default codec,
creation time). Reopening a store reads its description back; a store from a newer format is
refused, never misread.
"""
from __future__ import annotations

import contextlib
import json
import struct
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.backends import Backend, open_backend
from kvstore.codec import Codec, TensorRecord, get_codec
from kvstore.entry import (
    DTYPES,
    FORMAT_VERSION,
    EntryHeader,
    decode_entry,
    encode_entry,
    read_header,
)
from kvstore.errors import (
    CorruptEntryError,
    CorruptEntryWarning,
    EntryNotFoundError,
    FormatVersionError,
    KVStoreError,
    ReadOnlyStoreError,
)
from kvstore.units import human_bytes, human_time

_META = b"meta"
_E = b"e/"
_A = b"a/"


def _ekey(key: str) -> bytes:
    return _E + key.encode("ascii")


@dataclass(frozen=True)
class Entry:
    """One context's KV cache, materialized: ``layers[i] = (keys, values)`` each
    ``[kv_heads, n_tokens, head_dim]``; ``token_ids`` ``[n_tokens]`` int64."""

    key: str
    model: str
    model_name: str
    token_ids: torch.Tensor
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    created: float = field(default_factory=time.time)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0][0].dtype

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    def to_dynamic_cache(self, device: torch.device | str | None = None, config=None):
        """A ``transformers.DynamicCache`` holding this context (batch of 1), ready for
        ``model.generate(input_ids=context_ids + question_ids, past_key_values=cache)``."""
        from transformers import DynamicCache

        device = torch.device(device) if device is not None else self.layers[0][0].device
        data = [(k.unsqueeze(0).to(device), v.unsqueeze(0).to(device)) for k, v in self.layers]
        return DynamicCache(data, config=config) if config is not None else DynamicCache(data)


@dataclass(frozen=True)
class EntryView:
    """A verified entry seen without copying: ``records`` view the stored (or decompressed)
    bytes and are valid only inside the ``open_entry`` block."""

    header: EntryHeader
    records: dict[str, TensorRecord]

    def layer(self, i: int) -> tuple[TensorRecord, TensorRecord]:
        return self.records[f"layers.{i}.keys"], self.records[f"layers.{i}.values"]

    def materialize(self) -> Entry:
        h = self.header
        layers = tuple((k.materialize(), v.materialize()) for k, v in (self.layer(i) for i in range(h.n_layers)))
        return Entry(h.key, h.model, h.model_name, self.records["token_ids"].materialize(), layers, h.created)


@dataclass(frozen=True)
class EntryInfo:
    """What a scan reports about one entry (from its header)."""

    key: str
    model: str
    model_name: str
    dtype: str
    n_tokens: int
    n_layers: int
    kv_heads: int
    head_dim: int
    codec: str
    raw_bytes: int
    stored_bytes: int
    created: float
    last_access: float | None = None

    @property
    def ratio(self) -> float:
        """Stored size as a fraction of the uncompressed safetensors size (lower is better)."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def size_str(self) -> str:
        return human_bytes(self.stored_bytes)

    @property
    def created_str(self) -> str:
        return human_time(self.created)

    @property
    def last_used(self) -> float:
        return self.last_access if self.last_access is not None else self.created


@dataclass(frozen=True)
class CorruptInfo:
    key: str
    reason: str
    stored_bytes: int


@dataclass(frozen=True)
class StoreInfo:
    """A store's description and contents (see :meth:`KVStore.scan`)."""

    url: str
    format: int
    codec: str
    created: float
    entries: tuple[EntryInfo, ...]
    corrupt: tuple[CorruptInfo, ...]
    disk_bytes: int | None
    verified: bool

    @property
    def n_entries(self) -> int:
        return len(self.entries)

    @property
    def stored_bytes(self) -> int:
        return sum(e.stored_bytes for e in self.entries)

    @property
    def raw_bytes(self) -> int:
        return sum(e.raw_bytes for e in self.entries)

    @property
    def n_tokens(self) -> int:
        return sum(e.n_tokens for e in self.entries)

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(f"{c.key}: {c.reason}" for c in self.corrupt)

    @property
    def size_str(self) -> str:
        return human_bytes(self.stored_bytes)


class KVStore:
    """A KV-cache store. ``path_or_url``: a directory (LMDB), ``lmdb://DIR`` or ``memory://NAME``;
    default ``$KVSTORE_STORE`` or ``<home>/store``.

    ``readonly`` opens for reading only (a missing store is then an error). ``codec`` sets the
    codec for new entries (default: the one recorded in the store, else ``zstd-shuffle:1``).
    """

    def __init__(
        self,
        path_or_url: str | None = None,
        *,
        readonly: bool = False,
        codec: str | Codec | None = None,
        **backend_options,
    ):
        from kvstore.paths import default_store

        self.url = str(path_or_url or default_store())
        self.backend: Backend = open_backend(self.url, readonly=readonly, **backend_options)
        self.readonly = readonly
        self._touched: dict[str, float] = {}
        try:
            self.meta = self._load_meta(codec)
            self.codec = get_codec(codec or self.meta.get("codec"))
        except BaseException:
            self.backend.close()
            raise

    # -- description --------------------------------------------------------------------------
    def _load_meta(self, codec: str | Codec | None = None) -> dict:
        raw = self.backend.get(_META)
        if raw is None:
            # a new store records the codec it was created with, so a reopen uses it again
            meta = {"format": FORMAT_VERSION, "codec": get_codec(codec).spec, "created": time.time()}
            if not self.readonly:
                self.backend.put(_META, json.dumps(meta, sort_keys=True).encode())
            return meta
        try:
            meta = json.loads(raw)
            fmt = int(meta["format"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            raise KVStoreError(f"store {self.url} has an unreadable description record; is it a kvstore store?") from None
        if fmt > FORMAT_VERSION:
            raise FormatVersionError(
                f"store {self.url} was written by format version {fmt}; this kvstore reads up to {FORMAT_VERSION} - upgrade kvstore"
            )
        return meta

    @property
    def format(self) -> int:
        return int(self.meta["format"])

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Record last-access times (one transaction) and close the backend."""
        if self._touched and not self.readonly:
            with contextlib.suppress(KVStoreError):
                self.backend.put_many((_A + k.encode(), struct.pack("<d", t)) for k, t in self._touched.items())
        self._touched.clear()
        self.backend.close()

    # -- single entries -------------------------------------------------------------------------
    def encode(self, entry: Entry, codec: str | Codec | None = None) -> bytes:
        """The stored bytes for ``entry`` (what :meth:`put` writes)."""
        return encode_entry(
            key=entry.key,
            model=entry.model,
            model_name=entry.model_name,
            token_ids=entry.token_ids,
            layers=entry.layers,
            codec=get_codec(codec) if codec is not None else self.codec,
            created=entry.created,
        )

    def put(self, entry: Entry, *, codec: str | Codec | None = None) -> int:
        """Store ``entry`` atomically under ``entry.key``; returns the stored size in bytes."""
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.url} was opened read-only")
        blob = self.encode(entry, codec)
        self.backend.put(_ekey(entry.key), blob)
        return len(blob)

    def put_bytes(self, key: str, blob: bytes) -> None:
        """Store already-encoded entry bytes (see :meth:`encode`) under ``key``."""
        self.backend.put(_ekey(key), blob)

    def contains(self, key: str) -> bool:
        return self.backend.contains(_ekey(key))

    __contains__ = contains

    def delete(self, key: str) -> bool:
        """Remove an entry; True if it existed."""
        found = self.backend.delete(_ekey(key))
        self.backend.delete(_A + key.encode())
        return found

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        n = self.backend.delete_many([_ekey(k) for k in keys])
        self.backend.delete_many([_A + k.encode() for k in keys])
        return n

    @contextlib.contextmanager
    def open_entry(self, key: str) -> Iterator[EntryView | None]:
        """Verified zero-copy access to one entry; yields None when it is missing or corrupt
        (a corrupt entry also emits a :class:`CorruptEntryWarning`: treat it as a miss)."""
        with self.backend.view(_ekey(key)) as buf:
            if buf is None:
                yield None
                return
            try:
                header, decoded = decode_entry(buf, key=key, threads=self.codec._threads())
            except CorruptEntryError as exc:
                warnings.warn(f"kvstore: entry {key[:16]} is corrupt ({exc}); treating it as a miss", CorruptEntryWarning, stacklevel=3)
                yield None
                return
            self._touched[key] = time.time()
            yield EntryView(header, dict(decoded.tensors))

    def is_intact(self, key: str) -> bool:
        """True when ``key`` holds an entry that verifies and decodes; False when it is missing or
        corrupt (a corrupt one also warns). Builds use it so that they redo broken entries."""
        with self.open_entry(key) as view:
            return view is not None

    def get(self, key: str, default=None) -> Entry | None:
        """The verified entry under ``key``, or ``default`` if it is missing or corrupt."""
        with self.open_entry(key) as view:
            return default if view is None else view.materialize()

    def __getitem__(self, key: str) -> Entry:
        with self.backend.view(_ekey(key)) as buf:
            if buf is None:
                raise EntryNotFoundError(f"no entry {key} in {self.url}")
            header, decoded = decode_entry(buf, key=key)
            self._touched[key] = time.time()
            return EntryView(header, dict(decoded.tensors)).materialize()

    def header(self, key: str) -> EntryHeader | None:
        """An entry's header without verifying or decoding its payload."""
        with self.backend.view(_ekey(key)) as buf:
            return None if buf is None else read_header(buf)[0]

    def keys(self) -> list[str]:
        return [k[len(_E) :].decode() for k in self.backend.keys(_E)]

    def __len__(self) -> int:
        return len(self.keys())

    # -- scanning -------------------------------------------------------------------------------
    def _last_access(self) -> dict[str, float]:
        out = {}
        for k in self.backend.keys(_A):
            raw = self.backend.get(k)
            if raw is not None and len(raw) == 8:
                out[k[len(_A) :].decode()] = struct.unpack("<d", raw)[0]
        return out | self._touched

    def scan(self, *, verify: bool = False, progress=None) -> StoreInfo:
        """Describe every entry from its header; with ``verify`` also check each checksum and
        decode each payload. Corrupt entries are reported in ``corrupt``, never raised.

        ``progress``: optional callable ``progress(n_done, n_total)``."""
        access = self._last_access()
        entries, corrupt = [], []
        keys = self.keys()
        for i, key in enumerate(keys):
            with self.backend.view(_ekey(key)) as buf:
                if buf is None:  # deleted while we scanned
                    continue
                size = len(buf)
                try:
                    if verify:
                        header, _ = decode_entry(buf, key=key)
                    else:
                        header, _ = read_header(buf)
                        if header.key != key:
                            raise CorruptEntryError("entry header names another key")
                except (CorruptEntryError, FormatVersionError) as exc:
                    corrupt.append(CorruptInfo(key, str(exc), size))
                else:
                    entries.append(
                        EntryInfo(
                            key=key,
                            model=header.model,
                            model_name=header.model_name,
                            dtype=header.dtype,
                            n_tokens=header.n_tokens,
                            n_layers=header.n_layers,
                            kv_heads=header.kv_heads,
                            head_dim=header.head_dim,
                            codec=header.codec_spec,
                            raw_bytes=header.raw_bytes,
                            stored_bytes=size,
                            created=header.created,
                            last_access=access.get(key),
                        )
                    )
            if progress is not None:
                progress(i + 1, len(keys))
        disk = getattr(self.backend, "disk_bytes", None)
        return StoreInfo(
            url=self.url,
            format=self.format,
            codec=self.codec.spec,
            created=float(self.meta.get("created", 0.0)),
            entries=tuple(entries),
            corrupt=tuple(corrupt),
            disk_bytes=disk() if disk else None,
            verified=verify,
        )

    def verify(self, progress=None) -> StoreInfo:
        """Same as ``scan(verify=True)``."""
        return self.scan(verify=True, progress=progress)


# -- garbage collection: plan, then execute ------------------------------------------------------
@dataclass(frozen=True)
class GcPlan:
    """Entries to remove and why; nothing is removed until :func:`execute_plan`."""

    remove: tuple[tuple[str, str, int], ...]  # (key, reason, stored_bytes)
    keep_bytes: int  # stored bytes of the intact entries left afterwards

    @property
    def n(self) -> int:
        return len(self.remove)

    @property
    def freed_bytes(self) -> int:
        return sum(r[2] for r in self.remove)


def _age_str(seconds: float) -> str:
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} minutes"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"


def plan_gc(
    info: StoreInfo,
    *,
    corrupt: bool = False,
    model: str | None = None,
    older_than: float | None = None,
    max_bytes: int | None = None,
    keys: Sequence[str] = (),
    now: float | None = None,
) -> GcPlan:
    """Choose entries to remove from a scan (nothing is removed here; see :func:`execute_plan`).

    ``model`` and ``keys`` narrow what may be removed (the *scope*): entries whose fingerprint
    starts with ``model`` or whose model name equals it, and entries whose key starts with one of
    ``keys``; both given means both must match. Within the scope, ``older_than`` (seconds since
    last use) removes old entries, then ``max_bytes`` removes least-recently-used entries until
    the scope's remaining entries fit in that many stored bytes. ``corrupt`` removes the entries
    that failed the scan (those matching ``keys`` when keys are given; a corrupt entry's model is
    unknown). With a scope but none of ``older_than``/``max_bytes``/``corrupt``, the whole scope
    is removed (``kvstore rm``), corrupt entries named by ``keys`` included. With nothing at all,
    nothing is removed.

    Raises EntryNotFoundError when a key prefix matches no entry.
    """
    now = time.time() if now is None else now
    for k in keys:
        if not any(e.key.startswith(k) for e in info.entries) and not any(c.key.startswith(k) for c in info.corrupt):
            raise EntryNotFoundError(f"no entry matches key {k!r} in {info.url}")

    def in_keys(key: str) -> bool:
        return not keys or any(key.startswith(k) for k in keys)

    def in_scope(e: EntryInfo) -> bool:
        return in_keys(e.key) and (not model or e.model.startswith(model) or e.model_name == model)

    has_scope = bool(model) or bool(keys)
    has_criterion = corrupt or older_than is not None or max_bytes is not None
    remove: dict[str, tuple[str, str, int]] = {}
    for c in info.corrupt:
        if (corrupt and in_keys(c.key)) or (keys and not has_criterion and in_keys(c.key)):
            remove[c.key] = (c.key, f"corrupt: {c.reason}", c.stored_bytes)
    scope = [e for e in info.entries if in_scope(e)]
    if has_scope and not has_criterion:
        for e in scope:
            remove[e.key] = (e.key, f"model {e.model_name}" if model else "asked for", e.stored_bytes)
    if older_than is not None:
        for e in scope:
            if now - e.last_used > older_than:
                remove[e.key] = (e.key, f"unused for {_age_str(now - e.last_used)}", e.stored_bytes)
    if max_bytes is not None:
        kept = sorted((e for e in scope if e.key not in remove), key=lambda e: (e.last_used, e.key))
        total = sum(e.stored_bytes for e in kept)
        for e in kept:
            if total <= max_bytes:
                break
            remove[e.key] = (e.key, "least recently used over the size budget", e.stored_bytes)
            total -= e.stored_bytes
    keep_bytes = sum(e.stored_bytes for e in info.entries if e.key not in remove)
    return GcPlan(tuple(remove.values()), keep_bytes)


def execute_plan(store: KVStore, plan: GcPlan) -> int:
    """Remove the planned entries in one transaction; returns how many were removed."""
    return store.delete_many(r[0] for r in plan.remove)


__all__ = [
    "CorruptInfo",
    "DTYPES",
    "Entry",
    "EntryInfo",
    "EntryView",
    "GcPlan",
    "KVStore",
    "StoreInfo",
    "execute_plan",
    "plan_gc",
]
