"""Model shapes shipped with kvserve, for measuring at real sizes without weights.

Each preset is a directory holding only a Hugging Face `config.json` (copied from the
real model), so `--model preset:NAME` is the same thing as `--model DIR` for a
directory with a config and nothing else: no tokenizer, no checkpoint. Serve one
with `--load-format random`."""
from __future__ import annotations

from pathlib import Path

PREFIX = "preset:"
PRESETS_DIR = Path(__file__).resolve().parent


def preset_names() -> list[str]:
    return sorted(p.parent.name for p in PRESETS_DIR.glob("*/config.json"))


def is_preset(model: str | Path) -> bool:
    return str(model).startswith(PREFIX)


def resolve_model_path(model: str | Path) -> Path:
    """'preset:NAME' -> the preset's directory; anything else is a path, returned as is.
    Raises ValueError for an unknown preset name."""
    if not is_preset(model):
        return Path(model)
    name = str(model)[len(PREFIX):]
    names = preset_names()
    if name not in names:  # also keeps a name like '../x' from leaving this folder
        raise ValueError(f"unknown preset {name!r}; kvserve ships {', '.join(names)}")
    return PRESETS_DIR / name
