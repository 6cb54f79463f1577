"""How a store writes and reads an entry of any kind (:mod:`kvstore.store.kinds`), and the entries
a context owns (derived entries, :mod:`kvstore.store.derived`).

:class:`DerivedEntries` holds the methods :class:`kvstore.store.kvstore.KVStore` has for them::

    key, blob = encode_pressed(facts, "kvzip:0.75", press, layers, codec)
    store.put_derived(blob)                              # x/<context>/<key>, written once
    with store.open_derived(facts.context, key) as view: # verified; None: a miss (compute it)
        keys, values = view.kv(0, 0)

Every kind is written once (:meth:`~DerivedEntries._put_once`: a key that holds an intact entry
of the same facts keeps it) and read verified (:meth:`~DerivedEntries._open_verified`: through a
local tier, a copy that fails to verify is dropped and the remote's read; a corrupt entry warns
once and reads as a miss). A derived entry is stored under ``x/<context>/<key>``
(:mod:`kvstore.store.keyspace`), its last use under ``a/<key>`` (written when the store closes, as
for chunks).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvstore.errors import CorruptEntryError, CorruptEntryWarning, FormatVersionError
from kvstore.store.derived import ANY_OWNED, DerivedView
from kvstore.store.derived_header import read_derived_header
from kvstore.store.frame import verify_checksum
from kvstore.store.keyspace import OWNED, owned_prefix, owner_of
from kvstore.store.kinds import EntryKind, kind_of

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.backends.base import Backend
    from kvstore.store.codecs import Codec


def _same(kind: EntryKind, stored: memoryview, blob: bytes, key: str) -> bool:
    """Whether ``stored`` is an intact entry with the facts of ``blob`` (another writer's copy,
    kept). A newer format's entry counts as the same (it is left to that version)."""
    try:
        old = kind.decode(stored, key=key)
    except FormatVersionError:
        return True
    except CorruptEntryError:
        return False
    return kind.same_facts(old, blob)


