"""`--config FILE.yaml`: a command's flags read from a YAML mapping, as `vllm serve --config` has it.

Keys are the command's flag names without the dashes, with `-` or `_` alike (`max-num-seqs`, `max_num_seqs`);
values are typed like the flags (a YAML int for an int flag, a list for a flag taking several, true/false for a
switch; a string is parsed as on the command line). Flags given on the command line win over the file.

A `scheduler:` block in the shape deployment guides show is read too, each key onto the setting it names:
`max_batch_size` -> max_num_seqs, `timeout_ms` -> queue_timeout (in seconds), `policy` -> scheduling_policy
(`fair_share` = fair), `preemption` -> preemption. Any other key, at the top or in the block, is an error naming
it: a setting that silently does nothing is worse than a refused one.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ironlm.exceptions import ConfigFileError


@dataclass(frozen=True)
class _SchedulerKey:
    dest: str
    scale: float = 1.0  # the file's unit in the flag's (timeout_ms: ms -> s)


_SCHEDULER_KEYS = {
    "max_batch_size": _SchedulerKey("max_num_seqs"),
    "timeout_ms": _SchedulerKey("queue_timeout", 1e-3),
    "policy": _SchedulerKey("scheduling_policy"),
    "preemption": _SchedulerKey("preemption"),
}
_POLICY_ALIASES = {"fair_share": "fair", "fair-share": "fair", "first_come_first_served": "fcfs"}
_SWITCHES = (argparse.BooleanOptionalAction, argparse._StoreTrueAction, argparse._StoreFalseAction)


def _error(key: str, reason: str) -> ConfigFileError:
    return ConfigFileError(f"{key}: {reason}", key)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The file's top-level mapping ({} for an empty file)."""
    try:
        import yaml
    except ImportError:  # a runtime dependency: only a broken install lacks it
        raise ConfigFileError("--config needs PyYAML: pip install pyyaml", "config") from None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigFileError(f"cannot read {path}: {exc.strerror or exc}", "config") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{path} is not valid YAML: {exc}", "config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} must hold a mapping of flag names to values, got {type(data).__name__}",
                              "config")
    return data


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key a file may use for this parser: each option string (aliases and deprecated names included,
    `--no-X` excepted) and each positional's dest, in underscore form."""
    keys: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.dest == "config_file":
            continue
        if not action.option_strings:
            if action.dest == "model":  # `ironlm bench`'s MODEL; serve's positional has a --model twin
                keys.setdefault(action.dest, action)
            continue
        for opt in action.option_strings:
            if opt.startswith("--") and not (isinstance(action, argparse.BooleanOptionalAction)
                                             and opt.startswith("--no-")):
                keys[opt[2:].replace("-", "_")] = action
    return keys


def _scalar(key: str, value: Any, action: argparse.Action) -> Any:
    kind = action.type
    if isinstance(value, (dict, list)):
        raise _error(key, f"expected a single value, got {type(value).__name__}")
    if isinstance(value, bool):
        raise _error(key, f"expected {_kind_name(kind)}, got {value!r}")
    if kind is None or kind is str:
        return str(value)
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise _error(key, f"expected an integer, got {value!r}")
        value = int(value)
    if kind in (int, float) and not isinstance(value, str):
        return kind(value)
    try:
        return kind(str(value)) if callable(kind) else value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        detail = f" ({exc})" if isinstance(exc, argparse.ArgumentTypeError) else ""
        raise _error(key, f"expected {_kind_name(kind)}, got {value!r}{detail}") from None


def _kind_name(kind: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", None: "a string"}.get(kind, "a value")


def convert(key: str, value: Any, action: argparse.Action) -> Any:
    """`value` as the flag `action` would have produced it from the command line; ConfigFileError if it cannot."""
    if isinstance(action, _SWITCHES):
        if not isinstance(value, bool):
            raise _error(key, f"expected true or false, got {value!r}")
        return not value if isinstance(action, argparse._StoreFalseAction) else value
    if value is None:
        if action.default is not None:
            raise _error(key, "null is not a value of this setting")
        return None
    nargs = action.nargs
    if nargs in ("+", "*") or isinstance(nargs, int) and nargs > 1:
        items = value if isinstance(value, list) else [value]
        if isinstance(nargs, int) and len(items) != nargs:
            raise _error(key, f"expected a list of {nargs} values, got {value!r}")
        if nargs == "+" and not items:
            raise _error(key, "expected at least one value")
        out: Any = [_scalar(key, v, action) for v in items]
    else:
        out = _scalar(key, value, action)
    if action.choices is not None:
        for v in out if isinstance(out, list) else [out]:
            if v not in action.choices:
                raise _error(key, f"must be one of {', '.join(map(str, action.choices))}, got {v!r}")
    return out


def _scheduler_block(block: Any) -> dict[str, Any]:
    """The `scheduler:` block as flag values, keyed `scheduler.X` for error messages."""
    if not isinstance(block, dict):
        raise _error("scheduler", f"expected a mapping, got {type(block).__name__}")
    out: dict[str, Any] = {}
    for raw, value in block.items():
        key = str(raw).replace("-", "_")
        spec = _SCHEDULER_KEYS.get(key)
        if spec is None:
            raise _error(f"scheduler.{raw}", f"unknown scheduler setting (known: {', '.join(_SCHEDULER_KEYS)})")
        if spec.scale != 1.0:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _error(f"scheduler.{raw}", f"expected a number of milliseconds, got {value!r}")
            value = value * spec.scale
        if key == "policy" and isinstance(value, str):
            value = _POLICY_ALIASES.get(value, value)
        out[f"scheduler.{raw}"] = (spec.dest, value)
    return out


def flag_values(data: dict[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """{dest: value} for `parser` from the file's mapping; ConfigFileError naming the first bad key."""
    actions = _flag_actions(parser)
    dests = {a.dest for a in actions.values()}
    entries: list[tuple[str, str, Any]] = []  # (key as written, dest, value)
    for raw, value in data.items():
        key = str(raw).replace("-", "_")
        if key == "scheduler" and "scheduler" not in actions:
            entries += [(name, dest, v) for name, (dest, v) in _scheduler_block(value).items()]
            continue
        action = actions.get(key)
        if action is None:
            raise _error(str(raw), f"unknown setting for this command (not one of its flags: {parser.prog} --help)")
        entries.append((str(raw), action.dest, value))
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for name, dest, value in entries:
        if dest not in dests:  # a scheduler-block key on a command without that flag
            raise _error(name, f"not a setting of {parser.prog}")
        if dest in given:
            raise _error(name, f"sets the same setting as {given[dest]}")
        action = next(a for a in actions.values() if a.dest == dest)
        out[dest] = convert(name, value, action)
        given[dest] = name
    return out
