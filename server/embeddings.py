"""POST /v1/embeddings: each input's final hidden states pooled (--pooling: last token,
as decoder embedding models such as Qwen3-Embedding are trained, or mean) into one
unit vector. Embedding requests are prompts like any other to the scheduler (chunked,
batched with generation) that end after their prefill: no decode, no KV kept."""
from __future__ import annotations

import asyncio
import base64
import math
import struct
from typing import Literal

from pydantic import Field

from kvserve.engine.client.engine_client import EngineClient
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.background import in_background
from kvserve.server.errors import APIError
from kvserve.server.generation import EXPECTED_ERRORS, status_of
from kvserve.server.protocol import OpenAIRequest, TokenIds
from kvserve.server.request_owners import engine_request_id
from kvserve.server.tokenization import Tokenization
from kvserve.server.tracing import note
from kvserve.server.validation import check_model, lora_of, prompt_token_ids


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The input field in its four OpenAI forms, as a list of single inputs."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and isinstance(x[0], int):
            return [x]
        return list(x)


class EmbeddingService:
    def __init__(self, engine: EngineClient, model_names: list[str],
                 tokenization: Tokenization, pooling: str, max_inputs: int):
        self.engine, self.model_names, self.tokenization = engine, model_names, tokenization
        self.pooling, self.max_inputs = pooling, max_inputs

    async def create(self, req: EmbeddingRequest) -> dict:
        model = check_model(req.model, self.model_names, self.engine.adapters.served)
        inputs = req.inputs()
        if not inputs:
            raise APIError(400, "input must not be empty", "input")
        if self.max_inputs and len(inputs) > self.max_inputs:
            raise APIError(400, f"too many inputs in one request: {len(inputs)} (limit "
                           f"{self.max_inputs}, --max-prompts-per-request)", "input")
        self._check_dimensions(req.dimensions)
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running")
        for text in (x for x in inputs if isinstance(x, str)):
            self.tokenization.refuse_if_too_long(text, "input")
        ids = await self.tokenization.run(
            lambda: [prompt_token_ids(self.engine, x, "input") for x in inputs])
        rid = engine_request_id()
        lora = lora_of(self.engine, model)
        # The request's span (server/tracing.py), when traced: no engine timings here.
        note(model=model, request_id=rid, lora=lora, prompt_tokens=sum(map(len, ids)))
        tasks = [asyncio.create_task(self._embed(f"{rid}-{i}", x, lora))
                 for i, x in enumerate(ids)]
        try:
            vectors = await asyncio.gather(*tasks)
        except EXPECTED_ERRORS as exc:
            raise APIError(*status_of(exc)) from exc
        finally:  # one input failed: the others' engine requests are aborted
            for t in tasks:
                t.cancel()
        data = [{"object": "embedding", "index": i,
                 "embedding": _encoded(_shortened(v, req.dimensions), req.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(x) for x in ids)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _embed(self, rid: str, ids: list[int], lora: str | None) -> list[float]:
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=self.pooling)
        async for out in self.engine.generate(rid, ids, params, lora_name=lora,
                                              background=in_background()):
            if out.finish_reason == "error":
                raise APIError(500, f"the engine failed this request: {out.error}")
            if out.embedding is not None:
                return out.embedding
        raise APIError(500, "the engine returned no embedding")

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        allowed, size = self.engine.shorter_embeddings, self.engine.hidden_size
        if allowed is None:
            raise APIError(400, "this model does not support `dimensions` (it is not a "
                           "Matryoshka embedding model)", "dimensions")
        if dimensions > size or (allowed and dimensions not in allowed):
            what = f"one of {list(allowed)}" if allowed else f"at most {size}"
            raise APIError(400, f"dimensions must be {what}, got {dimensions}",
                           "dimensions")


def _shortened(vector: list[float], dimensions: int | None) -> list[float]:
    """A Matryoshka vector cut to its first `dimensions` values, made unit length again."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    cut = vector[:dimensions]
    norm = math.sqrt(sum(v * v for v in cut)) or 1.0
    return [v / norm for v in cut]


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """base64: the float32 values, little-endian, as OpenAI sends them."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
