"""The kinds of entry a store holds, in one table: chunks (a context's cache, chunk by chunk) and
the entries a context owns (its scores, its pressed caches), each kind one object.

An :class:`EntryKind` says how its entries read (header, sizes, tensors, decoding) and what the
store's management makes of them; the store's ``has`` / ``open`` and its write-once put, its scan,
gc, removal, sync, export, verify and stats ask the kind, never compare its name. An entry a
context owns is stored under ``x/<context>/<key>`` in the format-5 frame
(:mod:`kvstore.store.owned`); its header's ``kind`` names its row here.

Adding a kind is one module defining it (an :class:`OwnedKind`: its layer records, its own header
fields, its view, its encoder; see :mod:`kvstore.store.kind_scores`) and one row in
:data:`BUILTIN_KINDS`; :func:`register_kind` adds one at run time (a plug-in; a test's:
``tests/helpers/kind_summary.py``).
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store.keyspace import ENTRY, OWNED, entry_name

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvstore.store.codecs import Codec, TensorRecord

# an owned entry's header (kvstore.store.owned_header, which reads this table)
OwnedHeader: TypeAlias = Any
L_co = TypeVar("L_co", covariant=True)  # a kind's layer record
V = TypeVar("V")  # a kind's view of a verified entry


class EntryKind(Protocol):
    """What every kind of entry says of itself (chunks included)."""

    name: str  # as an owned entry's header names its kind ("chunk" for chunk entries)
    owned: bool  # stored under its context (x/<context>/<key>) rather than by its own key (e/<key>)
    # its entries alone make their context known (a chain of chunks; a pressed cache, which serves
    # the context by itself): written before the entries that only add to a context, removed after
    stands_for_context: bool
    noun: str  # how messages name one ("entry", "derived entry")

    def address(self, key: str, owner: str = "") -> bytes:
        """The backend key of the entry ``key`` (of the context ``owner``, for an owned kind)."""
        ...

    def read_header(self, buf: bytes | memoryview) -> tuple[Any, int]:
        """``(header, payload offset)``, without verifying the checksum; CorruptEntryError."""
        ...

    def check_sizes(self, header: Any, payload_bytes: int) -> None:
        """Raise CorruptEntryError unless the header's declared sizes agree (before allocating)."""
        ...

    def decode(self, buf: bytes | memoryview, *, key: str | None = None, threads: int = 1, lazy: bool = False,
               checked: bool = False) -> Any:  # fmt: skip
        """A verified view of the entry in ``buf``; CorruptEntryError or FormatVersionError."""
        ...

    def same_facts(self, old: Any, blob: bytes) -> bool:
        """Whether the decoded stored entry ``old`` holds what the bytes ``blob`` (to be written
        under the same key) do: then it is another writer's copy, kept."""
        ...


class OwnedKind(EntryKind, Protocol[L_co, V]):
    """A kind of entry a context owns (format 5): the shared header (:class:`OwnedHeader`: its
    ``layers`` this kind's records ``L_co``, its ``fields`` this kind's own header fields) and this
    kind's tensors, read into its own view ``V``. :class:`kvstore.store.owned.OwnedKindBase` is the
    half every such kind shares (and the defaults of a kind that keeps no part of its context)."""

    # keeps a part of the context's (token, head) pairs: listings show the kept fraction
    keeps_part: bool
    lossless_only: bool  # never quantized, whatever the codec (its key has no codec identity)

    def layer(self, record: Mapping[str, Any], n_tokens: int, i: int) -> L_co:
        """Layer ``i``'s record from the header, checked; CorruptEntryError."""
        ...

    def check_header(self, h: Mapping[str, Any]) -> Mapping[str, Any]:
        """The kind's own header fields, checked (CorruptEntryError), as the header keeps them."""
        ...

    def value_bytes(self, header: OwnedHeader) -> int:
        """Bytes of the stored values alone, uncompressed."""
        ...

    def data_bytes(self, header: OwnedHeader) -> int:
        """Bytes of every stored tensor, uncompressed (the values, and what else the kind stores)."""
        ...

    def kept_pairs(self, header: OwnedHeader) -> int:
        """(token, head) pairs kept over every layer (0 for a kind that keeps no part)."""
        ...

    def kept_fraction(self, header: OwnedHeader) -> float:
        """``kept_pairs`` over every (token, head) pair of the context (1.0: all of them)."""
        ...

    def tensor_names(self, header: OwnedHeader, codec: Codec) -> list[str]:
        """The payload's tensor names, as the header and codec say they are."""
        ...

    def view(self, header: OwnedHeader, records: Mapping[str, TensorRecord], codec: Codec) -> V:
        """The kind's view of a verified entry (its ``header`` and tensors), each tensor checked
        against the header; CorruptEntryError."""
        ...

    def export_tensors(self, view: V) -> dict[str, torch.Tensor]:
        """The tensors an export writes (``kvstore export``), by name."""
        ...


