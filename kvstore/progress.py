"""The library's one progress convention.

Long operations take an optional ``progress`` callable and call ``progress(items, amount)`` with
increments: ``items`` finished since the last call (contexts, questions, entries) and ``amount``
of work in them (tokens, or bytes for store scans). The CLI turns it into a progress bar; the
library never draws anything itself.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[int, int], None]

__all__ = ["Progress"]
