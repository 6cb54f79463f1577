"""Options classes whose fields are keywords: one place per option.

An options class is a frozen dataclass whose fields are declared with :func:`option` (a default and
one line saying what it means) and whose class is decorated with :func:`documented` (the fields and
their defaults are appended to its docstring). A method that takes one is decorated with
:func:`takes_options`: its written signature has one ``options`` parameter, and its public
signature (``inspect.signature``, ``help()``, the docs) gains every field of the class as a
keyword, with the field's default and its line in the method's docstring. A call's field keywords
replace the fields of the ``options`` given (``cls.of(options, **fields)``), so the method body
receives one complete options object. Adding an option is one field; no method repeats it.

Plain Python (no torch): the command line reads the same fields' defaults for its flags.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

R = TypeVar("R")
C = TypeVar("C", bound=type)
T = TypeVar("T")


def option(default: Any, doc: str) -> Any:
    """A field of an options class: its ``default`` and ``doc``, one line saying what it is (shown
    by ``help()`` on the class and on every method that takes it)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def field_default(cls: type, name: str) -> Any:
    """The default of the field ``name`` of the options class ``cls`` (KeyError for no such field)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def field_lines(cls: type) -> list[str]:
    """One line per field of ``cls``: ``name (type, default D): what it is``."""
    lines = []
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        lines.append(f"``{f.name}`` ({kind}, default {f.default!r}): {f.metadata.get('doc', '')}")
    return lines


def replaced(cls: type[T], options: T | None, fields: dict[str, Any]) -> T:
    """``options`` (None: ``cls()``) with ``fields`` replaced. TypeError when ``options`` is not a
    ``cls`` or a field does not exist (naming the known ones)."""
    base = options if options is not None else cls()
    if not isinstance(base, cls):
        raise TypeError(f"options must be a {cls.__name__}, not {type(base).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown {cls.__name__} field(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return dataclasses.replace(base, **fields) if fields else base  # type: ignore[type-var]


def documented(cls: C) -> C:
    """Class decorator: appends the fields of the options dataclass ``cls``, their defaults and what
    they are to its docstring. Raises TypeError for a field declared without :func:`option`."""
    bare = [f.name for f in dataclasses.fields(cls) if "doc" not in f.metadata]
    if bare:
        raise TypeError(f"{cls.__name__}: declare {', '.join(bare)} with option(default, doc)")
    lines = "\n".join(f"* {x}" for x in field_lines(cls))
    cls.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\nFields:\n\n{lines}"
    return cls


def takes_options(
    cls: type, *, first: str | None = None, unknown: Callable[[Iterable[str]], None] | None = None
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Method decorator: the method receives one complete ``options`` object of the options class
    ``cls``; its callers may also name every field of ``cls`` as a keyword.

    The written method declares an ``options`` parameter and none of the fields. Its public
    signature is the written one with ``options`` defaulting to None (``cls()``) and every field
    added as a keyword-only parameter with the field's default; ``first`` names a field that comes
    right after the written positional parameters instead, positional or keyword (the research
    code's ``greedy_sample(contexts, questions, 20)``). A call's field keywords replace those fields
    of ``options`` (:func:`replaced`). An unknown keyword is the TypeError Python
    gives, unless ``unknown`` is given: it is called with the unknown names (and should raise)."""
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]

    def deco(fn: Callable[..., R]) -> Callable[..., R]:
        written = inspect.signature(fn)
        if "options" not in written.parameters:
            raise TypeError(f"{fn.__qualname__}: takes_options needs an 'options' parameter")
        clash = sorted(set(names) & set(written.parameters))
        if clash:
            raise TypeError(f"{fn.__qualname__}: {', '.join(clash)} come from {cls.__name__}; do not declare them")
        public = _public_signature(written, cls, fields, first)
        allowed = set(public.parameters)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> R:
            if unknown is not None and set(kwargs) - allowed:
                unknown(sorted(set(kwargs) - allowed))
            bound = public.bind(*args, **kwargs)
            given = {k: bound.arguments.pop(k) for k in names if k in bound.arguments}
            bound.arguments["options"] = replaced(cls, bound.arguments.get("options"), given)
            return fn(**bound.arguments)

        wrapper.__signature__ = public  # type: ignore[attr-defined]
        wrapper.__doc__ = _doc(fn, cls)
        wrapper.__options__ = cls  # type: ignore[attr-defined]
        return wrapper

    return deco


def _public_signature(
    written: inspect.Signature, cls: type, fields: tuple[dataclasses.Field, ...], first: str | None
) -> inspect.Signature:
    """``written`` with ``options`` optional and the fields of ``cls`` as parameters."""
    P = inspect.Parameter
    positional: list[inspect.Parameter] = []
    keyword: list[inspect.Parameter] = []
    for p in written.parameters.values():
        if p.name == "options":
            p = p.replace(default=None, annotation=f"{cls.__name__} | None")
            if first is not None:
                p = p.replace(kind=P.KEYWORD_ONLY)
        (keyword if p.kind is P.KEYWORD_ONLY else positional).append(p)
    by_name = {f.name: P(f.name, P.KEYWORD_ONLY, default=f.default, annotation=f.type) for f in fields}
    if first is not None:
        positional.append(by_name.pop(first).replace(kind=P.POSITIONAL_OR_KEYWORD))
    return written.replace(parameters=[*positional, *keyword, *by_name.values()])


def _doc(fn: Callable, cls: type) -> str:
    """The method's docstring, then the keywords it takes from ``cls``."""
    head = inspect.cleandoc(fn.__doc__ or "")
    lines = "\n".join(f"* {x}" for x in field_lines(cls))
    return (
        f"{head}\n\nKeywords from :class:`{cls.__name__}`: each replaces that field of ``options``; one left out\n"
        f"keeps the field of ``options``, or its default below.\n\n{lines}"
    )


__all__ = ["documented", "field_default", "field_lines", "option", "replaced", "takes_options"]
