"""Every error kvstore raises on purpose derives from :class:`KVStoreError`.

Messages are one line and say what to do next; the CLI prints them as they are.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Root of kvstore's own errors."""


class StoreError(KVStoreError):
    """The store cannot be opened or written (path, permissions, disk)."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """A read command was pointed at a store that does not exist."""


class ReadOnlyStoreError(StoreError, PermissionError):
    """A write was attempted on a store opened read-only or on an unwritable path."""


class StoreFullError(StoreError, OSError):
    """The disk (not the LMDB map, which grows by itself) is full."""


class StoreUnavailableError(StoreError, ConnectionError):
    """A remote store's server cannot be reached, does not answer in time, or dropped the
    connection. Everything committed before stays intact; re-run once the server is back."""


class StoreAccessError(StoreError, PermissionError):
    """A remote store's server rejected the credentials or denied reading."""


class FormatVersionError(KVStoreError):
    """A store or entry was written by a newer kvstore format than this one reads."""


class EntryNotFoundError(KVStoreError, KeyError):
    """No entry under that key."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the sentence
        return str(self.args[0]) if self.args else "entry not found"


class CorruptEntryError(KVStoreError, ValueError):
    """A stored value failed its checksum or does not decode to a well-formed entry."""


class DtypeError(KVStoreError, ValueError):
    """A dtype name kvstore does not know or cannot use there."""


class CodecError(KVStoreError, ValueError):
    """Unknown codec name or invalid codec options."""


class ModelNotFoundError(KVStoreError, LookupError):
    """A model name resolved to nothing loadable."""


class ModelError(KVStoreError):
    """A model cannot be used as asked (unsupported architecture, bad dtype or device)."""


class ContextTooLongError(KVStoreError, ValueError):
    """A context (plus question and answer) is longer than the model's positions."""


class DatasetError(KVStoreError, ValueError):
    """A dataset file is unreadable or a row is malformed; the message names file and line."""


class RequestError(KVStoreError, ValueError):
    """An evaluation request kvstore cannot serve as asked (e.g. sampling from a greedy decoder)."""


class PressError(KVStoreError, ValueError):
    """A press spec is malformed, or a press cannot run as asked (a question-aware press where
    there is no question, a model whose cache it cannot prune)."""


class ComposeError(KVStoreError, ValueError):
    """A composition policy is malformed, or contexts cannot be composed of passages as asked (a
    model whose keys cannot be moved to another position, passage rows mixed with others)."""


class CorruptEntryWarning(UserWarning):
    """A stored entry failed verification on load and was treated as a miss."""


class StoreOfflineWarning(UserWarning):
    """A remote store is unreachable; a local tier in front of it answers what it holds."""


class HookError(KVStoreError):
    """A generation context (a decode-time hook, e.g. a decode-attention variant) is malformed, or
    raised while the model ran under it; the message names the hook. Nothing stored is affected:
    hooks run only after every context is loaded or computed and stored."""
