"""The engine page's words for a request, in a real headless Chromium
(tests/support/browser.py) on the default model: a decoding row's progress counts
generated tokens against max_tokens, a stopped chat answer's figures count tokens,
the stop is listed as "aborted after N tokens", and an embedding as one."""
from __future__ import annotations

import re

import httpx
import pytest

from tests.server.conftest import SMOL
from tests.support.browser import chromium, expect, screenshot

pytestmark = pytest.mark.slow

LONG = 60_000  # ms: the default model on two busy cores is slow to say much


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser, smol_url):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    problems = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(smol_url)
    expect(page.locator("#model option")).to_have_count(1)
    expect(page.locator("#engine-status")).to_have_attribute("data-kind", "live")
    yield page
    assert problems == []
    context.close()


def test_a_stopped_answer_counts_tokens_in_the_playground_and_the_engine_view(page):
    page.fill("#max_tokens", "400")
    page.fill("#chat-input", "Tell me a long story about a dragon who learns to bake.")
    page.click("#send")
    mine = page.locator('#requests tr[data-mine="true"]')
    expect(mine).to_have_attribute("data-phase", "decode", timeout=LONG)
    expect(mine).to_contain_text(re.compile(r"\b[1-9]\d* / \d+ generated"), timeout=LONG)
    assert mine.locator(".bar").evaluate("bar => bar.style.width") != "100%"
    page.click("#stop")
    expect(page.locator(".message.assistant")).to_have_attribute("data-outcome", "stopped")
    stats = page.locator("#answer-stats")
    expect(stats).to_contain_text(re.compile(r"\d+ completion tokens? · .*stopped"))
    assert "chunk" not in stats.text_content()
    ended = page.locator('#finished li[data-mine="true"]')
    expect(ended).to_have_attribute("data-reason", "abort", timeout=LONG)
    expect(ended).to_contain_text(re.compile(r"aborted\s*after \d+ tokens?"))
    screenshot(page, "stopped-in-tokens")


def test_an_embedding_is_listed_as_one(page, smol_url):
    r = httpx.post(f"{smol_url}/v1/embeddings", json={"model": SMOL, "input": "embed me"},
                   timeout=120)
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    word = "token" if prompt == 1 else "tokens"
    expect(page.locator("#finished li").first).to_contain_text(
        f"embedded {prompt} prompt {word}", timeout=LONG)
    assert "length" not in page.locator("#finished li").first.text_content()
