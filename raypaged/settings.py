"""One definition per setting: a dataclass field carries its default, bounds, choices and help.

The settings classes (`raypaged.config.EngineArgs`, `raypaged.serve.config.ServeOptions`, as
vLLM's `EngineArgs`) declare each field once with `setting(...)`; the rest walks the fields:

    setting(...) ──> validate()          the frozen dataclass checks itself in __post_init__
                 ──> add_cli_args()      argparse flags (--kv-memory-mb, --enforce-eager/--no-...)
                 ──> from_namespace()    flags back into the dataclass
                 ──> pydantic_fields()   the Serve YAML / HTTP-edge arguments model

A new setting is one `setting(...)` line plus its test. Stdlib only: core and the router import
this without torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import field
from typing import Any


def setting(default: Any, help: str, *, group: str, choices: tuple | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None,
            cli: bool = True, serve: bool = True) -> Any:
    """A dataclass field with what every front end needs to know about it.

    `cli=False`: no command-line flag (set in Python or YAML only); `serve=False`: not an argument
    of the Serve application (the fleet decides it, e.g. the device).
    """
    return field(default=default, metadata={
        "help": help, "group": group, "choices": choices, "ge": ge, "gt": gt, "le": le,
        "cli": cli, "serve": serve})


def same_setting(cls, name: str, *, group: str) -> Any:
    """The setting `name` of `cls` again, for another settings class whose flag means the same
    thing (`raypaged batch --workers` is `raypaged serve --workers`): default, bounds, choices
    and help stay defined once, in `cls`; only the help group differs."""
    f = cls.__dataclass_fields__[name]
    return field(default=f.default, metadata={**f.metadata, "group": group})


def settings_of(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def _walk(cls, front_end: str | None = None):
    """(field, its metadata, int | float | bool | str, whether None is allowed) for each setting
    of `cls`, the type from its annotation; with `front_end` ("cli", "serve"), only the settings
    that front end has."""
    hints = typing.get_type_hints(cls)
    for f in settings_of(cls):
        if front_end is None or f.metadata[front_end]:
            hint = hints[f.name]
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            yield f, f.metadata, args[0], type(None) in typing.get_args(hint)


def _bounds_text(m: dict, kind: type) -> str:
    if kind is int and m["ge"] == 1 and m["le"] is None:
        return "a positive integer"
    noun = "an integer " if kind is int else ""
    if m["gt"] is not None and m["le"] is not None:
        return f"in ({m['gt']:g}, {m['le']:g}]"
    if m["ge"] is not None and m["le"] is not None:
        return f"{noun}in [{m['ge']:g}, {m['le']:g}]"
    if m["gt"] is not None:
        return f"{noun}> {m['gt']:g}"
    if m["ge"] is not None:
        return f"{noun}>= {m['ge']:g}"
    return "an integer" if kind is int else "a number"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate(obj) -> None:
    """Check every setting of a settings dataclass instance; the error names it and the fix."""
    for f, m, kind, optional in _walk(type(obj)):
        value = getattr(obj, f.name)
        if value is None:
            if optional:
                continue
            raise ValueError(f"{f.name} must be set (got None)")
        if m["choices"] is not None:
            if value not in m["choices"]:
                raise ValueError(f"{f.name} must be one of {list(m['choices'])}, got {value!r}")
            continue
        ok = (is_int(value) if kind is int else is_finite(value) if kind is float
              else isinstance(value, kind))  # bool, str
        if ok and kind in (int, float):
            ok = ((m["ge"] is None or value >= m["ge"]) and (m["gt"] is None or value > m["gt"])
                  and (m["le"] is None or value <= m["le"]))
        if not ok:
            want = _bounds_text(m, kind) if kind in (int, float) else f"a {kind.__name__}"
            raise ValueError(f"{f.name} must be {want}, got {value!r}")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per setting of `cls` (grouped as declared); defaults shown from the field."""
    groups = {g.title: g for g in parser._action_groups}  # join groups the caller opened
    for f, m, kind, _ in _walk(cls, "cli"):
        if m["group"] not in groups:
            groups[m["group"]] = parser.add_argument_group(m["group"])
        help_text = m["help"] + ("" if f.default is None else " (default: %(default)s)")
        how = (dict(action=argparse.BooleanOptionalAction) if kind is bool
               else dict(type=kind, choices=m["choices"]))
        groups[m["group"]].add_argument(flag(f.name), default=f.default, help=help_text, **how)


def from_namespace(cls, ns: argparse.Namespace):
    """The settings of `cls` that have flags, read back from parsed arguments."""
    return cls(**{f.name: getattr(ns, f.name) for f in settings_of(cls) if f.metadata["cli"]})


def pydantic_fields(cls) -> dict[str, tuple]:
    """`{name: (annotation, pydantic.Field)}` for `pydantic.create_model`: types, bounds and
    choices from the same fields, so YAML arguments are checked like flags."""
    from typing import Literal, Optional

    from pydantic import Field, StrictBool, StrictInt, StrictStr

    strict = {bool: StrictBool, int: StrictInt, str: StrictStr, float: float}
    out = {}
    for f, m, kind, optional in _walk(cls, "serve"):
        ann = Literal[m["choices"]] if m["choices"] is not None else strict[kind]
        if optional:
            ann = Optional[ann]
        bounds = {k: m[k] for k in ("ge", "gt", "le") if m[k] is not None}
        if kind is float:
            bounds["allow_inf_nan"] = False
        out[f.name] = (ann, Field(f.default, description=m["help"], **bounds))
    return out
