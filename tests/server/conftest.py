from __future__ import annotations

import openai
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.server import running_server

SMOL = "smol"  # the default model's served name in these servers


@pytest.fixture(scope="session")
def smol_url(default_model_dir):
    """An in-process server on the default model (float32), for the tests that need
    a real tokenizer and a model that writes text: structured outputs, tools."""
    engine = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                 num_kv_blocks=512))
    # tools tests send each family's template with the request
    config = ServerConfig(trust_request_chat_template=True)
    with running_server(build_app(AsyncEngine(engine), [SMOL], config=config)) as base:
        yield base


@pytest.fixture(scope="session")
def smol_client(smol_url):
    """The real `openai` SDK pointed at smol_url."""
    return openai.OpenAI(base_url=f"{smol_url}/v1", api_key="none", max_retries=0)
