"""A backend wrapper for tests: every call goes to the wrapped backend, and ``hook(op, keys,
when)`` runs ``"before"`` and ``"after"`` each mutating call (put, put_if_absent, put_many,
put_many_if_absent, delete, delete_many). With ``per_object`` the batched calls are made one object at a time, as an
object store makes them (so a hook, or a crash, can land between two objects of one batch);
without it a batch is one call, as LMDB commits it in one transaction."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

Hook = Callable[[str, Sequence[bytes], str], None]


class Hooked:
    def __init__(self, inner: Any, hook: Hook, *, per_object: bool = False):
        self._inner, self._hook, self.per_object = inner, hook, per_object

    def __getattr__(self, name: str) -> Any:  # reads and the optional features go straight through
        return getattr(self._inner, name)

    def _call(self, op: str, keys: Sequence[bytes], fn: Callable[[], Any]) -> Any:
        self._hook(op, keys, "before")
        result = fn()
        self._hook(op, keys, "after")
        return result

    def put(self, key: bytes, value) -> None:
        self._call("put", [key], lambda: self._inner.put(key, value))

    def put_if_absent(self, key: bytes, value) -> bool:
        return self._call("put_if_absent", [key], lambda: self._inner.put_if_absent(key, value))

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        items = list(items)
        if not self.per_object:
            self._call("put_many", [k for k, _ in items], lambda: self._inner.put_many(items))
            return
        for k, v in items:
            self.put(k, v)

    def put_many_if_absent(self, items) -> list[bool]:
        items = list(items)
        if not self.per_object:
            return self._call(
                "put_many_if_absent", [k for k, _ in items], lambda: self._inner.put_many_if_absent(items)
            )
        return [self.put_if_absent(k, v) for k, v in items]

    def delete(self, key: bytes) -> bool:
        return self._call("delete", [key], lambda: self._inner.delete(key))

    def delete_many(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)
        if not self.per_object:
            return self._call("delete_many", keys, lambda: self._inner.delete_many(keys))
        return sum(bool(self.delete(k)) for k in keys)

    def close(self) -> None:
        self._inner.close()
