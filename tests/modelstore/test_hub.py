"""Hub ids as --model (modelstore/hub.py): fetched through huggingface_hub from a
local hub (HF_ENDPOINT, tests/support/fake_hub.py) into HF_HUB_CACHE and served;
served again from that cache offline, the hub gone; a cache laid out by hand as the
hub lays it; and, offline with nothing cached, an error naming what is missing.
huggingface_hub reads its endpoint when imported, so the downloads run in child
processes with their own environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[2]
REPO = "tiny-org/tiny-llama"
# A child process: the engine built from the hub id, its greedy tokens printed.
GENERATE = """
import json
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams
engine = Engine(EngineConfig(model={model!r}, revision={revision!r}, dtype="float32",
                             compile="off", num_kv_blocks=64))
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
print(json.dumps(engine.generate([[5, 6, 7, 8, 9]], params)[0]))
"""


def run_child(code: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=240)


def greedy_from(model: str, revision=None, **env) -> list[int]:
    out = run_child(GENERATE.format(model=model, revision=revision), **env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def served_repo(tiny_model_dir, tmp_path):
    local = tiny_model_dir("llama")
    hub = FakeHub(REPO, local)
    try:
        yield local, hub, tmp_path / "hub-cache"
    finally:
        hub.close()


def test_download_then_offline_from_the_cache(served_repo):
    local, hub, cache = served_repo
    want = greedy_from(str(local))
    assert greedy_from(REPO, "main", HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(cache)) == want
    assert any(r.startswith("GET /tiny-org/tiny-llama/resolve/") for r in hub.requests)
    snapshot = next((cache / "models--tiny-org--tiny-llama" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").is_file()
    hub.close()  # the hub is gone: the cache serves
    assert greedy_from(REPO, None, HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(cache),
                       HF_HUB_OFFLINE="1") == want


def test_only_what_kvserve_reads_is_fetched(served_repo, tmp_path):
    local, hub, cache = served_repo
    code = (f"from kvserve.modelstore.hub import fetch; "
            f"print(sorted(p.name for p in fetch({REPO!r}).iterdir()))")
    weights = tmp_path / "with-bin"
    weights.mkdir()
    for f in local.iterdir():
        (weights / f.name).write_bytes(f.read_bytes())
    (weights / "pytorch_model.bin").write_bytes(b"\0" * 64)
    other = FakeHub(REPO, weights)
    try:
        out = run_child(code, HF_ENDPOINT=other.url, HF_HUB_CACHE=str(cache))
    finally:
        other.close()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pytorch_model.bin" not in out.stdout and "model.safetensors" in out.stdout


def test_a_cache_laid_out_by_hand(tiny_model_dir, tmp_path, monkeypatch):
    """models--org--name/refs/main naming a snapshot of the files, as the hub lays
    its cache out: found offline, in this process."""
    from huggingface_hub import constants

    from kvserve.modelstore.hub import fetch

    sha = "b" * 40
    repo = tmp_path / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True)
    for f in tiny_model_dir("llama").iterdir():
        (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert fetch(REPO) == snapshot


def test_offline_and_not_cached_names_what_is_missing(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from kvserve.modelstore.errors import ModelLoadError
    from kvserve.modelstore.hub import fetch

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as err:
        fetch("Qwen/Qwen3-0.6B", "v1")
    message = str(err.value)
    assert "Qwen/Qwen3-0.6B at revision v1 is not in the Hugging Face cache" in message
    assert str(tmp_path) in message and "HF_HUB_OFFLINE is set" in message


def test_cli_refuses_a_missing_hub_model_with_the_reason(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.server.entrypoints.cli", "serve", "--model",
         "no-org/no-model"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
             "HF_HUB_CACHE": str(tmp_path)})
    assert out.returncode != 0
    assert "kvserve: no-org/no-model at revision main is not in the Hugging Face cache" \
        in out.stderr


def test_hub_ids_are_told_from_paths(tmp_path, monkeypatch):
    from kvserve.modelstore.hub import is_hub_id

    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("deepseek-ai/DeepSeek-V3")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    monkeypatch.chdir(tmp_path)  # a local folder org/name is a path, not a hub id
    assert not is_hub_id("org/name")
    assert not is_hub_id("/abs/path") and not is_hub_id("a/b/c") and not is_hub_id("x.gguf")
    assert not is_hub_id("preset:llama-tiny")
