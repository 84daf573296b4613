"""The engine page at / in a real headless Chromium (tests/support/browser.py): chat
with the default model, stop an answer and see the engine abort it, watch eight
requests share a prefix in the block map, and model output that holds HTML shown as
the text it is. Screenshots go to test-artifacts/engine-page/."""
from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.server.conftest import SMOL
from tests.support.browser import chromium, expect, screenshot
from tests.support.server import running_server

pytestmark = pytest.mark.slow

LONG = 60_000  # ms: the default model on two busy cores is slow to say much
HOSTILE = ('<script>window.__pwned = 1</script>'
           '<img src="x" onerror="window.__pwned = 2">')


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def open_page(browser, url: str, **context_options):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, **context_options)
    page = context.new_page()
    page.problems = []
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    page.on("dialog", lambda d: (page.problems.append(f"dialog: {d.message}"), d.dismiss()))
    page.on("console", lambda m: page.problems.append(f"console: {m.text}")
            if m.type == "error" and "Failed to load resource" not in m.text else None)
    page.goto(url)
    return page


@pytest.fixture
def page(browser, smol_url):
    page = open_page(browser, smol_url)
    expect(page.locator("#model option")).to_have_count(1)
    expect(page.locator("#engine-status")).to_have_attribute("data-kind", "live")
    yield page
    assert page.problems == []
    page.context.close()


def test_chat_streams_and_stop_aborts_the_request_in_the_engine(page):
    page.fill("#max_tokens", "400")
    page.fill("#chat-input", "Tell me a long story about a dragon who learns to bake.")
    page.click("#send")
    answer = page.locator(".message.assistant .content")
    expect(answer).to_have_text(re.compile(r"\w+ \w+ \w+"), timeout=LONG)
    first = answer.text_content()
    expect(answer).not_to_have_text(first, timeout=LONG)  # still coming, token by token
    mine = page.locator('#requests tr[data-mine="true"]')
    expect(mine).to_have_attribute("data-phase", "decode", timeout=LONG)
    screenshot(page, "chat-streaming")
    page.click("#stop")
    expect(page.locator(".message.assistant")).to_have_attribute("data-outcome", "stopped")
    expect(page.locator('#finished li[data-mine="true"]')).to_have_attribute(
        "data-reason", "abort", timeout=LONG)
    expect(mine).to_have_count(0)
    expect(page.locator("#card-running")).to_have_text("0", timeout=LONG)
    expect(page.locator("#answer-stats")).to_contain_text("TTFT")
    screenshot(page, "chat-stopped")


def test_eight_requests_fill_the_block_map_and_share_a_prefix(page, smol_url):
    shared = "Here is a report on the weather of the north sea in the spring. " * 12
    errors = []

    def run(i: int, max_tokens: int, first_token: threading.Event | None = None):
        body = {"model": SMOL, "prompt": f"{shared}Part {i}:", "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{smol_url}/v1/completions", json=body,
                              timeout=300) as r:
                for _ in r.iter_lines():
                    if first_token is not None:
                        first_token.set()
        except Exception as exc:  # reported by the test, not lost in a thread
            errors.append(exc)

    started = threading.Event()
    threads = [threading.Thread(target=run, args=(0, 160, started))]
    threads[0].start()
    assert started.wait(120)  # its prompt is computed and cached: the others hit it
    threads += [threading.Thread(target=run, args=(i, 100)) for i in range(1, 8)]
    for t in threads[1:]:
        t.start()
    try:
        expect(page.locator("#card-running")).to_have_text("8", timeout=LONG)
        counts = {state: page.locator(f'#block-legend [data-state="{state}"] .count')
                  for state in ("used", "shared")}
        expect(counts["shared"]).not_to_have_text("0")
        expect(counts["used"]).not_to_have_text("0")
        assert int(counts["shared"].text_content()) >= len(shared.split()) // 16
        # Seven of the eight prompts were mostly found in the prefix cache.
        expect(page.locator("#card-hits")).not_to_have_text(re.compile(r"^(0\.0%|–)$"))
        expect(page.locator('#requests tbody tr[data-phase="decode"]')).to_have_count(
            8, timeout=LONG)
        page.hover("#requests tbody tr >> nth=3")  # outlines that request's blocks
        screenshot(page, "eight-requests")
    finally:
        for t in threads:
            t.join(300)
    assert errors == []
    expect(page.locator("#card-running")).to_have_text("0", timeout=LONG)


@pytest.mark.parametrize("tab", ["chat", "completions"])
def test_model_output_holding_html_is_shown_as_text(browser, smol_url, tab):
    """The model is made to write HTML (a structured output allowing only that
    string), with the page's CSP switched off: what keeps it text is the page itself."""
    page = open_page(browser, smol_url, bypass_csp=True)
    expect(page.locator("#model option")).to_have_count(1)
    page.fill("#extra-body", json.dumps({"structured_outputs": {"choice": [HOSTILE]}}))
    if tab == "chat":
        page.fill("#chat-input", "Say something.")
        page.click("#send")
        target = page.locator(".message.assistant")
        text = page.locator(".message.assistant .content")
    else:
        page.click('[data-tab="completions"]')
        page.fill("#prompt", "Say something.")
        page.click("#complete")
        target = page.locator("#completion-output")
        text = page.locator("#completion-output .generated")
    expect(target).to_have_attribute("data-outcome", "done", timeout=LONG)
    expect(text).to_have_text(HOSTILE)
    assert page.locator("main img, main script").count() == 0
    assert page.evaluate("window.__pwned") is None
    screenshot(page, f"html-as-text-{tab}")
    assert page.problems == []
    page.context.close()


def test_with_an_api_key_the_page_asks_for_it_and_then_works(browser, tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory()), ["tiny"],
                    config=ServerConfig(api_keys=("page-key",), protect_metrics=True))
    with running_server(app) as url:
        page = open_page(browser, url)
        expect(page.locator("#status")).to_have_text("type the server's API key")
        expect(page.locator("#engine-status")).to_contain_text("needs the API key")
        page.fill("#api-key", "page-key")
        page.press("#api-key", "Enter")  # a change event
        expect(page.locator("#model option")).to_have_count(1)
        expect(page.locator("#engine-status")).to_have_attribute("data-kind", "live")
        page.fill("#max_tokens", "8")
        page.fill("#chat-input", "hello")
        page.click("#send")
        expect(page.locator(".message.assistant")).to_have_attribute("data-outcome", "done",
                                                                      timeout=LONG)
        expect(page.locator("#answer-stats")).to_contain_text("8 completion tokens")
        assert page.problems == []
        page.context.close()
