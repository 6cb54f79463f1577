"""A store's derived entries (:mod:`kvstore.store.derived`): written once, read verified.

:class:`DerivedEntries` holds the methods :class:`kvstore.store.kvstore.KVStore` has for them, beside
its chunk methods::

    key, blob = encode_pressed(facts, "kvzip:0.75", press, layers, codec)
    store.put_derived(blob)                              # x/<context>/<key>, written once
    with store.open_derived(facts.context, key) as view: # verified; None: a miss (compute it)
        keys, values = view.kv(0, 0)

A derived entry is stored under ``x/<context>/<key>`` (:mod:`kvstore.store.keyspace`), its last use
under ``a/<key>`` (written when the store closes, as for chunks). Through a local tier, a copy that
fails its checksum is dropped and the remote's read, as for chunks.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstore.errors import CorruptEntryError, CorruptEntryWarning, FormatVersionError
from kvstore.store.derived import DerivedView, decode_derived
from kvstore.store.derived_header import DerivedHeader, read_derived_header
from kvstore.store.header import verify_checksum
from kvstore.store.keyspace import DERIVED, derived_entry_key, derived_of, derived_prefix

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store.backends.base import Backend
    from kvstore.store.codecs import Codec


def _facts(h: DerivedHeader) -> tuple:
    return (h.context, h.kind, h.spec, h.model, h.dtype, h.n_tokens, h.layers, h.identity, h.scores_dtype)


def same_derived(stored: memoryview, blob: bytes, key: str) -> bool:
    """Whether ``stored`` is an intact derived entry with the facts of ``blob`` (only ``created``,
    ``press`` and a lossless codec may differ): another writer's copy, kept. A newer format's
    entry counts as the same (it is left to that version)."""
    try:
        old = decode_derived(stored, key=key)
    except FormatVersionError:
        return True
    except CorruptEntryError:
        return False
    return _facts(old.header) == _facts(read_derived_header(blob)[0])


class DerivedEntries:
    """The derived-entry methods of :class:`kvstore.store.kvstore.KVStore` (a mixin: it uses the
    store's ``backend``, ``codec``, ``readonly`` and its record of uses)."""

    backend: Backend
    codec: Codec
    readonly: bool
    url: str
    _touched: dict[str, float]

    def _writable(self) -> None:  # pragma: no cover - KVStore's
        raise NotImplementedError

    def put_derived(self, blob: bytes) -> int:
        """Store a derived entry's bytes (from :func:`~kvstore.store.derived.encode_scores` or
        :func:`~kvstore.store.derived.encode_pressed`) under its context and key, read from its
        header; returns its size. Written once: a key that holds an intact entry of the same facts
        keeps it (another writer's), a corrupt or different one is replaced. Raises
        ReadOnlyStoreError on a read-only store, CorruptEntryError for bytes that are not an intact
        derived entry."""
        self._writable()
        verify_checksum(blob)
        header, _ = read_derived_header(blob)
        name = derived_entry_key(header.context, header.key)
        if self.backend.put_if_absent(name, blob):
            return len(blob)
        with self.backend.origin().view(name) as buf:  # not a local tier's copy
            keep = buf is not None and same_derived(buf, blob, header.key)
        if not keep:
            self.backend.put(name, blob)
        return len(blob)

    def has_derived(self, context: str, key: str) -> bool:
        """Whether the derived entry ``key`` of context ``context`` is stored (not verified)."""
        return self.backend.contains(derived_entry_key(context, key))

    @contextlib.contextmanager
    def open_derived(self, context: str, key: str) -> Iterator[DerivedView | None]:
        """Verified zero-copy access to the derived entry ``key`` of context ``context``; yields
        None when it is missing, and when it is corrupt or not what was asked for (its header
        names another context or key): then it warns :class:`CorruptEntryWarning` once, and the
        caller treats it as a miss (recomputes it). Raises FormatVersionError for an entry of a
        newer format."""
        name = derived_entry_key(context, key)
        with contextlib.ExitStack() as stack:
            buf = stack.enter_context(self.backend.view(name))
            yield None if buf is None else self._derived_view(context, key, buf, stack)

    def _derived_view(self, context: str, key: str, buf, stack: contextlib.ExitStack) -> DerivedView | None:
        name = derived_entry_key(context, key)
        for attempt in range(2):
            try:
                view = decode_derived(buf, key=key, threads=self.codec.decode_threads())
                if view.header.context != context:
                    raise CorruptEntryError(f"it belongs to context {view.header.context[:12]}")
            except CorruptEntryError as exc:
                if attempt == 0 and self.backend.drop_local([name]):  # a tier's fault stays local
                    warnings.warn(
                        f"kvstore: the local tier's copy of derived entry {key[:16]} is corrupt ({exc}); dropped it, "
                        "reading the remote's",
                        CorruptEntryWarning,
                        stacklevel=5,
                    )
                    buf = stack.enter_context(self.backend.view(name))
                    if buf is None:
                        return None
                    continue
                warnings.warn(
                    f"kvstore: derived entry {key[:16]} of context {context[:16]} is corrupt ({exc}); treating it as "
                    "a miss",
                    CorruptEntryWarning,
                    stacklevel=5,
                )
                return None
            self._touched[key] = time.time()
            return view
        return None  # pragma: no cover - the loop returns

    def all_derived(self) -> list[tuple[str, str]]:
        """``(context, derived key)`` of every derived entry of the store, in key order."""
        return [got for got in map(derived_of, self.backend.keys(DERIVED)) if got is not None]

    def derived_keys(self, context: str) -> list[str]:
        """Keys of the derived entries of context ``context`` (any kind), in key order."""
        out = []
        for name in self.backend.keys(derived_prefix(context)):
            got = derived_of(name)
            if got is not None and got[0] == context:
                out.append(got[1])
        return out


__all__ = ["DerivedEntries", "same_derived"]
