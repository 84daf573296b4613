"""Do two kvserve source trees generate the same greedy tokens? Each tree is served in
turn (bench/peers/kvserve.sh with KVSERVE_SRC, so it may be an older commit's `git
archive`, any layout), on the default model with its defaults, and asked the same
prompts at temperature 0; the tokens are compared one by one. For refactors that promise
behaviour unchanged.

  python bench/greedy_same.py /tmp/ab/before /tmp/ab/after [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "def fibonacci(n):", "Explain what a KV cache is, in two sentences.",
           "1, 1, 2, 3, 5, 8,", "Once upon a time, in a small village,"]


def serve(src: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([str(ROOT / "bench" / "peers" / "kvserve.sh"), str(port)],
                            env={**os.environ, "KVSERVE_SRC": src}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{src}: the server exited ({proc.returncode})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{src}: not ready in time")


def greedy(src: str, port: int, max_tokens: int) -> list[list[str]]:
    proc = serve(src, port)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        out = []
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "logprobs": 0}
            choice = httpx.post(url, json=body, timeout=300).json()["choices"][0]
            out.append(choice["logprobs"]["tokens"])  # one string a token
        return out
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8191)
    args = ap.parse_args(argv)
    runs = {src: greedy(src, args.port, args.max_tokens) for src in (args.before, args.after)}
    same = [a == b for a, b in zip(runs[args.before], runs[args.after])]
    print(json.dumps({"prompts": len(PROMPTS), "max_tokens": args.max_tokens,
                      "identical": sum(same), "differing": [p for p, s in zip(PROMPTS, same)
                                                           if not s]}))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
