"""Deprecated for one release: this module is :mod:`kvstore.store.owned` (and
:mod:`kvstore.store.owned_header`); its old names read from there."""

from typing import Any


def __getattr__(name: str) -> Any:
    from kvstore.store import owned, owned_header

    return getattr(owned, name) if hasattr(owned, name) else getattr(owned_header, name)
