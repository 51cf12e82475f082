"""Strict YAML/dict -> dataclass conversion: every unknown key, wrong type or bad value is one error naming the key
path, the bad value and what is allowed. Shared by recipes and any other typed config qconv reads."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import reprlib
import types
import typing
from typing import Any, Literal, Union

from qconv.errors import QconvError

log = logging.getLogger(__name__)
_REPR = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


class SchemaError(QconvError):
    pass


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None)) + " or null"
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"mapping with keys {[f.name for f in dataclasses.fields(tp)]}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def shorten(value: Any, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters: an error never prints an unbounded value (a YAML alias bomb expands to
    gigabytes)."""
    try:
        text = _REPR.repr(value)
    except (RecursionError, ValueError):  # ValueError: an integer too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def version_problem(what: str, value: Any, want: int) -> str:
    """Why a record's schema_version is refused: the string "1" for the number 1 says so, instead of the puzzling
    "schema_version '1' (this qconv reads 1)"."""
    if isinstance(value, str) and value.strip() == str(want):
        return f"{what} schema_version is the string {shorten(value)}; it must be the number {want}"
    return f"unsupported {what} schema_version {shorten(value)} (this qconv reads {want})"


def _key(k: Any) -> str:
    """A mapping key as it appears in a key path, cut to 40 characters."""
    text = str(k) if isinstance(k, str) else shorten(k, 40)
    return text if len(text) <= 40 else text[:37] + "..."


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
        _fail(source, path, f"got {shorten(value)}, expected {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = (
                difflib.get_close_matches(value[:80], [str(a) for a in allowed], n=1) if isinstance(value, str) else []
            )
            _fail(
                source,
                path,
                f"bad value {shorten(value)}; allowed: {', '.join(repr(a) for a in allowed)}",
                f"did you mean {close[0]!r}?" if close else None,
            )
        return value
    if origin is list or (origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,)):  # tuple[X, ...]: a JSON list
        if not isinstance(value, (list, tuple) if origin is tuple else list):
            _fail(source, path, f"expected a list, got {shorten(value)}")
        item = typing.get_args(tp)[0]
        items = [convert(item, v, f"{path}[{i}]", source, strict) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            _fail(source, path, f"expected a mapping, got {shorten(value)}")
        kt, vt = typing.get_args(tp)
        return {
            convert(kt, k, path, source, strict): convert(vt, v, f"{path}.{_key(k)}", source, strict)
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        return value if isinstance(tp, type) and isinstance(value, tp) else from_dict(tp, value, path, source, strict)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(source, path, f"expected true/false, got {shorten(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(source, path, f"expected an integer, got {shorten(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads `7.0e9` (no sign in the exponent) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(source, path, f"expected a number, got {shorten(value)}")
        try:
            return float(value)
        except OverflowError:
            _fail(source, path, f"number out of range: {shorten(value)}")
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            _fail(source, path, f"expected a string, got {shorten(value)}")
        try:
            return str(value)
        except ValueError:  # an integer too long to print
            _fail(source, path, f"expected a string, got {shorten(value)}")
    raise TypeError(f"schema: unsupported type {tp!r} at {path}")


def read_record(cls, data: Any, where: str, what: str, fix: str):
    """`from_dict` for a record qconv wrote (a manifest, a report): any mismatch is one QconvError saying the `what`
    is malformed, naming `where` and the key path, with `fix`."""
    try:
        return from_dict(cls, data, "", where)
    except SchemaError as e:
        raise QconvError(f"malformed {what}: {e.what}", where=where, fix=fix) from e


def from_dict(cls, data: Any, path: str = "", source: str = "<config>", strict: bool = True):
    """Build dataclass `cls` from a mapping, rejecting unknown keys (strict; else skipping them with a warning, for
    records written by another qconv version) and missing required ones."""
    if not isinstance(data, dict):
        _fail(source, path, f"expected {_type_name(cls)}, got {shorten(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = renamed(cls, data)
    unknown = [k for k in data if k not in fields]
    if unknown and not strict:
        log.warning(
            "%s: ignoring keys this qconv does not know: %s",
            source,
            ", ".join(f"{path}.{k}" if path else str(k) for k in unknown),
        )
        data = {k: v for k, v in data.items() if k in fields}
    elif unknown:
        k = unknown[0]
        close = difflib.get_close_matches(shorten(k), list(fields), n=1)
        where = f"{path}.{_key(k)}" if path else _key(k)
        _fail(
            source,
            where,
            f"unknown key {shorten(k)}; allowed keys here: {', '.join(fields)}",
            f"did you mean {close[0]!r}?" if close else "remove it",
        )
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


def renamed(cls, data: dict) -> dict:
    """`data` with the keys an older qconv wrote under `cls.RENAMED`'s old names given their current names."""
    old = getattr(cls, "RENAMED", None) or {}
    return {old.get(k, k) if old.get(k) not in data else k: v for k, v in data.items()}


def coerce_fields(obj, source: str, path: str = "") -> None:
    """Give each field of dataclass `obj` its declared type, in place: a writer may pass the JSON form (dicts,
    lists), which is checked here as the reader checks it."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        sub = f"{path}.{f.name}" if path else f.name
        object.__setattr__(obj, f.name, convert(hints[f.name], getattr(obj, f.name), sub, source))


def to_dict(obj) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else obj
