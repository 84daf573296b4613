"""Settings declared once. Each is a field of a config dataclass, with its default
and help text (`setting(...)`); `add_flags` makes the command line's flags from the
fields, each with a KVSERVE_<FLAG> environment variable for its default, and
`from_args` builds the dataclass back from the parsed flags. A new setting is one
new field. A field whose type is another config class (`nested`) brings that
class's flags along."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, TypeVar

from kvserve.engine.config.arg_types import parse_bool, split_keys

T = TypeVar("T")
_UNSET = dataclasses.MISSING


def setting(default: Any = _UNSET, help: str = "", *, parse: Any = str,
            choices: list | None = None, flag: str | None = None,
            flag_default: Any = _UNSET, secret_list: bool = False,
            nested: Any = None, default_factory: Any = _UNSET, many: bool = False) -> Any:
    """A config field that is also a flag. `parse`: turns the flag's text into the
    value; `flag`: its name when not --<field-name>; `flag_default`: the flag's
    default when it differs from the field's (a required field's flag defaults to
    None); `secret_list`: a repeatable, comma-separated list that --help never
    shows; `nested`: a config class whose own settings are flags; `many`: the flag
    takes one or more values (`--flag a b`, repeatable; its variable: space-separated)."""
    meta = {"help": help, "parse": parse, "choices": choices, "flag": flag,
            "flag_default": flag_default, "secret_list": secret_list, "nested": nested,
            "many": many}
    if default_factory is not _UNSET:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def settings_of(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def env_name(flag: str) -> str:
    return "KVSERVE_" + flag.lstrip("-").upper().replace("-", "_")


def dest_name(f: dataclasses.Field) -> str:
    return flag_name(f).lstrip("-").replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, cls, only: set[str] | None = None) -> None:
    """cls's settings as flags (`only`: these fields of it)."""
    for f in settings_of(cls):
        if only is not None and f.name not in only:
            continue
        if f.metadata["nested"] is not None:
            add_flags(parser, f.metadata["nested"])
        elif f.metadata["secret_list"]:
            _add_secret_list(parser, f)
        elif f.metadata["many"]:
            _add_many(parser, f)
        else:
            _add_flag(parser, f)


def from_args(cls: type[T], args: argparse.Namespace, **given) -> T:
    """cls from the parsed flags; `given` values (resolved elsewhere) win. A nested
    class may define `from_settings(**values)` to build itself (or None)."""
    values = {f.name: from_args(f.metadata["nested"], args)
              if f.metadata["nested"] is not None else getattr(args, dest_name(f))
              for f in settings_of(cls)}
    values.update(given)
    make = getattr(cls, "from_settings", None)
    return make(**values) if make is not None else cls(**values)


def _default_of(f: dataclasses.Field) -> Any:
    if f.metadata["flag_default"] is not _UNSET:
        return f.metadata["flag_default"]
    if f.default is not _UNSET:
        return f.default
    if f.default_factory is not _UNSET:
        return f.default_factory()
    return None


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    flag, meta = flag_name(f), f.metadata
    env = env_name(flag)
    default = _default_of(f)
    if env in os.environ:
        # argparse converts a string default with `type` itself, so a bad value is a
        # usage error naming the flag rather than a traceback.
        default = os.environ[env]
    # A yes/no flag alone means yes (`--enable-lora`, as vLLM's), or takes a value.
    switch = {"nargs": "?", "const": True} if meta["parse"] is parse_bool else {}
    parser.add_argument(flag, dest=dest_name(f), default=default, type=meta["parse"],
                        choices=meta["choices"], **switch,
                        help=f"{meta['help']} [env {env}; default: {default}]")


class _Many(argparse.Action):
    """One or more values, repeatable: `--m a b --m c` -> [a, b, c]. Given flags
    replace the default taken from the environment, as other flags do."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest,
                (list(current) if current is not self.default else []) + list(values))


def _add_many(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    flag, parse = flag_name(f), f.metadata["parse"]
    env = env_name(flag)
    try:
        default = [parse(v) for v in os.environ.get(env, "").split()]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(f"{env}: {exc}")
    parser.add_argument(flag, dest=dest_name(f), default=default, nargs="+", type=parse,
                        action=_Many, help=f"{f.metadata['help']} [env {env}, "
                        f"space-separated; default: {' '.join(map(str, default)) or 'none'}]")


class _KeyList(argparse.Action):
    """A repeatable, comma-separated list: `--api-key a,b --api-key c` -> [a, b, c].
    Given flags replace the default taken from the environment, as other flags do."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        keys = [] if current is self.default else list(current)
        setattr(namespace, self.dest, keys + split_keys([values]))


def _add_secret_list(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    flag = flag_name(f)
    env = env_name(flag)
    default = split_keys([os.environ[env]]) if env in os.environ else []
    shown = "set" if default else "none"
    parser.add_argument(flag, dest=dest_name(f), default=default, action=_KeyList,
                        help=f"{f.metadata['help']} [env {env}; default: {shown}]")
