"""Copying a store into another, across backends: ``kvstore sync SRC DST``.

Every record of SRC that DST lacks is copied byte for byte: entries of every kind (chunks under
``e/KEY``, the entries a context owns under ``x/CONTEXT/KEY``), each verified by the kind that
reads it (:func:`kvstore.store.kinds.stored_at`) before it is written, so a corrupt one is reported
and never copied; access times, and any other ``NAME/HEX`` record.
An entry whose header says a format newer than this kvstore's, or a kind this process does not know
(a plug-in's), is copied byte for byte once its checksum holds, and reported (``unknown``): it is
another writer's, not corrupt.
Entries go first, then the records about them, then the derived entries, pressed caches before
scores (the reverse of a removal's order: an interrupted sync leaves entries no record names yet,
never a record whose chunks did not arrive, nor a derived entry whose context did not). Writes use
``put_if_absent``: a record DST already holds is never replaced, so syncs are idempotent and a
sync that was killed resumes by copying only what is still missing.

The store's description (``meta``): a DST without one gets SRC's, first, so that an interrupted
sync still leaves a valid store. A DST with one keeps it, provided its format is at least SRC's
(entries carry their own codec, so DST's default codec does not matter); a SRC or DST newer than
this kvstore is refused, as is a DST older than SRC.

Plan, then execute: :func:`plan_sync` lists what is missing (``--dry-run`` stops there),
:func:`execute_sync` copies it. :func:`sync` does both on two URLs.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.errors import CorruptEntryError, FormatVersionError, KVStoreError, StoreNotFoundError
from kvstore.progress import Progress
from kvstore.store.backends import Backend, open_backend
from kvstore.store.frame import verify_checksum
from kvstore.store.header import STORE_FORMAT, peek_frame
from kvstore.store.keyspace import ENTRY, META, OWNED, key_of
from kvstore.store.kinds import stands_for_context, stored_at

BATCH_RECORDS = 256  # records read, verified and written together (held in memory until written)
BATCH_BYTES = 64 << 20  # ... and about this many bytes of them


@dataclass(frozen=True)
class SyncPlan:
    """What a sync will do: ``missing`` keys to copy (entries first), ``present`` records DST
    already holds, and what happens to DST's description (``meta``: "copy" or "keep")."""

    src: str
    dst: str
    src_meta: bytes
    meta: str
    missing: tuple[bytes, ...]
    present: int

    @property
    def entries(self) -> int:
        """Entries among the records to copy."""
        return sum(k.startswith(ENTRY) for k in self.missing)

    @property
    def owned(self) -> int:
        """Derived entries among the records to copy."""
        return sum(k.startswith(OWNED) for k in self.missing)

    derived = property(lambda self: self.owned, doc="Deprecated: ``owned``.")


@dataclass(frozen=True)
class SyncReport:
    """What a sync did. ``copied_bytes`` counts the bytes of the records copied; ``corrupt``
    lists ``(key, reason)`` of SRC entries that failed verification (not copied); ``vanished``
    counts records deleted from SRC while the sync ran; ``unknown`` lists ``(key, reason)`` of the
    entries copied byte for byte that this kvstore cannot read (a newer format, an unknown kind)."""

    src: str
    dst: str
    meta: str
    present: int
    copied: int = 0
    copied_entries: int = 0
    copied_bytes: int = 0
    copied_owned: int = 0
    vanished: int = 0
    corrupt: tuple[tuple[str, str], ...] = field(default=())
    seconds: float = 0.0
    unknown: tuple[tuple[str, str], ...] = field(default=())

    copied_derived = property(lambda self: self.copied_owned, doc="Deprecated: ``copied_owned``.")

    def as_dict(self) -> dict:
        return {
            "src": self.src,
            "dst": self.dst,
            "meta": self.meta,
            "already_present": self.present,
            "copied": self.copied,
            "copied_entries": self.copied_entries,
            "copied_derived": self.copied_owned,
            "copied_bytes": self.copied_bytes,
            "vanished": self.vanished,
            "corrupt": len(self.corrupt),
            "unknown": len(self.unknown),
            "seconds": round(self.seconds, 3),
        }


