"""Argument parsers shared by every kvserve command line (`kvserve serve` in server/
and `kvserve bench offline|decode` in bench/in_process/)."""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """'1GiB', '512M', '2g', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_bool(text: str) -> bool:
    return str(text).lower() in ("1", "true", "yes", "on")


def non_negative(type_):
    """int or float, refusing values below 0 as a usage error naming the flag."""
    def parse(text: str):
        value = type_(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
        return value
    parse.__name__ = type_.__name__  # argparse names the type in its messages
    return parse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def split_keys(values) -> list[str]:
    """['a,b', 'c'] -> ['a', 'b', 'c']; blanks dropped."""
    return [k.strip() for v in values for k in str(v).split(",") if k.strip()]


def json_fields(text: str, cls) -> dict:
    """A JSON object flag's keys, each one of dataclass `cls`'s fields (vLLM's
    --kv-events-config, --kv-transfer-config); ValueError says what is wrong."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError("not a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(known)}")
    return values
