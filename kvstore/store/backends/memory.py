"""An in-process backend (a dict). Stores opened with the same ``memory://NAME`` share data."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from kvstore.errors import ReadOnlyStoreError
from kvstore.store.backends.base import BackendBase

_SHARED: dict[str, dict[bytes, bytes]] = {}
_LOCK = threading.Lock()


class MemoryBackend(BackendBase):
    local = True

    def __init__(self, name: str = "", *, readonly: bool = False):
        self.readonly = readonly
        with _LOCK:
            # an unnamed memory store is private to this object
            self._data = _SHARED.setdefault(name, {}) if name else {}

    def _writable(self) -> None:
        if self.readonly:
            raise ReadOnlyStoreError("this store was opened read-only")

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        value = self._data.get(key)
        yield None if value is None else memoryview(value)

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        self._writable()
        self._data[key] = bytes(value)

    def put_if_absent(self, key: bytes, value: bytes | memoryview) -> bool:
        self._writable()
        with _LOCK:  # one check-and-set, so that racing writers see one winner
            if key in self._data:
                return False
            self._data[key] = bytes(value)
            return True

    def delete(self, key: bytes) -> bool:
        self._writable()
        return self._data.pop(key, None) is not None

    def contains(self, key: bytes) -> bool:
        return key in self._data

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        return iter(sorted(k for k in list(self._data) if k.startswith(prefix)))

    def close(self) -> None:
        pass
