"""Argument parsers shared by every kvserve command line (`kvserve serve` in server/
and `kvserve bench offline|decode` in engine/benchmarks/)."""
from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """'1GiB', '512M', '2g', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_bool(text: str) -> bool:
    return str(text).lower() in ("1", "true", "yes", "on")
