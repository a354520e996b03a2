"""A config's validation errors in plain words: every one, unknown keys first, each
naming its field, an unknown key with the closest known key of its section
(``did you mean `backends`?``)."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

UNKNOWN_KEY = "extra_forbidden"

# pydantic's error types, in the words of someone writing a YAML file; the error's
# `ctx` fills the braces
_PLAIN = {
    "missing": "required, but missing",
    "string_type": "must be a string",
    "int_type": "must be a whole number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "set_type": "must be a list",
    "dict_type": "must be a mapping (`key: value` lines)",
    "model_type": "must be a mapping (`key: value` lines)",
    "model_attributes_type": "must be a mapping (`key: value` lines)",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "too_short": "must hold at least {min_length} item(s)",
    "too_long": "must hold at most {max_length} item(s)",
    "string_too_short": "must be at least {min_length} character(s) long",
    "string_too_long": "must be at most {max_length} character(s) long",
    "literal_error": "must be one of {expected}",
    "enum": "must be one of {expected}",
    "url_parsing": "must be a URL",
    "url_scheme": "must be a URL with scheme {expected_schemes}",
}


def _unwrap(t: Any, part: str | int | None = None) -> Any:
    """``t`` without ``Annotated``, and of a union the member that ``part`` can index
    (a model holding the key, a list for an index, a mapping for a key)."""
    while typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        members = [_unwrap(a) for a in typing.get_args(t) if a is not type(None)]
        for m in members:
            if isinstance(m, type) and issubclass(m, BaseModel) and (part is None or part in m.model_fields):
                return m
        for m in members:
            origin = typing.get_origin(m)
            if (isinstance(part, int) and origin in (list, tuple)) or (isinstance(part, str) and origin is dict):
                return m
        return members[0] if len(members) == 1 else None
    return t


def keys_at(root: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The keys the section at ``loc`` of a ``root`` document takes (empty when unknown)."""
    t: Any = root
    for part in loc:
        t = _unwrap(t, part)
        if isinstance(t, type) and issubclass(t, BaseModel):
            if part in t.model_fields:
                t = t.model_fields[str(part)].annotation
            # else: a union member's tag in the location, not a key
        elif typing.get_origin(t) in (list, tuple) and isinstance(part, int):
            t = typing.get_args(t)[0]
        elif typing.get_origin(t) is dict and isinstance(part, str):
            t = typing.get_args(t)[1]
        else:
            return []
    t = _unwrap(t)
    if isinstance(t, type) and issubclass(t, BaseModel):
        return [f.alias or name for name, f in t.model_fields.items()]
    return []


def field_path(loc: tuple[str | int, ...]) -> str:
    """``backends.0.url``: the dotted location the rest of the gateway names fields by."""
    return ".".join(str(p) for p in loc)


def _plain(e: ErrorDetails) -> str:
    template = _PLAIN.get(e["type"])
    if template is None:  # a validator's own message, already in words
        return e["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    ctx = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in (e.get("ctx") or {}).items()}
    try:
        return template.format(**ctx)
    except (KeyError, IndexError):
        return e["msg"]


def explain(err: ValidationError, root: type[BaseModel]) -> list[tuple[str, str]]:
    """``(field, message)`` for every error of ``err`` (validating ``root``), in plain
    words: unknown keys first (a misspelt key also makes the key it meant "missing"),
    then the others in the document's order."""
    unknown: list[tuple[str, str]] = []
    other: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for e in err.errors():
        loc = tuple(e["loc"])
        if e["type"] == UNKNOWN_KEY:
            key = str(loc[-1])
            known = keys_at(root, loc[:-1])
            close = difflib.get_close_matches(key, known, n=1)
            if close:
                msg = f"unknown key `{key}`, did you mean `{close[0]}`?"
            elif known:
                msg = f"unknown key `{key}`; the keys here are " + ", ".join(f"`{k}`" for k in known)
            else:
                msg = f"unknown key `{key}`"
            item = (field_path(loc), msg)
            bucket = unknown
        else:
            item = (field_path(loc), _plain(e))
            bucket = other
        if item not in seen:
            seen.add(item)
            bucket.append(item)
    return unknown + other


def describe(path: object, problems: list[tuple[str, str]]) -> str:
    """The message of a config with ``problems``: one line for one, else a line per
    problem under a header, each naming the file's field."""
    def at(loc: str) -> str:
        return f"`{loc}`" if loc else "(top level)"

    if len(problems) == 1:
        loc, msg = problems[0]
        return f"{path}: invalid config at {at(loc)}: {msg}"
    return "\n".join([f"{path}: {len(problems)} errors in the config:",
                      *(f"  - at {at(loc)}: {msg}" for loc, msg in problems)])
