"""The real `kvserve serve` command with the default SmolLM2-135M-Instruct model, run
as a subprocess and talked to over HTTP. The port comes from KVSERVE_PORT (no --port
flag), which tests that environment defaults reach the command line."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.http import (CompletionsClient, assert_error,
                                post_completions_concurrently)
from tests.support.server import free_port

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 180.0
STARTUP_TIMEOUT = 120.0


class ServerProcess(CompletionsClient):
    def __init__(self, proc: subprocess.Popen, url: str, port: int, log_path: Path):
        super().__init__(httpx.Client(base_url=url, timeout=TIMEOUT), MODEL)
        self.proc, self.url, self.port, self.log_path = proc, url, port, log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    assert (Path(default_model_dir) / "config.json").is_file()
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSERVE_") or k == "KVSERVE_CACHE"}
    env["KVSERVE_PORT"] = str(port)
    # Concurrent answers equal sequential ones only where no kernel changes with the
    # batch size: float32, eager (bf16, or the compiled batch-1 GEMV beside oneDNN's
    # batched GEMM, round differently; the compiled path has tests of its own).
    env.update(KVSERVE_DTYPE="float32", KVSERVE_COMPILE="off")
    log_path = tmp_path_factory.mktemp("kvserve-cli") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.server.entrypoints.cli", "serve"],
                                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    srv = ServerProcess(proc, f"http://127.0.0.1:{port}", port, log_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvserve exited with {proc.returncode}:\n{srv.log()[-4000:]}")
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"kvserve did not come up in {STARTUP_TIMEOUT:.0f} s:\n"
                            f"{srv.log()[-4000:]}")
            time.sleep(0.25)
        yield srv
    finally:
        srv.http.close()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)



def test_port_comes_from_kvserve_port_env(server):
    r = server.http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert f"http://127.0.0.1:{server.port}" in server.log()
    assert server.proc.poll() is None


def test_models(server):
    body = server.http.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == [MODEL]
    m = body["data"][0]
    assert m["object"] == "model" and m["owned_by"] == "kvserve"
    assert isinstance(m["max_model_len"], int) and m["max_model_len"] >= 2048


def test_capital_of_france(server):
    body = server.ok(prompt="The capital of France is", max_tokens=16, temperature=0)
    choice = body["choices"][0]
    assert "Paris" in choice["text"], choice["text"]
    assert choice["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] <= 16
    assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                             + body["usage"]["completion_tokens"])


def test_openai_sdk(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT,
                           max_retries=0)
    with client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        resp = client.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=12, temperature=0)
        text = resp.choices[0].text
        assert "Paris" in text
        assert resp.usage.completion_tokens == 12 or resp.choices[0].finish_reason == "stop"

        streamed, finish = "", None
        for chunk in client.completions.create(model=MODEL, prompt="The capital of France is",
                                               max_tokens=12, temperature=0, stream=True):
            if chunk.choices:
                streamed += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        assert streamed == text
        assert finish == resp.choices[0].finish_reason


WORDS = ("Continuous batching keeps the accelerator busy by letting requests join and "
         "leave at every step while paged attention stores keys and values in blocks "
         "so that memory is never wasted on padding and many users share one model").split()



def test_concurrent_requests_match_sequential(server):
    bodies = [dict(model=MODEL, prompt=" ".join(WORDS[:2 + (i * 7) % len(WORDS)]),
                   max_tokens=3 + (i * 5) % 9, temperature=0, ignore_eos=True)
              for i in range(16)]
    alone = [server.ok(**b) for b in bodies]
    together = post_completions_concurrently(server.url, bodies, TIMEOUT)
    for b, a, t in zip(bodies, alone, together):
        assert t["usage"]["completion_tokens"] == b["max_tokens"]
        assert t["choices"][0]["finish_reason"] == "length"
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert t["usage"][key] == a["usage"][key]  # cached_tokens may differ
        assert t["choices"][0]["text"] == a["choices"][0]["text"], b


@pytest.mark.parametrize("case", ["unknown model", "prompt too long", "negative max_tokens",
                                  "non-JSON"])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, case):
    if case == "unknown model":
        err = assert_error(server.complete(model="gpt-4", prompt="hi"), 404, "model")
        assert err["code"] == "model_not_found"
    elif case == "prompt too long":
        max_len = server.http.get("/v1/models").json()["data"][0]["max_model_len"]
        assert_error(server.complete(prompt=[1000] * (max_len + 1)), 400, "prompt")
        assert_error(server.complete(prompt="hello " * (max_len + 10)), 400, "prompt")
    elif case == "negative max_tokens":
        assert_error(server.complete(prompt="hi", max_tokens=-5), 400, "max_tokens")
    else:
        r = server.http.post("/v1/completions", content=b"{this is not json",
                             headers={"content-type": "application/json"})
        assert_error(r, 400)
    body = server.ok(prompt="The capital of France is", max_tokens=4, temperature=0)
    assert body["choices"][0]["text"]
    assert server.http.get("/health").status_code == 200
    assert server.proc.poll() is None
