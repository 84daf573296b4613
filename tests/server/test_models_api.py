"""GET /v1/models and GET /v1/models/{model}, through the OpenAI SDK as clients
call them (`client.models.list()`, `client.models.retrieve(name)`)."""
from __future__ import annotations

import httpx
import openai
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error
from tests.support.server import running_server

NAMES = ["tiny", "org/tiny-alias"]  # served names often hold a slash


@pytest.fixture(scope="module")
def url(tiny_engine_factory):
    with running_server(build_app(AsyncEngine(tiny_engine_factory("llama")), NAMES)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("name", NAMES)
def test_retrieve_gives_the_card_the_list_gives(client, name):
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model" and card.owned_by == "kvserve"
    listed = next(m for m in client.models.list().data if m.id == name)
    assert card.model_dump() == listed.model_dump()
    assert card.model_extra["max_model_len"] > 0


def test_an_unknown_model_is_openais_404(client, url):
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    err = assert_error(httpx.get(url + "/v1/models/no-such-model"), 404, "model",
                       "model_not_found")
    assert "no-such-model" in err["message"]
    assert err["type"] == "not_found_error"
