"""Deprecated for one release: this module is :mod:`kvstore.store.owned_header`."""

from typing import Any


def __getattr__(name: str) -> Any:
    from kvstore.store import owned_header

    return getattr(owned_header, name)
