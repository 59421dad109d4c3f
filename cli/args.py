"""Typed configs <-> command-line flags, for every `hsx` command: field `max_model_len` is flag `--max-model-len` (and
job-file key `max_model_len`); a bool field is `--x` / `--no-x`; help is the field's docstring.

    add_command(sub, name, cls, func, help=, description=, **options)   one subcommand: its parser, its config's
                                               flags (add_config_arguments) and the function it runs
    add_config_arguments(parser, cls, positional=, exclude=, choices=)   one flag per field, and --config FILE
    config_from_args(args, cls, required=)     the config from `--config FILE` overlaid with the flags given
    load_config_file(path, cls)                a YAML or JSON file of `cls`'s settings (keys = field names)

A field's `metadata={"cli": {...}}` shapes its flag where the default rule does not fit: "positional" (True),
"short" ("-k"), "nargs" ("+": space-separated values of a tuple field), "append" (True: a repeatable flag),
"metavar".
    config_to_argv(config)                     the flags that rebuild a JobConfig (hsx submit)
    field_docs(cls) -> {name: doc}             the docstring under each field (inherited ones too): the help
    UsageError                                 bad input: one line, exit 2
    EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from typing import Any

from extractor.config import PACKING_MODES
from extractor.options import flag
from jobs.config import NONFINITE_POLICIES, OVERLENGTH_POLICIES, JobConfig

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_CHOICES = {"overlength": OVERLENGTH_POLICIES, "on_nonfinite": NONFINITE_POLICIES, "packing": PACKING_MODES}  # dtype: validated by JobConfig, which takes aliases (bf16)
_METAVARS = {"corpus": "FILE_OR_GLOB", "layers": "IDS", "model": "MODEL", "output": "URL",
             "storage_options": "JSON", "corpus_storage_options": "JSON", "chat_template": "FILE",
             "speculative_config": "JSON", "limit_mm_per_prompt": "JSON", "allowed_local_media_path": "DIR"}


class UsageError(ValueError):
    """Bad command-line input; exit status 2."""


# -- config dataclasses <-> flags ----------------------------------------------------------------------------------
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (read from its source, its dataclass bases' too), as
    one line each."""
    docs: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__[1:] if dataclasses.is_dataclass(c)]):
        docs.update(field_docs(base))
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(hint: Any) -> Any:
    """int for `int | None`, tuple for `tuple[int, ...] | None`, ..."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return typing.get_origin(hint) or hint


def _element_type(hint: Any) -> Any:
    """int for `tuple[int, ...] | None`; str when the hint does not say."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    args = [a for a in typing.get_args(hint) if a is not Ellipsis]
    return args[0] if args and args[0] in (int, float, str) else str


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = JobConfig, *, exclude: tuple[str, ...] = (),
                         positional: tuple[str, ...] = (), choices: dict[str, tuple[str, ...]] | None = None,
                         config_file: bool = True) -> None:
    """One flag per field of the config dataclass `cls` (help = the field's docstring): field `max_model_len` is flag
    `--max-model-len`; fields in `positional` are positional arguments (metavar = the name upper-cased), in that
    order. `choices` (field -> allowed values) adds to _CHOICES. A field without a default is a required flag.
    Defaults stay unset (SUPPRESS), so a job file's values are only overridden by flags actually given; with
    `config_file` (every command has it), --config loads such a file (`cls`'s keys) and positional fields may come
    from it too."""
    if config_file:
        parser.add_argument("--config", metavar="FILE.yaml", default=argparse.SUPPRESS,
                            help="load settings from a YAML or JSON file (keys = field names); flags override it")
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    allowed = {**_CHOICES, **(choices or {})}
    positional = (*positional, *(f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", {}).get("positional")
                                 and f.name not in positional))
    for name in positional:
        parser.add_argument(name, metavar=name.upper(), help=docs.get(name, "").replace("%", "%%"),
                            **({"nargs": "?", "default": argparse.SUPPRESS} if config_file else {}))
    parser.set_defaults(hsx_positional=positional)
    for f in dataclasses.fields(cls):
        if f.name in exclude or f.name in positional:
            continue
        meta = f.metadata.get("cli", {})
        base = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": f.name}
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "")
        if default not in (None, "", ()) and base is not dict:
            help_text += f" [default: {' '.join(map(str, default)) if isinstance(default, tuple) else default}]"
        if required and not config_file:  # else a --config file may give it: config_from_args checks
            kwargs["required"] = True
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base is tuple and ("nargs" in meta or meta.get("append")):
            kwargs.update(type=_element_type(hints[f.name]), metavar=meta.get("metavar", f.name.split("_")[-1].upper()))
            kwargs.update({"action": "append"} if meta.get("append") else {"nargs": meta["nargs"]})
        elif f.name == "corpus":
            kwargs.update(nargs="+", metavar=_METAVARS["corpus"])
        elif base in (int, float):
            kwargs.update(type=base, metavar=f.name.upper().split("_")[-1] if base is int else "X")
        else:
            kwargs.update(type=str, metavar=_METAVARS.get(f.name, f.name.split("_")[-1].upper()))
        if f.name in allowed:
            kwargs["choices"] = allowed[f.name]
            kwargs.pop("metavar", None)
        if "metavar" in meta and "metavar" in kwargs:
            kwargs["metavar"] = meta["metavar"]
        names = (flag(f.name), *([meta["short"]] if "short" in meta else []))
        parser.add_argument(*names, help=help_text.replace("%", "%%"), **kwargs)


