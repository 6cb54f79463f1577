"""Options classes whose fields are keywords: one place per option.

An options class is a frozen dataclass whose fields are declared with :func:`option` (a default and
one line saying what it means) and whose class is decorated with :func:`documented` (the fields and
their defaults are appended to its docstring). A method that takes one is decorated with
:func:`takes_options`: its written signature has one ``options`` parameter and ``**fields:
Unpack[K]``, ``K`` the ``TypedDict`` of the class's fields as keywords (PEP 692: the type checker
sees each keyword and its type at every call site), and its public signature (``inspect.signature``,
``help()``, the docs) has every field of the class as a keyword instead, with the field's default and
its line in the method's docstring. A call's field keywords replace the fields of the ``options``
given (``cls.of(options, **fields)``) before the body runs, so the body receives one complete options
object (and no ``fields``). Adding an option is one field, and its name and accepted type in the
``TypedDict`` (a test keeps the two equal); no method repeats it.

Plain Python (no torch): the command line reads the same fields' defaults for its flags.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

C = TypeVar("C", bound=type)
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


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
) -> Callable[[F], F]:
    """Method decorator: the method receives one complete ``options`` object of the options class
    ``cls``; its callers may also name every field of ``cls`` as a keyword.

    The written method declares an ``options`` parameter defaulting to None and ``**fields`` typed
    with the class's keywords (``Unpack[...]``), and no field but ``first``: a field that comes
    positionally (the research code's ``greedy_sample(contexts, questions, 20)``), declared where it
    comes with a default of None. Its public signature is the written one with ``**fields`` replaced by
    every field as a keyword-only parameter with the field's default (``first`` where it is written).
    A call's field keywords replace those fields of ``options`` (:func:`replaced`); the body receives
    the complete ``options``, no ``fields`` and ``first`` None. An unknown keyword is the TypeError
    Python gives, unless ``unknown`` is given: it is called with the unknown names (and should raise).
    For the type checker the method is the written one."""
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]

    def deco(fn: F) -> F:
        written = inspect.signature(fn)
        if "options" not in written.parameters:
            raise TypeError(f"{fn.__qualname__}: takes_options needs an 'options' parameter")
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in written.parameters.values()):
            raise TypeError(f"{fn.__qualname__}: takes_options needs '**fields' typed with {cls.__name__}'s keywords")
        if first is not None and (first not in written.parameters or written.parameters[first].default is not None):
            raise TypeError(f"{fn.__qualname__}: declare {first} where it comes, with a default of None")
        clash = sorted(set(names) & set(written.parameters) - {first})
        if clash:
            raise TypeError(f"{fn.__qualname__}: {', '.join(clash)} come from {cls.__name__}; do not declare them")
        public = _public_signature(written, cls, fields, first)
        allowed = set(public.parameters)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if unknown is not None and set(kwargs) - allowed:
                unknown(sorted(set(kwargs) - allowed))
            bound = public.bind(*args, **kwargs)
            given = {k: bound.arguments.pop(k) for k in names if k in bound.arguments}
            bound.arguments["options"] = replaced(cls, bound.arguments.get("options"), given)
            return fn(**bound.arguments)

        wrapper.__signature__ = public  # type: ignore[attr-defined]
        wrapper.__doc__ = _doc(fn, cls)
        wrapper.__options__ = cls  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return deco


def _public_signature(
    written: inspect.Signature, cls: type, fields: tuple[dataclasses.Field, ...], first: str | None
) -> inspect.Signature:
    """``written`` with ``**fields`` replaced by the fields of ``cls`` as parameters (``first``
    where it is written)."""
    P = inspect.Parameter
    by_name = {f.name: P(f.name, P.KEYWORD_ONLY, default=f.default, annotation=f.type) for f in fields}
    params: list[inspect.Parameter] = []
    for p in written.parameters.values():
        if p.kind is P.VAR_KEYWORD:
            continue
        if p.name == first:
            p = by_name.pop(first).replace(kind=p.kind)
        elif p.name == "options":
            p = p.replace(default=None, annotation=f"{cls.__name__} | None")
        params.append(p)
    return written.replace(parameters=[*params, *by_name.values()])


def _doc(fn: Callable, cls: type) -> str:
    """The method's docstring, then the keywords it takes from ``cls``."""
    head = inspect.cleandoc(fn.__doc__ or "")
    lines = "\n".join(f"* {x}" for x in field_lines(cls))
    return (
        f"{head}\n\nKeywords from :class:`{cls.__name__}`: each replaces that field of ``options``; one left out\n"
        f"keeps the field of ``options``, or its default below.\n\n{lines}"
    )


__all__ = ["documented", "field_default", "field_lines", "option", "replaced", "takes_options"]
