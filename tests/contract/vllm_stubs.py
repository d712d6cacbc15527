"""Stand-ins that check what opct does against a vLLM release's own classes, and the record of what was checked.

`Checked(cls, ...)` stands in for an instance of vLLM's `cls`: each method opct calls on it must exist on `cls` and
accept the call's arguments (`inspect.signature(...).bind`), so a call opct starts making is checked without a list
kept by hand. `Reading(obj)` wraps a real vLLM object (an engine's output) and records each attribute opct reads.
`APIS` holds (kind, name) of every API checked, for the count the contract stage reports.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

APIS: set[tuple[str, str]] = set()


def api(kind: str, name: str) -> None:
    APIS.add((kind, name))


def release() -> str:
    import vllm

    return vllm.__version__


def where(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__} (vllm {release()})"


@functools.cache
def assigned_attrs(cls) -> frozenset[str]:
    """Attributes a vLLM class (or a vLLM base of it) assigns to `self` anywhere in its source, or declares."""
    names: set[str] = set()
    for c in cls.__mro__:
        if not c.__module__.startswith("vllm"):
            continue
        names.update(getattr(c, "__annotations__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return frozenset(names)


def bind(cls, name: str, args: tuple, kwargs: dict) -> None:
    """Raise AssertionError unless `cls.name` accepts (args, kwargs) as a call on an instance."""
    static = inspect.getattr_static(cls, name)
    fn = getattr(cls, name)
    sig = inspect.signature(fn)
    try:
        if isinstance(static, (staticmethod, classmethod)):
            sig.bind(*args, **kwargs)
        else:
            sig.bind(None, *args, **kwargs)
    except TypeError as e:
        raise AssertionError(f"{where(cls)}.{name}{sig} does not take opct's call "
                             f"({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])}): {e}")


class Checked:
    """An instance of the vLLM class(es) `classes` as opct uses it (several classes: it may be any of them, and
    each must take the call). `attrs`: the stand-ins of its attributes (each must be one the class assigns);
    `returns`: method name -> the function that answers the call (given its arguments); `calls` records (method,
    args, kwargs)."""

    def __init__(self, *classes, attrs: dict | None = None, returns: dict | None = None):
        object.__setattr__(self, "_classes", classes)
        object.__setattr__(self, "_attrs", attrs or {})
        object.__setattr__(self, "_returns", returns or {})
        object.__setattr__(self, "calls", [])

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        classes = self._classes
        if name in self._attrs:
            for c in classes:
                assert name in assigned_attrs(c), f"{where(c)} has no attribute {name!r}, which opct reads"
                api("attribute", f"{c.__name__}.{name}")
            return self._attrs[name]
        for c in classes:
            assert callable(getattr(c, name, None)), f"{where(c)} has no method {name!r}, which opct calls"

        def call(*args, **kwargs):
            for c in classes:
                bind(c, name, args, kwargs)
                api("method", f"{c.__name__}.{name}")
            self.calls.append((name, args, kwargs))
            r = self._returns.get(name)
            return None if r is None else r(*args, **kwargs)

        return call

    def methods(self) -> list[str]:
        return [c[0] for c in self.calls]


def wrap(v):
    if isinstance(v, (list, tuple, dict)) or type(v).__module__.startswith("vllm"):
        return Reading(v)
    return v


class Reading:
    """A real vLLM value as opct reads it: attribute reads are recorded; vLLM objects and containers read from it are
    wrapped in turn. A field vLLM does not have raises AttributeError as it would in opct."""

    def __init__(self, obj):
        object.__setattr__(self, "_obj", obj)

    def __getattr__(self, name):
        obj = object.__getattribute__(self, "_obj")
        v = getattr(obj, name)
        api("field", f"{type(obj).__name__}.{name}")
        return wrap(v)

    def __getitem__(self, k):
        return wrap(self._obj[k])

    def __iter__(self):
        return (wrap(x) for x in self._obj)

    def __len__(self):
        return len(self._obj)


class Stop(Exception):
    """Ends a run of opct's or vLLM's code at the point a check has what it needs."""
