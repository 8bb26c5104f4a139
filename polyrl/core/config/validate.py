"""Turning a plain mapping (parsed YAML) into the typed schema, refusing unknown keys and wrong types.

Every error is a ``BadInputError`` whose message starts with the full dotted key path and says what was
expected, e.g. ``optimizer.lr: expected float, got str 'fast'``. Ints are accepted where floats are
expected (YAML writes ``1`` for ``1.0``); bools are never accepted as numbers.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar, Union

from polyrl.core.errors import BadInputError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(item)}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except BadInputError:
                continue
        raise BadInputError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        # type check too: YAML's `true` must not match a Literal[1] (True == 1 in Python)
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            return value
        raise BadInputError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise BadInputError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise BadInputError(f"{path}: expected mapping, got {_describe(value)}")
        _, val_tp = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise BadInputError(f"{path}: keys must be strings, got {_describe(k)}")
            out[k] = _convert(v, val_tp, f"{path}.{k}")
        return out
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is type(None):
        if value is None:
            return None
    else:  # pragma: no cover - a schema bug, not user input
        raise TypeError(f"unsupported schema type {tp!r} at {path}")
    raise BadInputError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")


def build_dataclass(cls: type[T], data: Any, path: str = "") -> T:
    """An instance of ``cls`` from a mapping, checking every key and type (defaults fill the rest)."""
    where = path or "recipe"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadInputError(f"{where}: expected mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise BadInputError(f"unknown key {full!r} (known keys{' of ' + path if path else ''}: {known})")
        kwargs[key] = _convert(value, hints[key], full)
    return cls(**kwargs)
