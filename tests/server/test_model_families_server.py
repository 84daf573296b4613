"""`kvserve serve --model DIR` on checkpoints of the families past the dense Llama
shape: the server comes up, chats and completes (greedy text equal to the engine's
own, which tests/engine/test_model_families.py holds to transformers)."""
from __future__ import annotations

import httpx
import pytest

from tests.server.test_ops_shutdown import serving


@pytest.mark.parametrize("arch", ["deepseekv3", "gptoss"])
def test_serve_a_family_checkpoint(arch, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir(arch)
    with serving(model_dir, tmp_path / "server.log") as (_, url):
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": str(model_dir), "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "The capital of France"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 8
        body = {"model": str(model_dir), "prompt": "Paged attention stores",
                "max_tokens": 8, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert first["choices"][0]["text"] == again["choices"][0]["text"]  # a prefix hit
    assert "KV cache:" in (tmp_path / "server.log").read_text()
