"""Prefill/decode disaggregation behind vllm-router's P/D mode (from PyPI), its
pull-based protocol (vLLM's NIXL and toy-proxy hand-off, which vLLM's Mooncake
connector docs also use): the
router sends each request to the prefill server with max_tokens 1 and
kv_transfer_params {"do_remote_decode": true}, takes the kv_transfer_params of its
answer and sends the original request with them to the decode server, which reads
the prompt's KV from the prefill server (Mooncake over TCP) and generates the rest.
Completions and chat, streamed and not, equal one server's greedy answers; the
decode server computes only each prompt's tail; no block stays held on either."""
from __future__ import annotations

import contextlib
import json
import os
import time

import httpx
import pytest

from tests.deploy.test_router import _counter, router
from tests.server.test_ops_shutdown import serving

pytest.importorskip("vllm_router")
os.environ.setdefault("GLOG_minloglevel", "2")
pytest.importorskip("mooncake.engine", reason="the pd extra (Mooncake, libibverbs1) is "
                    "not installed", exc_type=ImportError)
MODEL = "tiny"


def pd_router(prefill: str, decode: str, log_path):
    """vllm-router in P/D mode, its pull-based hand-off (its default, named for NIXL:
    the decode instance reads the blocks; "mooncake" there means a push protocol)."""
    return router([], "round_robin", log_path, "vllm_router", "--vllm-pd-disaggregation",
                  "--prefill", prefill, "--decode", decode, "--kv-connector", "nixl")


def _role(role: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role})


PROMPTS = [" ".join(f"word{(i * 7 + j) % 53}" for j in range(60 + 11 * i)) for i in range(3)]


def _completion(url: str, prompt: str, stream: bool = False) -> tuple[str, dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
    return text, {}


def _chat(url: str, content: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _held_blocks(url: str) -> float:
    return _counter(httpx.get(url + "/metrics", timeout=10).text, "kvserve:kv_cache_usage_perc")


@pytest.mark.slow
def test_vllm_router_pd_mode_equals_one_server(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    with contextlib.ExitStack() as stack:
        _, prefill = stack.enter_context(serving(
            model, tmp_path / "prefill.log", "--served-model-name", MODEL,
            "--kv-transfer-config", _role("kv_producer")))
        _, decode = stack.enter_context(serving(
            model, tmp_path / "decode.log", "--served-model-name", MODEL,
            "--kv-transfer-config", _role("kv_consumer")))
        # one server doing both: the prefill server asked directly
        want = [_completion(prefill, p)[0] for p in PROMPTS]
        want_chat = _chat(prefill, PROMPTS[0])
        url, _ = stack.enter_context(pd_router(prefill, decode, tmp_path / "router.log"))
        before = httpx.get(decode + "/metrics", timeout=10).text
        got = [_completion(url, p)[0] for p in PROMPTS]
        assert got == want
        assert _completion(url, PROMPTS[1] + " again", stream=True)[0] == \
            _completion(prefill, PROMPTS[1] + " again")[0]
        assert _chat(url, PROMPTS[0]) == want_chat
        after = httpx.get(decode + "/metrics", timeout=10).text
        # The decode server's prompts came from the prefill's KV: the hits are
        # the second tier's (received blocks), most of every prompt.
        hits = (_counter(after, "kvserve:prefix_cache_hits_total")
                - _counter(before, "kvserve:prefix_cache_hits_total"))
        queries = (_counter(after, "kvserve:prefix_cache_queries_total")
                   - _counter(before, "kvserve:prefix_cache_queries_total"))
        assert hits > 0.7 * queries, (hits, queries)
        deadline = time.monotonic() + 10  # pins let go once the decode side says done
        while time.monotonic() < deadline and (_held_blocks(prefill) or _held_blocks(decode)):
            time.sleep(0.2)
        assert _held_blocks(prefill) == 0 and _held_blocks(decode) == 0
