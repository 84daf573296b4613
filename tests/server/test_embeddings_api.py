"""POST /v1/embeddings on tiny random models (Llama and Qwen3 architectures, float32):
the vectors equal transformers' final hidden states under the same pooling (last token,
mean), normalised, within 1e-4, for 16 inputs sent while 16 generations run; base64
round-trips; token-id inputs; `dimensions` only where the model allows it; bad input
is a 4xx and nothing leaks."""
from __future__ import annotations

import base64
import json
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error
from tests.support.server import running_server
from tests.support.tiny_models import CORPUS, make_tiny_model

MODEL = "tiny-embed"
TEXTS = [CORPUS[i % 6][: 20 + 7 * i] for i in range(16)]


@pytest.fixture(scope="module", params=[("llama", "last"), ("qwen3", "mean")],
                ids=["llama-last", "qwen3-mean"])
def served(request, tmp_path_factory):
    arch, pooling = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(f"embed-{arch}"), arch=arch)
    # a small block size and token budget: long inputs take several chunks
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=256, block_size=16,
                                 max_num_batched_tokens=64))
    app = build_app(AsyncEngine(engine), [MODEL], config=ServerConfig(pooling=pooling))
    with running_server(app) as url:
        yield url, path, pooling, engine


def reference(path, pooling: str, ids: list[int]) -> torch.Tensor:
    model = AutoModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0)


def test_vectors_equal_transformers_while_generations_run(served):
    url, path, pooling, engine = served
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    long_text = " ".join(CORPUS[:6]) * 2  # several 64-token chunks
    texts = TEXTS[:15] + [long_text]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def generate(i):
        return httpx.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": TEXTS[i], "max_tokens": 24, "ignore_eos": True,
            "temperature": 1.0, "seed": i}, timeout=120).json()

    with ThreadPoolExecutor(17) as pool:
        gens = [pool.submit(generate, i) for i in range(16)]
        embedded = pool.submit(lambda: client.embeddings.create(model=MODEL, input=texts))
        out = embedded.result()
        assert all(g.result()["usage"]["completion_tokens"] == 24 for g in gens)
    assert [d.index for d in out.data] == list(range(16))
    ids = [tokenizer.encode(t) for t in texts]
    assert out.usage.prompt_tokens == sum(map(len, ids))
    for d, x in zip(out.data, ids):
        want = reference(path, pooling, x)
        got = torch.tensor(d.embedding)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # again, now that its blocks are in the prefix cache ("last" may hit them; "mean"
    # must compute every row)
    hits_before = engine.scheduler.stats().prefix_hits
    again = client.embeddings.create(model=MODEL, input=long_text).data[0].embedding
    assert torch.allclose(torch.tensor(again), torch.tensor(out.data[15].embedding), atol=1e-5)
    assert (engine.scheduler.stats().prefix_hits > hits_before) == (pooling == "last")
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_base64_round_trips_and_token_ids_are_inputs(served):
    url, path, pooling, _ = served
    ids = AutoTokenizer.from_pretrained(str(path)).encode(TEXTS[3])
    floats = httpx.post(f"{url}/v1/embeddings", json={
        "model": MODEL, "input": TEXTS[3]}, timeout=60).json()
    packed = httpx.post(f"{url}/v1/embeddings", json={
        "model": MODEL, "input": [ids], "encoding_format": "base64"}, timeout=60).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert decoded == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)
    assert floats["object"] == "list" and floats["model"] == MODEL
    # the SDK asks for base64 by default and decodes it itself
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    again = sdk.embeddings.create(model=MODEL, input=TEXTS[3]).data[0].embedding
    assert again == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)
    want = reference(path, pooling, ids)
    assert torch.allclose(torch.tensor(decoded), want, atol=1e-4)


BAD = [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, None),
    ({"input": [[]]}, 400, None),
    ({"input": [[10 ** 7]]}, 400, None),
    ({"input": "x " * 5000}, 400, None),
    ({"dimensions": 8}, 400, "dimensions"),
    ({"encoding_format": "int8"}, 400, None),
    ({"model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("extra,status,param", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_input_is_a_clear_error_and_serving_goes_on(served, extra, status, param):
    url, *_ = served
    r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "hi", **extra},
                   timeout=60)
    assert_error(r, status) if param is None else assert_error(r, status, param)
    ok = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1


def test_dimensions_on_a_matryoshka_model(tmp_path):
    path = make_tiny_model(tmp_path / "mrl")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=64))
    with running_server(build_app(AsyncEngine(engine), [MODEL])) as url:
        full = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "hi"},
                          timeout=60).json()["data"][0]["embedding"]
        short = httpx.post(f"{url}/v1/embeddings", json={
            "model": MODEL, "input": "hi", "dimensions": 16}, timeout=60).json()
        vector = torch.tensor(short["data"][0]["embedding"])
        assert vector.shape == (16,)
        want = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0)
        assert torch.allclose(vector, want, atol=1e-6)
        assert_error(httpx.post(f"{url}/v1/embeddings", json={
            "model": MODEL, "input": "hi", "dimensions": 20}, timeout=60), 400, "dimensions")
