"""What the engine page writes of requests and answers (server/ui/static/format.js),
run in node: a request's progress (computed / known in prefill, generated / max_tokens
in decode), a finished sequence (an embedding, a Stop), and the figures under a
chat answer, counted in tokens from the usage the stream reports."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

STATIC = Path(__file__).resolve().parents[2] / "server" / "ui" / "static"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="no node on PATH")


@pytest.fixture(scope="module")
def js(tmp_path_factory):
    """js(expression) -> the value of a JavaScript expression over format.js's exports."""
    folder = tmp_path_factory.mktemp("static")
    for path in STATIC.glob("*.js"):
        shutil.copy(path, folder)
    (folder / "package.json").write_text('{"type": "module"}')  # .js files as modules

    def run(expression: str):
        script = (f'import * as f from "{(folder / "format.js").as_uri()}";\n'
                  f"console.log(JSON.stringify({expression}));")
        done = subprocess.run([NODE, "--input-type=module", "-e", script], cwd=folder,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return run


def test_prefill_shows_computed_tokens_and_decode_generated_against_max_tokens(js):
    prefill = {"phase": "prefill", "computed_tokens": 40, "tokens": 100,
               "output_tokens": 0, "max_tokens": 400}
    decode = {"phase": "decode", "computed_tokens": 129, "tokens": 130,
              "output_tokens": 30, "max_tokens": 120}
    assert js(f"f.requestProgress({json.dumps(prefill)})") == {
        "fraction": 0.4, "text": "40 / 100 computed"}
    # Not full during decode (129 of 130 known tokens are computed).
    assert js(f"f.requestProgress({json.dumps(decode)})") == {
        "fraction": 0.25, "text": "30 / 120 generated"}


def test_an_embedding_is_told_as_one(js):
    f = {"reason": "length", "embedding": True, "prompt_tokens": 12, "output_tokens": 0}
    assert js(f"f.finishedText({json.dumps(f)})") == {
        "kind": "embedding", "reason": "embedding", "detail": "embedded 12 prompt tokens"}


@pytest.mark.parametrize("reason, tokens, want", [
    ("abort", 0, {"kind": "abort", "reason": "aborted", "detail": "after 0 tokens"}),
    ("abort", 1, {"kind": "abort", "reason": "aborted", "detail": "after 1 token"}),
    ("length", 400, {"kind": "length", "reason": "length", "detail": "400 tokens"}),
    ("stop", 1, {"kind": "stop", "reason": "stop", "detail": "1 token"}),
])
def test_a_generation_tells_the_tokens_its_client_got(js, reason, tokens, want):
    f = {"reason": reason, "embedding": False, "prompt_tokens": 5, "output_tokens": tokens}
    assert js(f"f.finishedText({json.dumps(f)})") == want


def stats(js, **answer) -> str:
    answer = {"usage": None, "sent": 0, "first": None, "last": None, "note": "", **answer}
    return js(f"f.answerStats({json.dumps(answer)})")


def test_a_stopped_answer_counts_tokens_not_chunks(js):
    # Stopped midway: the last chunk's usage (continuous usage stats) has the count.
    usage = {"prompt_tokens": 20, "completion_tokens": 11, "total_tokens": 31}
    assert stats(js, usage=usage, sent=0, first=500, last=1500, note="stopped") == (
        "20 prompt tokens · 11 completion tokens · TTFT 500 ms · 10.0 tokens/s · stopped")
    # Stopped before any chunk came: no token reached the client.
    assert stats(js, note="stopped") == "0 completion tokens · stopped"


def test_a_finished_answer_and_a_failed_one(js):
    usage = {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}
    assert stats(js, usage=usage, sent=0, first=200, last=900) == (
        "1 prompt token · 8 completion tokens · TTFT 200 ms · 10.0 tokens/s")
    assert stats(js, note="the model is not loaded") == "the model is not loaded"
