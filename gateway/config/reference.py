"""The configuration reference, ``docs/configuration.md``, generated from the models of
:mod:`gateway.config`, so that a key's type, default and meaning have one source: the
``Field(description=...)`` beside its validation.

    python -m gateway.config.reference           # print the markdown
    python -m gateway.config.reference --write   # write docs/configuration.md
    python -m gateway.config.reference --check   # exit 1 when docs/configuration.md is stale

Every field of :class:`~gateway.config.GatewayConfig` becomes one row: the dotted key
(``[]`` marks a list of objects, as in ``backends[].name``), its type with the bounds
pydantic enforces, its default and its description. Nested models are walked; each
top-level key gets a section introduced by its own description.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from gateway.config import GatewayConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python -m gateway.config.reference --write"

PREAMBLE = f"""\
# Configuration reference (`backends.yaml`)

<!-- Generated from gateway/config/ by `{REGENERATE}`; do not edit by hand. -->

The gateway reads one YAML file, `python -m gateway --config FILE` (the repository's
[`backends.yaml`](../backends.yaml) is a commented example). It is validated at start-up and on
every reload: a bad file exits with code 2 and a message naming the file and each bad
field, e.g. ``backends.yaml: invalid config at `backends.0.weight`: must be greater than 0``;
with several errors, one line each, unknown keys first (a reload keeps the running config
instead). Unknown keys are errors, so typos do not pass silently: ``unknown key `backend`,
did you mean `backends`?``. Times are in seconds, sizes in bytes or tokens as the key's name says. A key left
out takes its default; `null` is accepted only where the type says so (for a timeout it
means no limit).

A key written `a[].b` is the field `b` of every element of the list `a`. `{{}}` as a default
is an object whose fields all take their own defaults.
"""


@dataclass(frozen=True)
class Row:
    """One configuration key: ``key`` dotted, ``type``, ``default`` and ``description``
    as markdown cell text."""

    key: str
    type: str
    default: str
    description: str


def _unwrap(annotation: Any) -> tuple[Any, list[Any], bool]:
    """(bare type, constraint metadata found inside ``Annotated``, nullable)."""
    metadata: list[Any] = []
    nullable = False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        nullable = len(rest) < len(args)
        if len(rest) == 1:
            annotation = rest[0]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        for m in extra:
            metadata.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return annotation, metadata, nullable


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """(the model a field holds, what goes between the field's key and the model's
    keys: ``.`` for one, ``[].`` for a list of them, ``.<model>[].`` for a mapping (by
    model name) of lists of them) or ``(None, "")``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, "."
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, "[]."
    if origin is dict:
        _, value = typing.get_args(annotation)
        sub, between = _model_of(value)
        if sub is not None:
            return sub, ".<model>" + between
    return None, ""


_NAMES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _num(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _type_text(annotation: Any, metadata: list[Any], nullable: bool) -> str:
    model, between = _model_of(annotation)
    origin = typing.get_origin(annotation)
    if model is not None:
        base = {".": "object", "[].": "list of objects", ".<model>.": "mapping of model names to objects"}.get(
            between, "mapping of model names to lists of objects")
    elif origin is Literal:
        base = "one of " + ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    elif origin is list:
        (item,) = typing.get_args(annotation)
        if typing.get_origin(item) is Literal:
            base = "list of " + ", ".join(f"`{v}`" for v in typing.get_args(item))
        else:
            base = f"list of {_NAMES.get(item, getattr(item, '__name__', str(item)))}s"
    elif origin is dict:
        base = "mapping"
    else:
        base = _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))
    low = high = None
    extras = []
    for m in metadata:
        if isinstance(m, at.Gt):
            low = f"> {_num(m.gt)}"
        elif isinstance(m, at.Ge):
            low = f">= {_num(m.ge)}"
        elif isinstance(m, at.Lt):
            high = f"< {_num(m.lt)}"
        elif isinstance(m, at.Le):
            high = f"<= {_num(m.le)}"
        elif isinstance(m, at.MinLen):
            extras.append("non-empty" if m.min_length == 1 else
                          f"at least {m.min_length} {'items' if origin is list else 'characters'}")
        elif isinstance(m, at.MaxLen):
            extras.append(f"at most {m.max_length} characters")
        elif getattr(m, "pattern", None):
            extras.append(f"matching `{m.pattern}`")
    if low and high and low.startswith(">=") and high.startswith("<="):
        bounds = [f"{low[3:]} to {high[3:]}"]
    else:
        bounds = [b for b in (low, high) if b]
    text = ", ".join([base, *bounds, *extras])
    return text + ", or `null`" if nullable else text


def _yaml(v: Any) -> str:
    """A default value in YAML flow style."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return _num(v)
    if isinstance(v, BaseModel):
        return _yaml(v.model_dump())
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml(x) for x in v) + "]"
    return str(v)


def _default_text(name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel) and default == type(default)():
        return "`{}`"
    text = f"`{_yaml(default)}`"
    if name.endswith("_bytes") and isinstance(default, int) and default % (1 << 20) == 0:
        text += f" ({default >> 20} MiB)"
    return text


def rows(model: type[BaseModel], prefix: str = "") -> Iterator[Row]:
    """Every field of ``model`` and, depth first, of the models it holds, in declaration
    order; keys start with ``prefix``."""
    for name, field in model.model_fields.items():
        key = prefix + name
        annotation, metadata, nullable = _unwrap(field.annotation)
        metadata = [*field.metadata, *metadata]
        yield Row(key, _type_text(annotation, metadata, nullable), _default_text(name, field),
                  (field.description or "").strip())
        sub, between = _model_of(annotation)
        if sub is not None:
            yield from rows(sub, key + between)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole of ``docs/configuration.md``."""
    out = [PREAMBLE]
    sections = []
    for name, field in GatewayConfig.model_fields.items():
        annotation, _, _ = _unwrap(field.annotation)
        sub, between = _model_of(annotation)
        sections.append((name, field, sub, between))
    out.append("| section | what |\n|---|---|")
    for name, field, _, _ in sections:
        first = (field.description or "").split(". ")[0].rstrip(".")
        out.append(f"| [`{name}`](#{name}) | {_cell(first)} |")
    out.append("")
    for name, _field, sub, between in sections:
        (top,) = [r for r in rows(GatewayConfig) if r.key == name]
        out.append(f"## `{name}`\n")
        out.append(f"{top.description}\n")
        out.append(f"Type: {top.type}; default: {top.default}.\n")
        if sub is None:
            continue
        out.append("| key | type | default | description |\n|---|---|---|---|")
        for r in rows(sub, name + between):
            out.append(f"| `{r.key}` | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.description)} |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gateway.config.reference",
                                 description="Print (or write, or check) docs/configuration.md, generated "
                                             "from gateway/config/.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name} into docs/")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when docs/configuration.md differs from what the models give")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(exist_ok=True)
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH}", file=sys.stderr)
        return 0
    if args.check:
        try:
            current = DOC_PATH.read_text(encoding="utf-8")
        except OSError:
            current = None
        if current != text:
            state = "is missing" if current is None else "is stale (gateway/config/ changed)"
            print(f"{DOC_PATH}: {state}; regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
