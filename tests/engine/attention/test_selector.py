"""Which attention backend --attention-backend picks, and the errors when the
asked-for one cannot run here. (flash-attn itself is not installed on CPU hosts:
only its selection is tested.)"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from kvserve.engine.kernels.attention import selector
from kvserve.engine.kernels.attention.selector import AttentionBackendError, make_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_torch_on_cpu_and_triton_on_cuda():
    assert make_backend("auto", CPU, 16, torch.float32).name == "torch"
    # Building the backend touches no CUDA API, so this runs on a CPU host.
    assert make_backend("auto", CUDA, 16, torch.bfloat16).name == "triton"


def test_auto_on_cuda_without_triton_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(selector, "_importable", lambda m: m != "triton")
    assert make_backend("auto", CUDA, 16, torch.bfloat16).name == "torch"


def test_explicit_torch_and_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert make_backend("torch", CUDA, 16, torch.bfloat16).name == "torch"
    assert make_backend("triton", CPU, 16, torch.float32).name == "triton"  # interpreted


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(AttentionBackendError, match="TRITON_INTERPRET=1"):
        make_backend("triton", CPU, 16, torch.float32)


def test_unknown_backend():
    with pytest.raises(AttentionBackendError, match="auto, triton, flash-attn, torch"):
        make_backend("xformers", CPU, 16, torch.float32)


def test_flash_attn_not_installed(monkeypatch):
    monkeypatch.setattr(selector, "_importable", lambda m: m != "flash_attn")
    with pytest.raises(AttentionBackendError, match="needs the flash_attn package"):
        make_backend("flash-attn", CUDA, 256, torch.bfloat16)


@pytest.mark.parametrize("device,block_size,dtype,message", [
    (CPU, 256, torch.bfloat16, "CUDA"),
    (CUDA, 16, torch.bfloat16, "multiple of 256"),
    (CUDA, 256, torch.float32, "float16 or bfloat16"),
])
def test_flash_attn_limits(monkeypatch, device, block_size, dtype, message):
    monkeypatch.setattr(selector, "_importable", lambda m: True)
    with pytest.raises(AttentionBackendError, match=message):
        make_backend("flash-attn", device, block_size, dtype)


def test_flash_attn_chosen_when_it_can_run(monkeypatch):
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fake.flash_attn_with_kvcache = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(selector, "_importable", lambda m: True)
    assert make_backend("flash-attn", CUDA, 256, torch.bfloat16).name == "flash-attn"


def test_cli_flag_reaches_the_engine_config(monkeypatch):
    from kvserve.server.entrypoints.cli import build_parser, engine_config_from_args

    monkeypatch.delenv("KVSERVE_ATTENTION_BACKEND", raising=False)
    assert build_parser().parse_args(["serve"]).attention_backend == "auto"
    args = build_parser().parse_args(["serve", "--attention-backend", "triton"])
    assert engine_config_from_args(args, "m").attention_backend == "triton"
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "torch")
    assert build_parser().parse_args(["serve"]).attention_backend == "torch"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "nope"])


@pytest.mark.parametrize("sinks,latent,message", [
    (True, False, "no attention sinks"), (False, True, "no latent-attention path")])
def test_flash_attn_refuses_layers_it_cannot_run(sinks, latent, message):
    with pytest.raises(AttentionBackendError, match=message):
        selector.check_layers_fit("flash-attn", sinks=sinks, latent=latent)
    selector.check_layers_fit("triton", sinks=sinks, latent=latent)  # served there
