"""Flags of `ironlm serve/generate/chat`, generated from `EngineConfig` (and `ServerConfig` for serve): one
flag per field.

The flag is the field name in kebab case; type, default, choices and help come from the field, so a field
added to either config is a flag here without an edit. Shared by cli.py and cli_run.py (which therefore need
not import each other).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Collection, Sequence
from dataclasses import Field, fields
from typing import Any

from ironlm.config import EngineConfig, ServerConfig

# Flags kept for one release after a rename: old flag -> the field it now sets.
_DEPRECATED_FLAGS = {"--request-timeout": "queue_timeout"}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _value_type(annotation: Any) -> Any:
    """The argparse `type` for a field: `int | str | None` stays a string (the config parses sizes)."""
    if typing.get_origin(annotation) is tuple:  # `tuple[str, ...]`: the field's metadata gives nargs
        return _value_type(typing.get_args(annotation)[0])
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if is_union else (annotation,)
    for kind in (str, int, float):
        if kind in options:
            return kind
    raise TypeError(f"config field of type {annotation!r} has no command-line form")


def _argparse_options(f: Field, annotation: Any) -> dict[str, Any]:
    meta = dict(f.metadata)
    opts: dict[str, Any] = {"default": f.default, "help": meta.pop("help", None)}
    if annotation is bool:
        opts["action"] = argparse.BooleanOptionalAction
    else:
        opts["type"] = _value_type(annotation)
    opts.update(meta)  # choices, metavar, nargs
    return opts


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` unless the help already explains the default or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _DeprecatedFlag(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"ironlm: warning: {option_string} is deprecated, use {flag_name(self.dest)} (same meaning)",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True,
                    skip: Collection[str] = ()) -> None:
    """One flag per EngineConfig field. `skip`: fields a command does not take as flags, e.g. `ironlm bench`,
    whose own `--seed` and `--warmup` mean the workload's, and whose MODEL is positional only."""
    names = {f.name for f in fields(EngineConfig)}
    if not names.issuperset(skip):
        raise TypeError(f"not EngineConfig fields: {sorted(set(skip) - names)}")
    if positional_model:
        parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                            help=EngineConfig.__dataclass_fields__["model"].metadata["help"])
    parser.add_argument("--config", dest="config_file", metavar="FILE.yaml", default=None,
                        help="read flags from this YAML file (keys are the flag names; flags given here win)")
    group = parser.add_argument_group("engine")
    _add_fields(group, EngineConfig, skip)
    hints = typing.get_type_hints(EngineConfig)
    for old, name in _DEPRECATED_FLAGS.items():
        if name not in skip:
            group.add_argument(old, dest=name, type=_value_type(hints[name]), default=argparse.SUPPRESS,
                               action=_DeprecatedFlag, help=argparse.SUPPRESS)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field (`ironlm serve`)."""
    _add_fields(parser.add_argument_group("server"), ServerConfig, ())


def _add_fields(group: Any, cls: type, skip: Collection[str]) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        opts = _argparse_options(f, hints[f.name])
        if f.name == "served_model_name":  # serve answers to several names; the engine reports the first
            opts["nargs"] = "+"
        group.add_argument(flag_name(f.name), dest=f.name, **opts)


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser that parsed the command `args` holds: `ironlm bench serve` -> bench's serve parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen_parser(action.choices[name], args)
    return parser


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str],
                      args: argparse.Namespace) -> argparse.Namespace:
    """`args` re-parsed with the `--config` file's values as the defaults, so the command line still wins. A bad
    file ends the program as a bad flag does: the message names the key, exit status 2."""
    from ironlm.config_file import ConfigFileError, flag_values, read_yaml

    path = getattr(args, "config_file", None)
    if not path:
        return args
    command = _chosen_parser(parser, args)
    try:
        values = flag_values(read_yaml(path), command)
    except ConfigFileError as exc:  # argparse's exit status for a bad flag, without its page of usage
        command.exit(2, f"{command.prog}: error: --config {path}: {exc}\n")
    if getattr(args, "model_pos", None) is not None:
        values.pop("model", None)  # MODEL on the command line wins over the file's `model`
    command.set_defaults(**values)
    return parser.parse_args(argv)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(args, f.name) for f in fields(ServerConfig) if hasattr(args, f.name)})


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the parsed flags set: each one `add_engine_args` added, defaults included."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}


def model_from_args(args: argparse.Namespace) -> str | None:
    """`--model` wins over the positional MODEL."""
    return getattr(args, "model", None) or getattr(args, "model_pos", None)


def config_from_args(args: argparse.Namespace, model: str | None) -> EngineConfig:
    values = engine_kwargs_from_args(args)
    names = values.get("served_model_name")
    values["served_model_name"] = names[0] if names else None
    values["model"] = model
    return EngineConfig(**values)
