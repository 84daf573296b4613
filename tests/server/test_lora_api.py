"""LoRA adapters over HTTP: chosen by `model`, listed in /v1/models with their parent,
loaded and unloaded at run time behind --allow-runtime-lora-updating and --api-key,
every bad input a clear error that disturbs nothing loaded; 32 streams run through
loads and unloads with no failure and no leaked block; lora_requests_info."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from peft import PeftModel

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.lora_config import LoRAConfig
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.engine.lora.test_adapter import make_adapter
from tests.support.reference import load_reference, reference_greedy
from tests.support.server import running_server

BASE = "tiny"
KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """{name: directory}: two served from the start, two loaded later, and one of
    rank 32 (above --max-lora-rank 16)."""
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("http-adapters")
    specs = {"sql": dict(r=8, target_modules=["q_proj", "v_proj"]),
             "chat": dict(r=16, target_modules=["k_proj", "o_proj", "down_proj"]),
             "late": dict(r=16, target_modules=["gate_proj", "up_proj", "v_proj"]),
             "later": dict(r=8, target_modules=["q_proj", "down_proj"]),
             "big": dict(r=32, target_modules=["q_proj"])}
    for seed, (name, spec) in enumerate(specs.items(), 10):
        make_adapter(base, root / name, seed=seed, lora_alpha=16, **spec)
    return {name: str(root / name) for name in specs}


@pytest.fixture
def server(tiny_engine_factory, adapters):
    """(url, engine) of a server with "sql" and "chat" loaded, updating allowed."""
    lora = LoRAConfig(True, (("sql", adapters["sql"]), ("chat", adapters["chat"])),
                      max_loras=2, max_rank=16)
    engine = tiny_engine_factory("llama", dtype="float32", lora=lora)
    app = build_app(AsyncEngine(engine), [BASE],
                    config=ServerConfig(api_keys=[KEY], allow_runtime_lora_updating=True))
    with running_server(app) as url:
        yield url, engine


def greedy_ids(http: httpx.Client, model: str, prompt: list[int], n: int = 12) -> list[int]:
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n,
                                           "temperature": 0, "ignore_eos": True,
                                           "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def model_ids(http: httpx.Client) -> dict[str, str | None]:
    return {m["id"]: m["parent"] for m in http.get("/v1/models").json()["data"]}


def test_adapters_are_models_and_answer_as_peft_merged(server, adapters, tiny_model_dir):
    url, _ = server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        assert model_ids(http) == {BASE: None, "chat": BASE, "sql": BASE}
        card = http.get("/v1/models/sql").json()
        assert card["root"] == adapters["sql"] and card["parent"] == BASE
        prompt = [5, 17, 33, 2, 9, 41]
        base = tiny_model_dir("llama")
        for name in ("sql", "chat", BASE):
            ref = load_reference(base)
            if name != BASE:
                ref = PeftModel.from_pretrained(ref, adapters[name]).merge_and_unload()
            assert greedy_ids(http, name, prompt) == reference_greedy(ref, prompt, 12), name
        r = http.post("/v1/chat/completions", json={
            "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["model"] == "chat"
        r = http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_at_run_time(server, adapters):
    url, engine = server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        def load(name, path, **extra):
            return http.post("/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": path, **extra})

        r = load("late", adapters["late"])
        assert r.status_code == 200 and "added successfully" in r.text
        assert model_ids(http)["late"] == BASE
        assert len(greedy_ids(http, "late", [3, 4, 5])) == 12
        # Bad input: a clear 400 (404 for unknown names), nothing loaded disturbed.
        for name, path, says in [("x", "/nonexistent", "not a PEFT adapter"),
                                 ("x", adapters["big"], "above --max-lora-rank"),
                                 ("sql", adapters["late"], "already been loaded"),
                                 (BASE, adapters["late"], "base model"),
                                 ("x", "", "must be provided")]:
            r = load(name, path)
            assert r.status_code == 400, (name, r.text)
            assert says in r.json()["error"]["message"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert set(model_ids(http)) == {BASE, "sql", "chat", "late"}
        # Replacing in place: the name now serves the other adapter.
        assert load("late", adapters["later"], load_inplace=True).status_code == 200
        assert model_ids(http)["late"] == BASE
        assert http.get("/v1/models/late").json()["root"] == adapters["later"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200 and "removed successfully" in r.text
        assert set(model_ids(http)) == {BASE, "chat", "late"}
        r = http.post("/v1/completions", json={"model": "sql", "prompt": "hi"})
        assert r.status_code == 404
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/p"})
    assert r.status_code == 401  # --api-key guards it


def test_updating_is_refused_unless_allowed(tiny_engine_factory, adapters):
    lora = LoRAConfig(True, (), max_loras=1, max_rank=16)
    app = build_app(AsyncEngine(tiny_engine_factory("llama", lora=lora)), [BASE])
    with running_server(app) as url:
        r = httpx.post(f"{url}/v1/load_lora_adapter",
                       json={"lora_name": "late", "lora_path": adapters["late"]})
        assert r.status_code == 404
        assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [BASE]
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [BASE],
                    config=ServerConfig(allow_runtime_lora_updating=True))
    with running_server(app) as url:
        r = httpx.post(f"{url}/v1/load_lora_adapter",
                       json={"lora_name": "late", "lora_path": adapters["late"]})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_32_streams_through_loads_and_unloads(server, adapters):
    """Streams over the base model and three adapters while "late" is loaded and
    used, and "sql" (in use) and then "late" are unloaded: every stream ends with
    all its tokens, no block is leaked, and /v1/models follows each change."""
    url, engine = server

    async def main():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
            async def stream(i: int, model: str) -> tuple[int, str | None]:
                body = {"model": model, "prompt": [3 + i, 7, 11], "max_tokens": 300,
                        "ignore_eos": True, "stream": True}
                tokens, reason = 0, None
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            choice = json.loads(line[6:])["choices"][0]
                            tokens += bool(choice["text"]) or 0
                            reason = choice["finish_reason"] or reason
                return tokens, reason

            models = [BASE, "sql", "chat"]
            tasks = [asyncio.create_task(stream(i, models[i % 3])) for i in range(24)]
            await asyncio.sleep(0.1)
            r = await http.post("/v1/load_lora_adapter",
                                json={"lora_name": "late", "lora_path": adapters["late"]})
            assert r.status_code == 200
            tasks += [asyncio.create_task(stream(i, "late")) for i in range(8)]
            await asyncio.sleep(0.1)
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert r.status_code == 200
            assert engine.lora.retiring  # its requests still run, under its weights
            ids = {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
            assert ids == {BASE, "chat", "late"}
            results = await asyncio.gather(*tasks)
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
            assert r.status_code == 200
            ids = {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
            assert ids == {BASE, "chat"}
            return results

    results = asyncio.run(main())
    assert all(reason == "length" for _, reason in results), results
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.lora.retiring  # "sql" and "late" weights gone with their requests


def test_lora_requests_info_metric(server):
    url, _ = server
    text = httpx.get(f"{url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("kvserve:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_loads_come_from_under_the_lora_root_only(tiny_engine_factory, adapters, tmp_path):
    """--lora-root: a relative lora_path is read from it, an absolute one must lie in
    it once links are resolved; every refusal is the same 400 (outside, a link out,
    missing, not an adapter), so nothing is learnt of the files outside."""
    import os
    import shutil

    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(adapters["late"], root / "late")
    os.symlink(adapters["later"], root / "link-out")  # an adapter, but outside the root
    (root / "empty").mkdir()
    lora = LoRAConfig(True, (), max_loras=1, max_rank=16)
    app = build_app(AsyncEngine(tiny_engine_factory("llama", lora=lora)), [BASE],
                    config=ServerConfig(allow_runtime_lora_updating=True, lora_root=str(root)))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        def load(name, path):
            return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

        messages = set()
        for path in (adapters["later"], "link-out", "../" + root.name + "/../x", "missing",
                     "empty", "/etc"):
            r = load("x", path)
            assert r.status_code == 400, (path, r.text)
            messages.add(r.json()["error"]["message"])
        assert messages == {"lora_path must name a PEFT adapter directory under the "
                            "server's --lora-root"}
        assert load("late", "late").status_code == 200
        assert http.get("/v1/models/late").json()["root"] == str((root / "late").resolve())
        assert load("again", str(root / "late")).status_code == 200


def test_loads_past_max_cpu_loras_are_refused(tiny_engine_factory, adapters):
    lora = LoRAConfig(True, (("sql", adapters["sql"]),), max_loras=1, max_rank=16,
                      max_cpu_loras=2)
    app = build_app(AsyncEngine(tiny_engine_factory("llama", lora=lora)), [BASE],
                    config=ServerConfig(allow_runtime_lora_updating=True))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        def load(name):
            return http.post("/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": adapters["late"]})

        assert load("late").status_code == 200
        r = load("third")
        assert r.status_code == 400 and "--max-cpu-loras" in r.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        assert load("third").status_code == 200
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        LoRAConfig(True, (("a", "p"), ("b", "q")), max_loras=1, max_cpu_loras=1)


def test_an_adapter_is_read_beside_the_steps(server, adapters, monkeypatch):
    """A slow read (a large adapter) runs on the engine's reader thread: steps go on
    meanwhile, and the load answers once it is read."""
    import threading
    import time

    from kvserve.engine.lora import manager

    url, engine = server
    real, reader = manager.load_adapter, []

    def slow(*args, **kwargs):
        reader.append(threading.current_thread().name)
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(manager, "load_adapter", slow)
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        loading = threading.Thread(target=http.post, args=("/v1/load_lora_adapter",),
                                   kwargs={"json": {"lora_name": "late",
                                                    "lora_path": adapters["late"]}})
        loading.start()
        time.sleep(0.2)
        start = time.monotonic()
        r = http.post("/v1/completions", json={"model": BASE, "prompt": [3, 7], "max_tokens": 4})
        took = time.monotonic() - start
        loading.join()
        assert r.status_code == 200 and took < 1.0, took
        assert reader and reader[0].startswith("kvserve-lora-read")
        assert "late" in model_ids(http)
