"""A registered scorer's identity: a digest of what it computes (docs/presses.md).

:func:`scorer_identity` hashes canonical text of the scorer (never Python's ``hash()``, never
pickle), so every process computes the same digest for the same code and values. A value the
digest reads (a closure cell, a default argument, a ``functools.partial`` argument, a callable
object's attributes) counts by its **content**: numbers, text and bytes by their ``repr``;
containers and dataclasses by their items; a torch tensor or a NumPy array by its dtype, shape and
the sha256 of a contiguous CPU copy's bytes; an Enum member by its class's qualified name and its
value; a torch or NumPy dtype and a torch device by their text; a class or a module by its
qualified name. Any other value cannot be digested by content: without a ``version=`` the
registration refuses it (:class:`OpaqueValueError`, a one-line PressError asking for
``version=``) rather than letting two scorers that differ only in it share stored entries; with a
``version=`` it counts by its type's name and the version is what tells a redefinition apart.

The module imports neither torch nor NumPy: a value can only be a tensor or an array when its
module is loaded already (``sys.modules``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import sys
import types
from typing import Any

from kvstore.errors import PressError


class OpaqueValueError(PressError):
    """A scorer without ``version=`` reads a value its identity cannot digest by content."""


def scorer_identity(score: Any, version: str = "", extra: Any = ()) -> str:
    """A digest (16 hex digits of sha256) of what a registered scorer computes: ``version``,
    ``extra`` (the record's reads, budget and parameter defaults), and the scorer's qualified name
    with, for a Python function (a ``def`` or lambda; a bound method's function), its code: the
    bytecode, constants (nested functions' too), the names it uses, its default arguments and
    closure values; a :func:`functools.partial` adds its arguments to its function's; an object
    with ``__call__`` adds its class's ``__call__`` and its attributes (``vars``). Builtins, C
    functions and ``module:function`` names give their qualified name alone: their ``version`` is
    what tells a redefinition apart. Values count by content (the module's docstring says how);
    one that cannot raises :class:`OpaqueValueError` unless ``version`` is given (then it counts by
    its type's name). The same code and values give the same digest in every process of one
    Python version."""
    opaque: list[str] = []
    text = _stable(("version", version, "extra", extra, "scorer", _callable_facts(score)), opaque)
    if opaque and not version:
        raise OpaqueValueError(
            f"the scorer reads a value kvstore cannot digest by content ({', '.join(sorted(set(opaque)))}):"
            " pass version= (any text; change it whenever that value changes) so that its stored entries"
            " are never taken for another scorer's"
        )
    h = hashlib.sha256(b"kvstore-press-identity\0")
    h.update(text.encode())
    return h.hexdigest()[:16]


def _callable_facts(fn: Any) -> Any:
    if isinstance(fn, str):
        return ("name", fn)
    if isinstance(fn, functools.partial):
        return ("partial", fn.func, fn.args, sorted(fn.keywords.items()))
    if isinstance(fn, types.MethodType):
        return ("method", type(fn.__self__).__qualname__, fn.__func__)
    name = f"{getattr(fn, '__module__', '') or ''}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        cells = tuple(c.cell_contents for c in (fn.__closure__ or ()) if _filled(c))
        return ("function", name, code, fn.__defaults__, sorted((fn.__kwdefaults__ or {}).items()), cells)
    call = next((k.__dict__["__call__"] for k in type(fn).__mro__ if "__call__" in k.__dict__), None)
    if not isinstance(fn, type) and isinstance(call, types.FunctionType) and hasattr(fn, "__dict__"):
        return ("object", name, call, sorted(vars(fn).items()))  # its state is what it computes with
    return ("object", name)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _stable(value: Any, opaque: list[str], depth: int = 0) -> str:
    """Canonical text of ``value``, the same in every process (no addresses, no set order); the
    type names of values it cannot read by content are appended to ``opaque``."""
    d = depth + 1
    if isinstance(value, enum.Enum):  # before int and str: an IntEnum is an int
        return f"enum({type(value).__module__}.{type(value).__qualname__},{_stable(value.value, opaque, d)})"
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if depth > 16:  # a function whose closure holds itself
        return "<deep>"
    if isinstance(value, types.CodeType):
        parts = (value.co_code, value.co_consts, value.co_names, value.co_varnames, value.co_argcount)
        return "code(" + _stable(parts, opaque, d) + ")"
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return _stable(_callable_facts(value), opaque, d)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_stable(v, opaque, d) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_stable(v, opaque, d) for v in value)) + "}"
    if isinstance(value, dict):
        items = (f"{_stable(k, opaque, d)}:{_stable(v, opaque, d)}" for k, v in value.items())
        return "{" + ",".join(sorted(items)) + "}"
    content = _array_text(value)
    if content is not None:
        return content
    if isinstance(value, (type, types.ModuleType)):
        return f"<{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value.__name__)}>"
    if dataclasses.is_dataclass(value):
        fields = tuple((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}{_stable(fields, opaque, d)}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    opaque.append(kind)
    return f"<{kind}>"


def _array_text(value: Any) -> str | None:
    """A tensor, an array, a NumPy scalar or a dtype by content; None for anything else."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, (torch.dtype, torch.device)):
            return f"torch({value})"
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_meta or value.is_quantized:
                return None
            flat = value.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
            digest = hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
            return f"tensor({value.dtype},{tuple(value.shape)},{digest})"
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.dtype):
            return f"np.dtype({value.str})"
        if isinstance(value, (np.ndarray, np.generic)) and not np.asarray(value).dtype.hasobject:
            array = np.ascontiguousarray(value)
            digest = hashlib.sha256(array.tobytes()).hexdigest()
            return f"ndarray({array.dtype.str},{array.shape},{digest})"
    return None


__all__ = ["OpaqueValueError", "scorer_identity"]
