"""A GGUF file -> a plain float32 safetensors model directory, through transformers
(which de-quantizes it): load it, save it with its tokenizer and chat template, and
check that the saved directory generates exactly what the GGUF did."""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from kvserve.modelstore.errors import DefaultModelError

logger = logging.getLogger("kvserve.default_model")


def dtype_kwargs() -> dict:
    """transformers 5 renamed ``torch_dtype`` to ``dtype``; 4.x only knows the old name."""
    import torch
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype" if major >= 5 else "torch_dtype": torch.float32}


def load_gguf(gguf_path: Path):
    """Load tokenizer and de-quantized float32 model from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent,
                                                      gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, **dtype_kwargs()
            )
    except ImportError as exc:  # transformers raises this when the gguf package is absent
        raise DefaultModelError(f"Loading GGUF needs the 'gguf' package: pip install gguf ({exc})") from exc
    model.eval()
    return tokenizer, model


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file's metadata for the tokenizer, again for the
    config and again for the weights (about 4.5 s each for the default model's
    49,152-token vocabulary, read one field part at a time), and builds gguf's
    tensor-name map anew for each of the model's ~400 modules (6 s): within this
    block each file is parsed once and each map built once. Both are read, never
    changed, by their callers. Its values are then converted from those parts for
    each call too (2-3 s on a 2-core AVX2 Zen 3): a call for the metadata alone
    (return_tensors=False, the tokenizer's and the config's) is answered once a file,
    each caller given its own copy (they edit the dicts)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    readers: dict[tuple[str, str], object] = {}
    parse = gguf.GGUFReader

    def reader(path, mode: str = "r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    metadata: dict[str, dict] = {}
    load = gguf_utils.load_gguf_checkpoint

    def checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return load(path, return_tensors, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = load(path, False)
        return copy.deepcopy(metadata[key])

    with (mock.patch.object(gguf, "GGUFReader", reader),
          mock.patch.object(gguf, "get_tensor_name_map",
                            functools.cache(gguf.get_tensor_name_map)),
          mock.patch.object(gguf_utils, "load_gguf_checkpoint", checkpoint)):
        yield


def save_model_dir(model, tokenizer, out_dir: Path) -> None:
    """Write float32 safetensors, tokenizer and chat template; then fix up config.json."""
    # save_pretrained refuses a model still flagged as GGUF-quantized although its
    # weights are already de-quantized float32 tensors; dropping the flag is enough.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if not tied:
        raise DefaultModelError("GGUF model came out with untied lm_head; expected tied embeddings")
    model.config.tie_word_embeddings = True
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _fix_config(out_dir / "config.json")
    if not _has_chat_template(out_dir):
        raise DefaultModelError("the GGUF tokenizer carries no chat template; chat requests would fail")
    for path in out_dir.iterdir():
        # save_pretrained writes the weights 0600 (via a temp file); a server running
        # as another user must still be able to read a shared cache.
        os.chmod(path, 0o644)


def _fix_config(config_path: Path) -> None:
    """Pin dtype float32 and tied embeddings, and drop any leftover GGUF quantization block."""
    cfg = json.loads(config_path.read_text())
    cfg.pop("quantization_config", None)
    # transformers 5 writes "dtype", 4.x "torch_dtype"; both read "torch_dtype".
    for key in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]:
        cfg[key] = "float32"
    cfg["tie_word_embeddings"] = True
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _has_chat_template(model_dir: Path) -> bool:
    """Chat template is either chat_template.jinja (transformers >= 4.47) or inside tokenizer_config.json."""
    if (model_dir / "chat_template.jinja").is_file():
        return True
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    return bool(tok_cfg.get("chat_template"))


def _greedy_ids(model, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    """The greedy continuation of `prompt`, as token ids."""
    import torch

    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def verify_same_greedy(gguf_model, gguf_tokenizer, saved_dir: Path, prompt: str,
                       new_tokens: int) -> None:
    """The saved directory must generate exactly what the GGUF-loaded model generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved_tokenizer = AutoTokenizer.from_pretrained(saved_dir)
    if saved_tokenizer.chat_template is None:
        raise DefaultModelError(f"saved tokenizer in {saved_dir} has no chat template")
    saved_model = AutoModelForCausalLM.from_pretrained(saved_dir, **dtype_kwargs()).eval()
    expected = _greedy_ids(gguf_model, gguf_tokenizer, prompt, new_tokens)
    got = _greedy_ids(saved_model, saved_tokenizer, prompt, new_tokens)
    if expected != got:
        raise DefaultModelError(
            f"conversion check failed: GGUF model generated {expected}, saved model {got}; "
            "not marking the directory complete"
        )
    logger.info("verified: %r -> %r", prompt, saved_tokenizer.decode(got))
