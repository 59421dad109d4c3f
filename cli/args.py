"""Typed configs <-> command-line flags, for every `hsx` command: field `max_model_len` is flag `--max-model-len` (and
job-file key `max_model_len`); a bool field is `--x` / `--no-x`; help is the field's docstring.

    add_config_arguments(parser, cls, positional=, exclude=, choices=, config_file=)   one flag per field
    config_from_args(args, cls, required=)     the config from `--config FILE` overlaid with the flags given
    config_to_argv(config)                     the flags that rebuild a JobConfig (hsx submit)
    UsageError                                 bad input: one line, exit 2
    EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from jobs.config import OVERLENGTH_POLICIES, JobConfig, field_docs, flag, load_config_file

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_CHOICES = {"overlength": OVERLENGTH_POLICIES}  # dtype: validated by JobConfig, which takes aliases (bf16)
_METAVARS = {"corpus": "FILE_OR_GLOB", "layers": "IDS", "model": "MODEL", "output": "URL",
             "storage_options": "JSON", "corpus_storage_options": "JSON", "chat_template": "FILE"}


class UsageError(ValueError):
    """Bad command-line input; exit status 2."""


# -- config dataclasses <-> flags ----------------------------------------------------------------------------------
def _base_type(hint: Any) -> Any:
    """int for `int | None`, tuple for `tuple[int, ...] | None`, ..."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return typing.get_origin(hint) or hint


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = JobConfig, *, exclude: tuple[str, ...] = (),
                         positional: tuple[str, ...] = (), choices: dict[str, tuple[str, ...]] | None = None,
                         config_file: bool = True) -> None:
    """One flag per field of the config dataclass `cls` (help = the field's docstring): field `max_model_len` is flag
    `--max-model-len`; fields in `positional` are positional arguments (metavar = the name upper-cased), in that
    order. `choices` (field -> allowed values) adds to _CHOICES. A field without a default is a required flag.
    Defaults stay unset (SUPPRESS), so a job file's values are only overridden by flags actually given; with
    `config_file`, --config loads such a file (JobConfig's keys)."""
    if config_file:
        parser.add_argument("--config", metavar="JOB.yaml", default=argparse.SUPPRESS,
                            help="load settings from a YAML or JSON job file (keys = field names); flags override it")
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    allowed = {**_CHOICES, **(choices or {})}
    for name in positional:
        parser.add_argument(name, metavar=name.upper(), help=docs.get(name, "").replace("%", "%%"))
    for f in dataclasses.fields(cls):
        if f.name in exclude or f.name in positional:
            continue
        base = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": f.name}
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "")
        if default not in (None, "", ()) and base is not dict:
            help_text += f" [default: {default}]"
        if required:
            kwargs["required"] = True
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "corpus":
            kwargs.update(nargs="+", metavar=_METAVARS["corpus"])
        elif base in (int, float):
            kwargs.update(type=base, metavar=f.name.upper().split("_")[-1] if base is int else "X")
        else:
            kwargs.update(type=str, metavar=_METAVARS.get(f.name, f.name.split("_")[-1].upper()))
        if f.name in allowed:
            kwargs["choices"] = allowed[f.name]
            kwargs.pop("metavar", None)
        parser.add_argument(flag(f.name), help=help_text.replace("%", "%%"), **kwargs)


def config_from_args(args: argparse.Namespace, cls: type = JobConfig,
                     required: tuple[str, ...] = ("model", "corpus", "output")) -> Any:
    """`cls` built from the job file (if any) overlaid with the flags given; raises UsageError naming the setting to
    fix. `required`: settings `cls.check_required` must find set (JobConfig's); pass () for configs without one."""
    try:
        values = load_config_file(args.config) if getattr(args, "config", None) else {}
        for f in dataclasses.fields(cls):
            if hasattr(args, f.name):
                values[f.name] = getattr(args, f.name)
        config = cls(**values)
        if required:
            config.check_required(required)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e
    return config


def config_to_argv(config: JobConfig, exclude: tuple[str, ...] = ()) -> list[str]:
    """Flags that rebuild `config` (only settings that differ from the defaults)."""
    argv: list[str] = []
    defaults = JobConfig()
    for f in dataclasses.fields(JobConfig):
        value = getattr(config, f.name)
        if f.name in exclude or value == getattr(defaults, f.name):
            continue
        name = flag(f.name)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif f.name == "corpus":
            argv += [name, *value]
        elif f.name == "layers":
            argv += [name, ",".join(str(i) for i in value)]
        elif isinstance(value, dict):
            argv += [name, json.dumps(value)]
        else:
            argv += [name, str(value)]
    return argv
