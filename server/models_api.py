"""GET /v1/models and /v1/models/{model}: the base model under each served name, and
each LoRA adapter as a model of its own (its `parent` the base model's first name,
its `root` the directory it was loaded from), as vLLM lists them."""
from __future__ import annotations

import time

from fastapi import APIRouter

from kvserve.engine.client.engine_client import EngineClient
from kvserve.server.validation import check_model


def models_router(engine: EngineClient, model_names: list[str], model_root: str = ""
                  ) -> APIRouter:
    router = APIRouter()
    created = int(time.time())

    def card(name: str, root: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                "root": root, "parent": parent, "max_model_len": engine.max_model_len}

    def cards() -> list[dict]:
        adapters = sorted(engine.adapters.served.items())
        return ([card(name, model_root or name, None) for name in model_names]
                + [card(name, path, model_names[0]) for name, path in adapters])

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": cards()}

    # `:path`: served names often hold a slash ("meta-llama/Llama-3.2-1B")
    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        name = check_model(model, model_names, engine.adapters.served)
        return next(c for c in cards() if c["id"] == name)

    return router
