"""How a store writes and reads an entry of any kind (:mod:`kvstore.store.kinds`): chunks and the
entries a context owns alike.

:class:`EntryAccess` holds the methods :class:`kvstore.store.kvstore.KVStore` has for them::

    key, blob = encode_pressed(facts, "kvzip:0.75", press, layers, codec)
    store.put(blob)                                      # kind, key and owner read from its frame
    with store.open(PRESSED_KIND, key, owner=facts.context) as view:  # verified; None: a miss
        keys, values = view.kv(0, 0)

Every kind is written once (:meth:`~EntryAccess._put_once`: a key that holds an intact entry of
the same facts keeps it) and read verified through one path (:meth:`~EntryAccess._open_in`:
through a local tier, a copy that fails to verify is dropped and the remote's read; a corrupt entry
warns once and reads as a miss, or raises where the caller asks for errors). An owned entry is
stored under ``x/<context>/<key>`` (:mod:`kvstore.store.keyspace`), its last use under ``a/<key>``
(written when the store closes, as for chunks).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import CorruptEntryError, CorruptEntryWarning, FormatVersionError
from kvstore.store.entry import CHUNK
from kvstore.store.frame import DERIVED_FORMAT, read_frame, verify_checksum
from kvstore.store.keyspace import OWNED, owned_prefix, owner_of
from kvstore.store.kinds import EntryKind, kind_of
from kvstore.store.owned import ANY_OWNED, OwnedView

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


def kind_of_blob(blob: bytes | memoryview) -> tuple[EntryKind, str, str]:
    """``(kind, owner, key)`` of the entry in ``blob``, read from its frame (format 5: the kind its
    header names, owned by its context; older formats: a chunk, owned by no context). Raises
    CorruptEntryError for bytes that are no entry, FormatVersionError for a kind or format this
    process does not know."""
    h, fmt, _ = read_frame(blob)
    kind: EntryKind = kind_of(h.get("kind", "")) if fmt == DERIVED_FORMAT else CHUNK
    header = kind.read_header(blob)[0]
    return kind, header.context if kind.owned else "", header.key


@dataclass(frozen=True)
class WantedEntry:
    """The entry a read asks for: its ``kind``, backend key ``name``, own ``key`` and, for an entry a
    context owns, the ``owner`` it must belong to."""

    kind: EntryKind
    name: bytes
    key: str
    owner: str = ""


class EntryAccess:
    """The kind-generic write and read of :class:`kvstore.store.kvstore.KVStore` (a mixin: it uses
    the store's ``backend``, ``codec``, ``readonly`` and its record of uses)."""

    backend: Backend
    codec: Codec
    readonly: bool
    url: str
    _touched: dict[str, float]
    _written: set[str]

    def _writable(self) -> None:  # pragma: no cover - KVStore's
        raise NotImplementedError

    # -- writing ----------------------------------------------------------------------------------
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

    def _put_blob(self, blob: bytes) -> int:
        """Store the entry ``blob`` of any kind (its checksum verified, its kind, owner and key read
        from its frame) once; returns its size."""
        self._writable()
        verify_checksum(blob)
        kind, owner, key = kind_of_blob(blob)
        if self._put_once(kind, kind.address(key, owner), key, blob) and not kind.owned:
            self._written.add(key)  # a chunk no record of this handle's names yet
        return len(blob)

    # -- reading ----------------------------------------------------------------------------------
    def _verified(
        self, wanted: WantedEntry, buf: Any, stack: contextlib.ExitStack | None, *, lazy: bool = False,
        checked: BaseException | bool = False, strict: bool = False, stacklevel: int = 4,
    ) -> Any:  # fmt: skip
        """The verified view of the ``wanted`` entry in ``buf``, or None when it is corrupt (it
        warns; ``strict``: it raises CorruptEntryError instead, and None means the remote lost it).
        ``checked``: True when ``buf``'s checksum was verified already, or the exception verifying
        it raised. A corrupt copy in a local tier is dropped and the remote's read instead (its
        view kept open on ``stack``): a tier's fault stays local."""
        kind, name, key, owner = wanted.kind, wanted.name, wanted.key, wanted.owner
        try:
            if isinstance(checked, BaseException):
                raise checked
            view = kind.decode(buf, key=key, threads=self.codec.decode_threads(), lazy=lazy, checked=bool(checked))
            if owner and view.header.context != owner:
                raise CorruptEntryError(f"it belongs to context {view.header.context[:12]}")
        except CorruptEntryError as exc:
            if stack is not None and self.backend.drop_local([name]):
                if not strict:
                    warnings.warn(
                        f"kvstore: the local tier's copy of {kind.noun} {key[:16]} is corrupt ({exc}); dropped it, "
                        "reading the remote's",
                        CorruptEntryWarning,
                        stacklevel=stacklevel,
                    )
                fresh = stack.enter_context(self.backend.view(name))
                return None if fresh is None else self._verified(wanted, fresh, None, lazy=lazy, strict=strict,
                                                                 stacklevel=stacklevel)  # fmt: skip
            if strict:
                raise
            where = f" of context {owner[:16]}" if owner else ""
            warnings.warn(
                f"kvstore: {kind.noun} {key[:16]}{where} is corrupt ({exc}); treating it as a miss",
                CorruptEntryWarning,
                stacklevel=stacklevel,
            )
            return None
        self._touched[key] = time.time()
        return view

    def _open_in(self, stack: contextlib.ExitStack, kind: EntryKind, key: str, owner: str = "", *,
                 strict: bool = False) -> Any:  # fmt: skip
        """The one verified open: the view of the entry ``key`` of ``kind`` (of ``owner``) kept open
        on ``stack``, or None when it is missing (or corrupt, unless ``strict``)."""
        name = kind.address(key, owner)
        buf = stack.enter_context(self.backend.view(name))
        if buf is None:
            return None
        return self._verified(WantedEntry(kind, name, key, owner), buf, stack, strict=strict, stacklevel=5)

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
        with contextlib.ExitStack() as stack:
            yield self._open_in(stack, kind, key, owner)

    # -- the entries a context owns ---------------------------------------------------------------
    def owned_entries(self) -> list[tuple[str, str]]:
        """``(context, key)`` of every entry a context owns, in key order."""
        return [got for got in map(owner_of, self.backend.keys(OWNED)) if got is not None]

    def owned_keys(self, context: str) -> list[str]:
        """Keys of the entries context ``context`` owns (any kind), in key order."""
        named = filter(None, map(owner_of, self.backend.keys(owned_prefix(context))))
        return [key for owner, key in named if owner == context]

    # -- deprecated names (one release): put(blob), has(kind, ...), open(kind, ...) ----------------
    def put_derived(self, blob: bytes) -> int:
        """Deprecated: :meth:`put` (``store.put(blob)``) stores an entry of any kind."""
        return self._put_blob(blob)

    def has_derived(self, context: str, key: str) -> bool:
        """Deprecated: ``store.has(kind, key, owner=context)``."""
        return self.has(ANY_OWNED, key, context)

    def open_derived(self, context: str, key: str) -> contextlib.AbstractContextManager[OwnedView | None]:
        """Deprecated: ``store.open(kind, key, owner=context)`` (any owned kind: ``ANY_OWNED``)."""
        return self.open(ANY_OWNED, key, context)

    all_derived = owned_entries
    derived_keys = owned_keys


__all__ = ["EntryAccess", "WantedEntry", "kind_of_blob"]