# The table: kind name -> "module:attribute" of its object, imported when first asked for (a kind
# module imports the store's modules; the table stays below them).
BUILTIN_KINDS: dict[str, str] = {
    "chunk": "kvstore.store.entry:CHUNK",
    "scores": "kvstore.store.kind_scores:KIND",
    "pressed": "kvstore.store.kind_pressed:KIND",
}
_lock = threading.Lock()
_KIND_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")  # what a kind's name can be
_loaded: dict[str, EntryKind] = {}


def register_kind(kind: EntryKind) -> EntryKind:
    """Add ``kind`` to the table (a kind of owned entry a store then reads, lists, verifies,
    removes, syncs and exports); returns it. Raises ValueError for a name already taken."""
    if not _KIND_NAME.match(kind.name):
        raise ValueError(f"an entry kind's name is lower-case letters, digits and _, not {kind.name!r}")
    with _lock:
        if kind.name in BUILTIN_KINDS or kind.name in _loaded:
            raise ValueError(f"an entry kind {kind.name!r} is already registered")
        _loaded[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove a kind :func:`register_kind` added (built-in kinds stay)."""
    if name not in BUILTIN_KINDS:
        _loaded.pop(name, None)


# what reads the entries under each prefix: chunks; entries a context owns, of any kind (its header names it)
_BY_PREFIX: dict[bytes, str] = {ENTRY: "kvstore.store.entry:CHUNK", OWNED: "kvstore.store.owned:ANY_OWNED"}


def _load(where: str) -> Any:
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)


def stored_at(backend_key: bytes) -> tuple[EntryKind, str, str] | None:
    """``(kind, owner, key)`` of the entry stored under ``backend_key`` (the kind that reads it:
    the chunk kind, or any owned kind, whose header says which; ``owner`` ``""`` for a chunk), or
    None for a name that is no entry (:func:`kvstore.store.keyspace.entry_name`)."""
    got = entry_name(backend_key)
    if got is None:
        return None
    prefix, owner, key = got
    return _load(_BY_PREFIX[prefix]), owner, key


def find_kind(name: str) -> EntryKind | None:
    """The kind named ``name``, or None for a name the table does not hold."""
    got = _loaded.get(name)
    if got is None and name in BUILTIN_KINDS:
        got = _load(BUILTIN_KINDS[name])
        with _lock:
            _loaded[name] = got
    return got


def kind_of(name: str) -> Any:
    """The kind of owned entry named ``name`` (an :class:`OwnedKind`). Raises FormatVersionError
    for a name this process does not know (a plug-in's kind, or a newer kvstore's: such an entry is
    kept, never taken for corrupt), CorruptEntryError for one that is no name or not an owned kind."""
    got = find_kind(name) if isinstance(name, str) else None
    if got is None and isinstance(name, str) and _KIND_NAME.match(name):
        raise FormatVersionError(
            f"derived entry of kind {name!r}, which this process does not know (a plug-in's kind not loaded, or a "
            "newer kvstore's) - load the plug-in or upgrade kvstore"
        )
    if got is None or not got.owned:
        raise CorruptEntryError(f"derived entry header has an unknown kind {name!r}")
    return got


def stands_for_context(name: str) -> bool:
    """Whether entries of the kind ``name`` alone make their context known (False for a name the
    table does not hold: an unreadable entry stands for nothing)."""
    kind = find_kind(name)
    return kind is not None and kind.stands_for_context


def keeps_part(name: str) -> bool:
    """Whether entries of the kind ``name`` keep a part of their context (a kept fraction to show)."""
    kind = find_kind(name)
    return bool(getattr(kind, "keeps_part", False))


__all__ = [
    "BUILTIN_KINDS",
    "EntryKind",
    "OwnedKind",
    "find_kind",
    "keeps_part",
    "kind_of",
    "register_kind",
    "stands_for_context",
    "stored_at",
    "unregister_kind",
]
