"""Strict YAML/dict -> dataclass conversion: every unknown key, wrong type or bad value is one error naming the key
path, the bad value and what is allowed. Shared by recipes and any other typed config qconv reads."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from typing import Any, Literal, Union

from qconv.errors import QconvError

log = logging.getLogger(__name__)


class SchemaError(QconvError):
    pass


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None)) + " or null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"mapping with keys {[f.name for f in dataclasses.fields(tp)]}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, getattr(tp, "__name__", str(tp)))


def _fail(source: str, path: str, msg: str, fix: str | None = None):
    raise SchemaError(f"{path or '<top>'}: {msg}", where=source, fix=fix)


def convert(tp, value: Any, path: str, source: str, strict: bool = True):
    """Convert `value` to type `tp`, recursively; raise SchemaError naming `path` on any mismatch."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return convert(a, value, path, source, strict)
            except SchemaError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        _fail(source, path, f"got {value!r}, expected {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            _fail(source, path, f"bad value {value!r}; allowed: {', '.join(repr(a) for a in allowed)}",
                  f"did you mean {close[0]!r}?" if close else None)
        return value
    if origin is list:
        if not isinstance(value, list):
            _fail(source, path, f"expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [convert(item, v, f"{path}[{i}]", source, strict) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _fail(source, path, f"expected a mapping, got {value!r}")
        kt, vt = typing.get_args(tp)
        return {convert(kt, k, path, source, strict): convert(vt, v, f"{path}.{k}", source, strict)
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path, source, strict)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(source, path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(source, path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads `7.0e9` (no sign in the exponent) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(source, path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            _fail(source, path, f"expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"schema: unsupported type {tp!r} at {path}")


def from_dict(cls, data: Any, path: str = "", source: str = "<config>", strict: bool = True):
    """Build dataclass `cls` from a mapping, rejecting unknown keys (strict; else skipping them with a warning, for
    records written by another qconv version) and missing required ones."""
    if not isinstance(data, dict):
        _fail(source, path, f"expected {_type_name(cls)}, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown and not strict:
        log.warning("%s: ignoring keys this qconv does not know: %s", source,
                    ", ".join(f"{path}.{k}" if path else str(k) for k in unknown))
        data = {k: v for k, v in data.items() if k in fields}
    elif unknown:
        k = unknown[0]
        close = difflib.get_close_matches(str(k), list(fields), n=1)
        where = f"{path}.{k}" if path else str(k)
        _fail(source, where, f"unknown key {k!r}; allowed keys here: {', '.join(fields)}",
              f"did you mean {close[0]!r}?" if close else "remove it")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = convert(hints[name], data[name], sub, source, strict)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            _fail(source, sub, f"missing required key ({_type_name(hints[name])})")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        for problem in check() or ():
            _fail(source, f"{path}.{problem[0]}" if path else problem[0], problem[1])
    return obj


def to_dict(obj) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else obj
