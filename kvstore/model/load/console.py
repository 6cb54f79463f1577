"""What the model layer prints and hides while loading: transformers' progress bars silenced,
exceptions shortened to one line, the one conversion message on stderr.

Shared by :mod:`kvstore.model.load.loading` and :mod:`kvstore.model.load.gguf` (its own module so that
neither imports the other for it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any


class NoBar:
    """Stands in for a tqdm bar: iterates, accepts every call, draws nothing."""

    def __init__(self, iterable: Any = None, *args: Any, **kwargs: Any) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable if self._iterable is not None else ())

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Silence transformers' progress bars while loading local files: the library's output is the
    one conversion line, and the CLI draws its own bars."""
    from transformers.utils import logging as hf_logging

    if not hasattr(hf_logging, "set_tqdm_hook"):  # older transformers 5.x: bars stay
        yield
        return
    previous = hf_logging.set_tqdm_hook(lambda factory, args, kwargs: NoBar(*args, **kwargs))
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)


def stderr_line(message: str) -> None:
    """Print ``message`` to stderr at once (the library's only output: one line per conversion)."""
    print(message, file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line of at most 300 characters (its type when empty)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