class DerivedEntries:
    """The kind-generic write and read of :class:`kvstore.store.kvstore.KVStore`, and its methods
    for derived entries (a mixin: it uses the store's ``backend``, ``codec``, ``readonly`` and its
    record of uses)."""

    backend: Backend
    codec: Codec
    readonly: bool
    url: str
    _touched: dict[str, float]

    def _writable(self) -> None:  # pragma: no cover - KVStore's
        raise NotImplementedError

    # -- every kind -------------------------------------------------------------------------------
    def _put_once(self, kind: EntryKind, name: bytes, key: str, blob: bytes) -> bool:
        """Store ``blob`` (an entry of ``kind`` whose own key is ``key``) under the backend key
        ``name``, unless it holds an intact entry of the same facts; True when written."""
        if self.backend.put_if_absent(name, blob):
            return True
        with self.backend.origin().view(name) as buf:  # not a local tier's copy
            keep = buf is not None and _same(kind, buf, blob, key)
        if not keep:
            self.backend.put(name, blob)
        return not keep

    def _open_verified(
        self, kind: EntryKind, name: bytes, key: str, buf: Any, stack: contextlib.ExitStack | None, *,
        owner: str = "", lazy: bool = False, checked: BaseException | bool = False,
    ) -> Any:  # fmt: skip
        """The verified view of the entry ``key`` of ``kind`` in ``buf`` (backend key ``name``;
        ``owner``: the context an owned entry must belong to), or None when it is corrupt (it
        warns). ``checked``: True when ``buf``'s checksum was verified already, or the exception
        verifying it raised. A corrupt copy in a local tier is dropped and the remote's read
        instead (its view kept open on ``stack``): a tier's fault stays local."""
        noun = kind.noun
        try:
            if isinstance(checked, BaseException):
                raise checked
            view = kind.decode(buf, key=key, threads=self.codec.decode_threads(), lazy=lazy, checked=bool(checked))
            if owner and view.header.context != owner:
                raise CorruptEntryError(f"it belongs to context {view.header.context[:12]}")
        except CorruptEntryError as exc:
            if stack is not None and self.backend.drop_local([name]):
                warnings.warn(
                    f"kvstore: the local tier's copy of {noun} {key[:16]} is corrupt ({exc}); dropped it, reading the "
                    "remote's",
                    CorruptEntryWarning,
                    stacklevel=4,
                )
                fresh = stack.enter_context(self.backend.view(name))
                return None if fresh is None else self._open_verified(kind, name, key, fresh, None, owner=owner,
                                                                      lazy=lazy)  # fmt: skip
            where = f" of context {owner[:16]}" if owner else ""
            warnings.warn(
                f"kvstore: {noun} {key[:16]}{where} is corrupt ({exc}); treating it as a miss",
                CorruptEntryWarning,
                stacklevel=4,
            )
            return None
        self._touched[key] = time.time()
        return view

    def has(self, kind: EntryKind, key: str, owner: str = "") -> bool:
        """Whether the entry ``key`` of ``kind`` (owned by the context ``owner``, for a kind a
        context owns) is stored (not verified)."""
        return self.backend.contains(kind.address(key, owner))

    @contextlib.contextmanager
    def open(self, kind: EntryKind, key: str, owner: str = "") -> Iterator[Any]:
        """Verified zero-copy access to the entry ``key`` of ``kind`` (owned by the context
        ``owner``, for a kind a context owns); yields None when it is missing, and when it is
        corrupt or not what was asked for: then it warns :class:`CorruptEntryWarning` once, and
        the caller treats it as a miss. Raises FormatVersionError for an owned entry of a newer
        format."""
        name = kind.address(key, owner)
        with contextlib.ExitStack() as stack:
            buf = stack.enter_context(self.backend.view(name))
            yield None if buf is None else self._open_verified(kind, name, key, buf, stack, owner=owner)

    # -- entries a context owns ------------------------------------------------------------------
    def put_derived(self, blob: bytes) -> int:
        """Store a derived entry's bytes (from :func:`~kvstore.store.derived.encode_scores`,
        :func:`~kvstore.store.derived.encode_pressed`, or any kind's encoder) under its context and
        key, read from its header; returns its size. Written once: a key that holds an intact
        entry of the same facts keeps it (another writer's), a corrupt or different one is
        replaced. Raises ReadOnlyStoreError on a read-only store, CorruptEntryError for bytes that
        are not an intact derived entry."""
        self._writable()
        verify_checksum(blob)
        header, _ = read_derived_header(blob)
        kind = kind_of(header.kind)
        self._put_once(kind, kind.address(header.key, header.context), header.key, blob)
        return len(blob)

    def has_derived(self, context: str, key: str) -> bool:
        """Whether the derived entry ``key`` of context ``context`` is stored (not verified)."""
        return self.has(ANY_OWNED, key, context)

    @contextlib.contextmanager
    def open_derived(self, context: str, key: str) -> Iterator[DerivedView | None]:
        """Verified zero-copy access to the derived entry ``key`` of context ``context``; yields
        None when it is missing, and when it is corrupt or not what was asked for (its header
        names another context or key): then it warns :class:`CorruptEntryWarning` once, and the
        caller treats it as a miss (recomputes it). Raises FormatVersionError for an entry of a
        newer format."""
        name = ANY_OWNED.address(key, context)
        with contextlib.ExitStack() as stack:  # as open(), one frame less (the warnings name the caller)
            buf = stack.enter_context(self.backend.view(name))
            yield None if buf is None else self._open_verified(ANY_OWNED, name, key, buf, stack, owner=context)

    def owned_entries(self) -> list[tuple[str, str]]:
        """``(context, key)`` of every entry a context owns (derived entries), in key order."""
        return [got for got in map(owner_of, self.backend.keys(OWNED)) if got is not None]

    def owned_keys(self, context: str) -> list[str]:
        """Keys of the entries context ``context`` owns (any kind), in key order."""
        out = []
        for name in self.backend.keys(owned_prefix(context)):
            got = owner_of(name)
            if got is not None and got[0] == context:
                out.append(got[1])
        return out

    # the names these had before kinds were one table
    all_derived = owned_entries
    derived_keys = owned_keys


__all__ = ["DerivedEntries"]