def _format(raw: bytes, where: str) -> int:
    try:
        return int(json.loads(raw)["format"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        raise KVStoreError(f"{where} has an unreadable description record; is it a kvstore store?") from None


def plan_sync(src: Backend, dst: Backend | None, *, src_name: str = "SRC", dst_name: str = "DST") -> SyncPlan:
    """List what :func:`execute_sync` would copy from ``src`` into ``dst`` (None: a DST that does
    not exist yet). Raises KVStoreError when SRC is no store, FormatVersionError when the formats
    do not allow it (see the module docstring)."""
    src_meta = src.get(META)
    if src_meta is None:
        raise StoreNotFoundError(f"{src_name} holds no kvstore store (no description record)")
    src_format = _format(src_meta, src_name)
    if src_format > STORE_FORMAT:
        raise FormatVersionError(
            f"{src_name} is format {src_format}; this kvstore reads up to {STORE_FORMAT} - upgrade kvstore"
        )
    dst_meta = None if dst is None else dst.get(META)
    if dst_meta is not None:
        dst_format = _format(dst_meta, dst_name)
        if dst_format > STORE_FORMAT:
            raise FormatVersionError(
                f"{dst_name} is format {dst_format}; this kvstore writes up to {STORE_FORMAT} - upgrade kvstore"
            )
        if src_format > dst_format:
            raise FormatVersionError(
                f"{src_name} is format {src_format} but {dst_name} is format {dst_format}: its readers may not read "
                "the copies; sync into a new store"
            )
    have = set() if dst is None else set(dst.keys())
    records = [k for k in src.keys() if k != META]
    missing = [k for k in records if k not in have]
    # entries, then the records about them, then derived entries (pressed caches before scores: a
    # context stored only as pressed caches arrives before anything that derives from it)
    missing.sort(key=lambda k: (*_order(src, k), k))
    return SyncPlan(
        src=src_name,
        dst=dst_name,
        src_meta=src_meta,
        meta="copy" if dst_meta is None else "keep",
        missing=tuple(missing),
        present=len(records) - len(missing),
    )


def _phase(key: bytes) -> int:
    """When a record is copied, asking the kind that reads it: entries that are no context's
    (chunks, 0), then the records about them (1), then the entries contexts own (2)."""
    got = stored_at(key)
    if got is None:
        return 2 if key.startswith(OWNED) else 1  # a malformed owned name goes with the owned
    return 2 if got[0].owned else 0


def _order(src: Backend, key: bytes) -> tuple[int, bool]:
    """``(phase, last)``: owned entries that stand for their context (pressed caches) go before
    the others (and before any whose header does not read)."""
    got, phase = stored_at(key), _phase(key)
    if got is None or phase < 2:
        return phase, phase == 2
    try:
        peeked = peek_frame(src, key, got[0].read_header)
    except (CorruptEntryError, FormatVersionError):
        return phase, True
    return phase, not (peeked is not None and stands_for_context(peeked[0].kind))


def _check(key: bytes, buf: memoryview) -> None:
    """Raise CorruptEntryError or FormatVersionError unless the entry ``key`` (of any kind) reads."""
    got = stored_at(key)
    if got is None:
        if key.startswith(OWNED):
            raise CorruptEntryError("its name names no context and key")
        return  # a record, not an entry
    kind, owner, own_key = got
    header = kind.decode(buf, key=own_key).header
    if owner and header.context != owner:
        raise CorruptEntryError(f"it belongs to another context than {owner[:12]}")


def _read(src: Backend, key: bytes) -> tuple[str, bytes | None, str]:
    """Read one record to copy: ("ok", bytes, ""), ("vanished", None, ""), ("unknown", bytes,
    reason) for an intact entry of a newer format or unknown kind (copied as it is), or ("corrupt",
    None, reason) for an entry that does not verify."""
    with src.view(key) as buf:
        if buf is None:
            return "vanished", None, ""
        try:
            _check(key, buf)
        except FormatVersionError as exc:
            try:
                verify_checksum(buf)  # decoding checked it first; said again here, where it matters
            except CorruptEntryError as bad:
                return "corrupt", None, str(bad)
            return "unknown", bytes(buf), str(exc)
        except CorruptEntryError as exc:
            return "corrupt", None, str(exc)
        return "ok", bytes(buf), ""


def _name(key: bytes) -> str:
    """How a report names a stored entry: its key (an owned entry's with its context)."""
    got = stored_at(key)
    if got is not None and got[1]:
        return f"{got[2]} (derived entry of context {got[1][:16]})"
    return key_of(key, ENTRY, errors="replace")


def execute_sync(
    plan: SyncPlan, src: Backend, dst: Backend, *, jobs: int = 4, progress: Progress | None = None
) -> SyncReport:
    """Copy what ``plan`` lists, a batch at a time: records read and verified ``jobs`` at a time
    and held in memory until their batch (at most ``BATCH_RECORDS`` records, about ``BATCH_BYTES``)
    is written with one ``put_many_if_absent`` (one transaction on LMDB; conditional requests,
    ``jobs`` at a time, on S3); ``progress(1, bytes)`` after each record. Raises the backends'
    errors (what was copied before stays: a re-run copies the rest)."""
    t0 = time.perf_counter()
    if plan.meta == "copy":
        dst.put_if_absent(META, plan.src_meta)
    counts = {"copied": 0, "present": 0, "vanished": 0, "corrupt": 0}
    totals = {"entries": 0, "derived": 0, "bytes": 0}
    corrupt: list[tuple[str, str]] = []
    unknown: list[tuple[str, str]] = []

    def write(batch: list[tuple[bytes, str, bytes | None, str]]) -> None:
        stored = iter(dst.put_many_if_absent([(k, v) for k, _, v, _ in batch if v is not None]))
        for key, outcome, value, reason in batch:
            size = 0
            if value is not None:
                if outcome == "unknown":
                    unknown.append((_name(key), reason))
                outcome = "copied" if next(stored) else "present"
                size = len(value) if outcome == "copied" else 0
            counts[outcome] += 1
            if outcome == "copied":
                totals["bytes"] += size
                totals["entries"] += key.startswith(ENTRY)
                totals["derived"] += key.startswith(OWNED)
            elif outcome == "corrupt":
                corrupt.append((_name(key), reason))
            if progress is not None:
                progress(1, size)

    with ThreadPoolExecutor(max(1, jobs), thread_name_prefix="kvstore-sync") as pool:
        # every entry is in DST before any record that names it, and every context's record
        # before its derived entries: an interrupted sync leaves entries no record names yet,
        # never a record whose chunks did not arrive
        for phase in ([k for k in plan.missing if _phase(k) == n] for n in range(3)):
            keys, batch, held = iter(phase), [], 0
            while group := list(itertools.islice(keys, max(1, jobs))):
                for key, (outcome, value, reason) in zip(group, pool.map(lambda k: _read(src, k), group)):
                    batch.append((key, outcome, value, reason))
                    held += len(value or b"")
                if len(batch) >= BATCH_RECORDS or held >= BATCH_BYTES:
                    write(batch)
                    batch, held = [], 0
            if batch:
                write(batch)
    return SyncReport(
        src=plan.src,
        dst=plan.dst,
        meta=plan.meta,
        present=plan.present + counts["present"],
        copied=counts["copied"],
        copied_entries=totals["entries"],
        copied_owned=totals["derived"],
        copied_bytes=totals["bytes"],
        vanished=counts["vanished"],
        corrupt=tuple(corrupt),
        seconds=time.perf_counter() - t0,
        unknown=tuple(unknown),
    )


def sync(
    src: str,
    dst: str,
    *,
    jobs: int = 4,
    progress: Progress | None = None,
    on_plan: Callable[[SyncPlan], None] | None = None,
) -> SyncReport:
    """Copy every record of store ``src`` that store ``dst`` lacks (paths or URLs, any backends;
    ``dst`` is created if absent). ``on_plan(plan)`` is called before copying. See
    :func:`execute_sync` for the rest."""
    source = open_backend(src, readonly=True)
    try:
        target = open_backend(dst)
        try:
            plan = plan_sync(source, target, src_name=src, dst_name=dst)
            if on_plan is not None:
                on_plan(plan)
            return execute_sync(plan, source, target, jobs=jobs, progress=progress)
        finally:
            target.close()
    finally:
        source.close()


__all__ = ["SyncPlan", "SyncReport", "execute_sync", "plan_sync", "sync"]
