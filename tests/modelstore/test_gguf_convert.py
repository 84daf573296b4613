"""The GGUF -> float directory conversion parses the file once: transformers reads
its metadata for the tokenizer, the config and the weights, and gguf's tensor-name
map is built per module (together 20 s of the default model's 24 s conversion), and
its metadata's values are converted once."""
from __future__ import annotations

import gguf
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import modeling_gguf_pytorch_utils as gguf_utils

from kvserve.modelstore.gguf_convert import load_gguf
from tests.support.tiny_gguf import write_gguf_dir
from tests.support.tiny_models import make_tiny_model


def test_the_file_is_parsed_once_and_loads_as_before(tmp_path, monkeypatch):
    float_dir = make_tiny_model(tmp_path / "hf", "llama")
    path = write_gguf_dir(float_dir, tmp_path / "gguf", lambda name: T.F32) / "model.gguf"
    parses, maps = [], []
    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def counted_parse(*args, **kwargs):
        parses.append(args[0])
        return parse(*args, **kwargs)

    def counted_map(*args):
        maps.append(args)
        return name_map(*args)

    checkpoints = []
    checkpoint = gguf_utils.load_gguf_checkpoint

    def counted_checkpoint(path, return_tensors=False, **kwargs):
        checkpoints.append(return_tensors)
        return checkpoint(path, return_tensors, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted_parse)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_map)
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted_checkpoint)
    tokenizer, model = load_gguf(path)
    assert (len(parses), len(maps)) == (1, 1)
    assert sorted(checkpoints) == [False, True]  # the metadata's values converted once
    # Afterwards gguf is as it was, and a second conversion parses afresh.
    assert gguf.GGUFReader is counted_parse and gguf.get_tensor_name_map is counted_map
    load_gguf(path)
    assert len(parses) == 2
    want = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    got = model.state_dict()
    for name, tensor in want.state_dict().items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    text = "hello world, twice"
    assert tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(float_dir)(text)[
        "input_ids"]