def add_command(sub, name: str, cls: type, func, *, help: str, description: str,  # noqa: A002 - argparse's name
                **options: Any) -> argparse.ArgumentParser:
    """Register subcommand `name` on the `hsx` subparsers: flags from `cls` (options: add_config_arguments'),
    running `func(args)`."""
    parser = sub.add_parser(name, help=help, description=description)
    add_config_arguments(parser, cls, **options)
    parser.set_defaults(func=func)
    return parser


JOB_REQUIRED = ("model", "corpus", "output")
"""What `hsx run` needs set, by flag or file."""


def config_from_args(args: argparse.Namespace, cls: type = JobConfig, required: tuple[str, ...] = ()) -> Any:
    """`cls` built from the --config file (if any) overlaid with the flags given; raises UsageError naming the
    setting to fix. `required`: settings that must be set one way or the other (e.g. JOB_REQUIRED)."""
    try:
        values = load_config_file(args.config, cls) if getattr(args, "config", None) else {}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hasattr(args, f.name):
                value = getattr(args, f.name)
                values[f.name] = tuple(value) if isinstance(value, list) and _base_type(hints[f.name]) is tuple \
                    else value
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values and
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        config = None if missing else cls(**values)
        for name in (*missing, *(n for n in required if config is not None and not getattr(config, n))):
            shown = name.upper() if name in getattr(args, "hsx_positional", ()) else flag(name)
            raise ValueError(f"{shown} is required (or key {name!r} in the --config file)")
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e
    return config


def load_config_file(path: str, cls: type = JobConfig) -> dict[str, Any]:
    """Read a YAML or JSON file into {field: value} for `cls`; unknown keys raise ValueError listing the valid ones."""
    import fsspec
    import yaml

    try:
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as e:
        raise ValueError(f"--config {path!r}: no such file") from e
    except OSError as e:
        raise ValueError(f"--config {path!r} cannot be read ({e})") from e
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as e:
        detail = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ValueError(f"--config {path!r} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         f"{detail}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of settings, got {type(data).__name__}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"--config {path!r} has unknown keys {unknown}; valid keys: {', '.join(valid)}")
    return data


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
        elif f.name == "corpus" or f.metadata.get("cli", {}).get("nargs"):  # space-separated values after one flag
            argv += [name, *map(str, value)]
        elif f.metadata.get("cli", {}).get("append"):  # a repeatable flag: once per value
            for v in value:
                argv += [name, str(v)]
        elif f.name == "layers":
            argv += [name, ",".join(str(i) for i in value)]
        elif isinstance(value, dict):
            argv += [name, json.dumps(value)]
        else:
            argv += [name, str(value)]
    return argv
