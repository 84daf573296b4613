"""LoRA adapters over HTTP, as vLLM serves them: each is a model of its own in
/v1/models (its `parent` the base model, its `root` the directory it was loaded
from), and with --allow-runtime-lora-updating POST /v1/load_lora_adapter and
/v1/unload_lora_adapter change the set while requests run. A load answers once the
engine has read and checked the adapter (on a thread of its own, beside the steps);
an unload once no new request can use it (requests already using it finish with it).
With --lora-root, loads come from under that directory only."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kvserve.engine.client.adapters import AdapterNotFoundError
from kvserve.engine.client.engine_client import EngineClient, EngineDeadError
from kvserve.server.errors import APIError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name (once the new one loads)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what kvserve goes by


def lora_router(engine: EngineClient, model_names: list[str], allowed: bool,
                root: str | None = None) -> APIRouter:
    """root: --lora-root (None: any path)."""
    router = APIRouter()

    def check(name: str) -> None:
        if not allowed:
            raise APIError(404, "loading and unloading LoRA adapters is off: start the "
                           "server with --allow-runtime-lora-updating", code="not_found")
        if not engine.adapters.enabled:
            raise APIError(400, "LoRA adapters are not enabled: start the server with "
                           "--enable-lora", "lora_name")
        if not name.strip():
            raise APIError(400, "lora_name must not be empty", "lora_name")
        if name in model_names:
            raise APIError(400, f"{name!r} is the base model's name", "lora_name")

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        check(req.lora_name)
        if not req.lora_path.strip():
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "lora_path")
        path = req.lora_path if root is None else under_root(root, req.lora_path)
        await _change(engine, req.lora_name, path, req.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added "
                                 "successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        check(req.lora_name)
        await _change(engine, req.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 "successfully.")

    return router


def under_root(root: str, lora_path: str) -> str:
    """lora_path resolved under --lora-root (a relative one from it), if it names an
    adapter directory there; else one 400 for every reason (outside it, through a
    link out of it, missing, not an adapter), so that nothing is learnt about the
    files outside."""
    base = Path(root).resolve()
    candidate = (base / lora_path).resolve()
    if candidate.is_relative_to(base) and (candidate / "adapter_config.json").is_file():
        return str(candidate)
    raise APIError(400, "lora_path must name a PEFT adapter directory under the server's "
                   "--lora-root", "lora_path")


async def _change(engine: EngineClient, name: str, path: str | None,
                  replace: bool = False) -> None:
    try:
        await engine.change_adapter(name, path, replace)
    except AdapterNotFoundError as exc:
        raise APIError(404, str(exc), "lora_name", "model_not_found") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), "lora_path" if path else "lora_name") from exc
    except EngineDeadError as exc:
        raise APIError(503, "the engine is not running") from exc

