"""Deprecated for one release: this module is :mod:`kvstore.store.owned` (and
:mod:`kvstore.store.owned_header`; the encoders are their kinds':
:mod:`kvstore.store.kind_scores`, :mod:`kvstore.store.kind_pressed`); its old names read from there."""

from typing import Any


def __getattr__(name: str) -> Any:
    from kvstore.store import kind_pressed, kind_scores, owned, owned_header

    for module in (owned, owned_header, kind_scores, kind_pressed):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)
