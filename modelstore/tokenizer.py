"""A model directory's tokenizer, when it has one: presets and config-only
directories have none, and such a model is served token ids only. A .gguf file
carries its own (transformers builds it from the file's metadata)."""
from __future__ import annotations

from pathlib import Path

from kvserve.modelstore.errors import ModelLoadError
from kvserve.modelstore.presets import resolve_model_path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "vocab.json")


def has_tokenizer(model_dir: str | Path) -> bool:
    """False for a preset or a directory with only config.json (and maybe weights):
    such a model is served token ids only."""
    try:
        path = resolve_model_path(model_dir)
    except ValueError:
        return False
    if path.suffix == ".gguf":
        return path.is_file()
    return any((path / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    path = Path(model_dir)
    try:
        if path.suffix == ".gguf":
            try:
                return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            except ValueError:
                # AutoTokenizer reads the file's model config first, and transformers
                # reads no config of some architectures we serve (deepseek2): the
                # tokenizer alone, from the same metadata.
                return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {exc}") from exc


def _gguf_tokenizer(path: Path):
    """A GGUF's tokenizer built by transformers' own GGUF converters from the file's
    tokenizer.* metadata (vocabulary, merges, pre-tokenizer, special tokens, chat
    template), whatever its model architecture."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (convert_gguf_tokenizer,
                                                                        get_gguf_tokenizer)

    architecture, tokenizer, config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
