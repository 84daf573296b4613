"""`kvserve run-batch -i in.jsonl -o out.jsonl` as a subprocess on the default model:
one answer line per input line, in the input's order, equal to the server's answers
to the same requests (greedy, float32, eager), a malformed line answered with its
error while the rest are served."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server.conftest import SMOL

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_run_batch_answers_each_line_as_the_server_does(smol_url, tmp_path):
    lines = [
        {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": SMOL, "max_tokens": 8, "temperature": 0,
                  "messages": [{"role": "user", "content": f"Name a fruit, number {i}."}]}}
        for i in range(3)
    ] + [
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"model": SMOL, "prompt": "The capital of France is", "max_tokens": 6,
                  "temperature": 0}},
        "{broken",
        {"custom_id": "refused", "method": "POST", "url": "/v1/completions",
         "body": {"model": "no-such-model", "prompt": "x", "max_tokens": 1}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n"
                              for ln in lines))
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSERVE_") or k == "KVSERVE_CACHE"}
    env.update(KVSERVE_DTYPE="float32", KVSERVE_COMPILE="off")
    done = subprocess.run([sys.executable, "-m", "kvserve.server.entrypoints.cli",
                           "run-batch", "-i", str(source), "-o", str(out),
                           "--served-model-name", SMOL, "--engine-mode", "thread"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    answers = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(answers) == len(lines)
    assert [a["custom_id"] for a in answers] == [
        "chat-0", "chat-1", "chat-2", "text", None, "refused"]
    for line, answer in zip(lines[:4], answers):
        want = httpx.post(f"{smol_url}{line['url']}", json=line["body"], timeout=120).json()
        body = answer["response"]["body"]
        assert answer["response"]["status_code"] == 200 and answer["error"] is None
        if line["url"] == "/v1/completions":
            assert body["choices"][0]["text"] == want["choices"][0]["text"]
        else:
            assert (body["choices"][0]["message"]["content"]
                    == want["choices"][0]["message"]["content"])
    assert answers[4]["response"] is None
    assert "not valid JSON" in answers[4]["error"]["message"]
    assert answers[5]["response"]["status_code"] == 404
    assert "answered" in done.stderr
