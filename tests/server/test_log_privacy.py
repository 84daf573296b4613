"""At INFO, a real `kvserve serve` (root, kvserve.* and uvicorn's error and access
loggers, all into one file) writes no API key (right or wrong), no prompt text and
no generated text, whatever the requests: good ones, streamed ones, a client that
hangs up, one past --request-timeout, unknown fields, bad and unauthorized ones."""
from __future__ import annotations

import json
import signal

import httpx

from tests.server.test_ops_shutdown import serving
from tests.support.http import parse_sse

KEY = "sk-kvserve-SECRETKEY-4242"
WRONG_KEY = "sk-wrong-WRONGKEY-1717"
PROMPT = "zebra quokka PROMPTMARK platypus"
FIELD_VALUE = "FIELDVALUEMARK-9090"
MIN_TEXT = 12  # shorter generated texts could turn up in any log by chance


def _requests(url: str) -> list[str]:
    """Sends every kind of request; returns the texts the server generated."""
    ok = {"Authorization": f"Bearer {KEY}"}
    texts = []
    with httpx.Client(base_url=url, timeout=60, headers=ok) as c:
        for stream in (False, True):
            body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": stream,
                    "unknown_field": FIELD_VALUE}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            texts += ([r.json()["choices"][0]["text"]] if not stream else
                      ["".join(ch["choices"][0]["text"] for ch in parse_sse(r.content)
                               if ch["choices"])])
            chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                    "ignore_eos": True, "stream": stream}
            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            if not stream:
                texts.append(r.json()["choices"][0]["message"]["content"])
        # Past --request-timeout: aborted, and logged (by its id).
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2000,
                                             "ignore_eos": True})
        assert r.json()["choices"][0]["finish_reason"] == "abort", r.text
        texts.append(r.json()["choices"][0]["text"])
        # A client that hangs up mid-stream.
        with c.stream("POST", "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())
        # Bad requests, each carrying the prompt.
        bad = [{"prompt": PROMPT, "temperature": "hot"},
               {"prompt": PROMPT, "max_tokens": -1},
               {"prompt": PROMPT, "model": "no-such-model"},
               {"prompt": [PROMPT, 5]}]
        for body in bad:
            assert 400 <= c.post("/v1/completions", json=body).status_code < 500
        r = c.post("/v1/completions", content=b'{"prompt": "' + PROMPT.encode() + b'",',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert c.post("/tokenize", json={"prompt": PROMPT}).status_code == 200
    # Unauthorized: a wrong key, and the right key sent the wrong way.
    with httpx.Client(base_url=url, timeout=60) as c:
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert c.post("/v1/completions", json=body, headers={
            "Authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
        assert c.post("/v1/completions", json=body, headers={
            "Authorization": f"Basic {KEY}"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}
                     ).status_code == 401
    return texts


def test_no_key_prompt_or_output_in_info_logs(tiny_model_dir, tmp_path):
    log_path = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log_path, "--api-key", KEY,
                 "--request-timeout", "1") as (proc, url):
        texts = _requests(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    log = log_path.read_text()
    # The capture works at INFO: access lines, the unknown field (by name), the timeout.
    assert " INFO " in log and 'POST /v1/completions HTTP/1.1" 200' in log, log
    assert 'POST /v1/completions HTTP/1.1" 401' in log, log
    assert "unknown_field" in log and "ran past --request-timeout" in log, log
    secrets = [KEY, WRONG_KEY, FIELD_VALUE] + PROMPT.split()
    secrets += [t for t in texts if len(t) >= MIN_TEXT]
    secrets += [json.dumps(t)[1:-1] for t in texts if len(t) >= MIN_TEXT]  # escaped
    assert len(secrets) > len(PROMPT.split()) + 5, texts  # enough generated text to look for
    leaked = [s for s in secrets if s in log]
    assert not leaked, f"in the log: {leaked}\n{log}"
