"""The settings as command-line flags, one per field of :class:`ServiceSettings`, and as the
table of docs/API.md section 9: both made from the settings object, so they cannot drift.

A field ``name`` is the flag ``--name`` with ``_`` as ``-`` and a trailing ``_s`` (seconds)
dropped, the variable ``SPLITKEY_NAME``, and the key ``name`` (or the flag's own name) of a
``--config`` TOML file. A flag given wins over the variable, the variable over the file, the
file over the default (:func:`layered`). Values are parsed by the settings model alone, so a
bad one fails the same way from any source, naming the flag, the variable and the value
(:func:`explain`).
"""

from __future__ import annotations

import argparse
import difflib
import enum
import pathlib
import tomllib
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from service.core.settings import GROUPS, ServiceSettings

ENV_PREFIX = "SPLITKEY_"


def flag(name: str) -> str:
    """``request_timeout_s`` -> ``--request-timeout``."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def choices(info: FieldInfo) -> list[str] | None:
    """The values a Literal or Enum field takes, else None."""
    for t in (info.annotation, *typing.get_args(info.annotation)):
        if typing.get_origin(t) is typing.Literal:
            return [str(v) for v in typing.get_args(t)]
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return [str(m.value) for m in t]
    return None


def metavar(name: str, info: FieldInfo) -> str | None:
    """What the flag takes, by the field's unit or type (None for a field with choices)."""
    if choices(info):
        return None
    kinds = {t for t in (info.annotation, *typing.get_args(info.annotation)) if isinstance(t, type)}
    if name.endswith("_s"):
        return "SECONDS"
    if pathlib.Path in kinds:
        return "PATH"
    if name.endswith("_rate"):
        return "BYTES_PER_S"
    if int in kinds:
        return "N"
    if float in kinds:
        return "X"
    return name.removeprefix("ray_").upper()


def default_text(info: FieldInfo) -> str:
    default = info.default
    if default is None or default is PydanticUndefined:
        return "unset"
    if isinstance(default, enum.Enum):
        return str(default.value)
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, int) and default >= 2**20 and default % 2**20 == 0:
        return f"{default} ({default // 2**30} GiB)" if default % 2**30 == 0 else f"{default} ({default // 2**20} MiB)"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in :data:`GROUPS` order, each under its group's heading."""
    fields = ServiceSettings.model_fields
    for group, names in GROUPS.items():
        g = parser.add_argument_group(group)
        for name in names:
            info = fields[name]
            g.add_argument(flag(name), dest=name, default=None, choices=choices(info), metavar=metavar(name, info),
                           help=f"{info.description} (default {default_text(info)}; {env_var(name)})".replace("%", "%%"))


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave (as strings, for the model to parse)."""
    return {name: getattr(args, name) for name in ServiceSettings.model_fields if getattr(args, name, None) is not None}


def from_file(path: pathlib.Path) -> dict[str, Any]:
    """The settings a ``--config`` TOML file gives, by field name: each top-level key is a setting's name
    (``request_timeout_s``) or its flag's (``request-timeout``). Raises ValueError naming the file and
    the key for a key that is no setting, a table, or a key given twice under its two names."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {str(path)!r} must be a TOML file: {exc}") from None
    except OSError as exc:
        raise ValueError(f"--config must be a readable TOML file, got {str(path)!r}: {exc.strerror or exc}") from None
    by_key = {name: name for name in ServiceSettings.model_fields} | {
        flag(name).removeprefix("--"): name for name in ServiceSettings.model_fields}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            raise ValueError(f"--config {str(path)!r}: {key} must be a value at the top level, got a table")
        name = by_key.get(key)
        if name is None:
            close = difflib.get_close_matches(key, by_key, n=1, cutoff=0.7)
            hint = f": did you mean {close[0]}?" if close else " (docs/API.md section 9 lists them)"
            raise ValueError(f"--config {str(path)!r}: key must be a setting of splitkey serve, got {key!r}{hint}")
        if name in values:
            raise ValueError(f"--config {str(path)!r}: {key} must be given once, got it under two names")
        values[name] = value
    return values


def layered(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """The keyword arguments for :class:`ServiceSettings`: the command line's flags, and the ``--config``
    file's settings that no ``SPLITKEY_*`` variable sets (the model reads those itself): a flag wins over
    the variable, the variable over the file, the file over the default."""
    config = getattr(args, "config", None)
    from_config = from_file(pathlib.Path(config)) if config is not None else {}
    in_env = {name.upper() for name in environ}  # pydantic-settings matches the variables case-insensitively
    return {**{k: v for k, v in from_config.items() if env_var(k) not in in_env}, **given(args)}


def explain(exc: ValidationError) -> str:
    """One line per bad setting: its flag and variable, what it must be, and the value given."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if loc and loc[0] in ServiceSettings.model_fields:
            name = loc[0]
            lines.append(f"{flag(name)} ({env_var(name)}): {err['msg'].removeprefix('Value error, ')}, "
                         f"got {err['input']!r}")
        else:  # a rule over several settings (a model validator): its message names them
            lines.append(err["msg"].removeprefix("Value error, "))
    return "; ".join(lines)


def markdown_table() -> str:
    """The table of docs/API.md section 9: every setting, its flag, variable, default and meaning."""
    rows = ["| flag | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
    fields = ServiceSettings.model_fields
    for group, names in GROUPS.items():
        rows.append(f"| **{group}** | | | |")
        for name in names:
            info = fields[name]
            options = choices(info)
            meaning = (info.description or "") + (f" One of: {', '.join(options)}." if options else "")
            rows.append(f"| `{flag(name)}` | `{env_var(name)}` | {default_text(info)} | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m service.cli_settings: print the table for docs/API.md
    print(markdown_table(), end="")


def misspelt(environ: Mapping[str, str]) -> list[str]:
    """A line for each ``SPLITKEY_*`` variable that is not a setting but close to one's name: pydantic
    ignores variables it does not know, and a misspelt one would go unnoticed (other ``SPLITKEY_*``
    names, the deploy scripts' own, are left alone)."""
    known = {env_var(name) for name in ServiceSettings.model_fields}
    lines = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if close:
                lines.append(f"{name} is not a setting and is ignored: did you mean {close[0]}?")
    return lines
