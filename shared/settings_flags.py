"""Command-line flags and `AFLEX_*` environment variables generated from the settings models.

One field, one knob: `add_flags` turns each field of a settings class into `--field-name` (its type,
choices from a `Literal`, `--x/--no-x` for a bool, the description and the env name in the help),
and `from_flags` builds the settings from the flags that were given, the rest coming from the
environment and the defaults. `env_of` is the other direction, for a supervisor that hands its
children their settings as environment variables instead of argv.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)
PREFIX = "AFLEX_"


def env_name(field: str) -> str:
    return PREFIX + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; anything else as it is."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _help(info: FieldInfo, field: str) -> str:
    default = "" if info.is_required() or info.default is None else f"; default {info.default}"
    return f"{info.description or field} (env {env_name(field)}{default})"


def add_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings], *, only: Iterable[str] | None = None,
              aliases: Mapping[str, tuple[str, ...]] | None = None) -> None:
    """A flag per field of `cls` (or of the fields in `only`), each defaulting to None: not given, so env
    or the field's default decides. `aliases`: extra option strings of a field (names already in use)."""
    aliases = aliases or {}
    wanted = None if only is None else set(only)
    for field, info in cls.model_fields.items():
        if wanted is not None and field not in wanted:
            continue
        names = [flag_name(field), *aliases.get(field, ())]
        kind = _base_type(info.annotation)
        if kind is bool:
            parser.add_argument(*names, dest=field, action=argparse.BooleanOptionalAction, default=None,
                                help=_help(info, field))
        elif get_origin(kind) is Literal:
            parser.add_argument(*names, dest=field, choices=[str(c) for c in get_args(kind)], default=None,
                                help=_help(info, field))
        else:
            parser.add_argument(*names, dest=field, type=kind if kind in (int, float) else str, default=None,
                                help=_help(info, field))


def given(args: argparse.Namespace, cls: type[BaseSettings]) -> dict[str, Any]:
    """The fields of `cls` that were given on the command line."""
    return {f: getattr(args, f) for f in cls.model_fields if getattr(args, f, None) is not None}


def from_flags(cls: type[S], args: argparse.Namespace) -> S:
    """Settings from the flags that were given; the rest from `AFLEX_*` env, then the defaults."""
    return cls(**given(args, cls))


def env_of(values: Mapping[str, Any]) -> dict[str, str]:
    """`AFLEX_*` environment variables for settings values (bools as true/false, as pydantic reads them)."""
    return {env_name(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in values.items()
            if v is not None}
