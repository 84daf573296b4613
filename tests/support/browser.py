"""A real headless Chromium for the engine page's tests: Debian's `chromium`
(`.ci/run` installs it) driven by Playwright, which here only talks to that browser
and downloads none of its own.

Without the browser or Playwright the tests skip and say why, except where
KVSERVE_REQUIRE_BROWSER=1 (CI sets it), where that is a failure: a browser test that
quietly never ran would pass CI for nothing. Screenshots go to ARTIFACTS."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def _missing(why: str):
    if os.environ.get("KVSERVE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{why} (KVSERVE_REQUIRE_BROWSER=1)")
    pytest.skip(why)


def chromium_path() -> str:
    path = os.environ.get("KVSERVE_CHROMIUM") or shutil.which("chromium")
    if path is None:
        _missing("no chromium on PATH: apt-get install chromium (as .ci/run does)")
    return path


def _sync_api():
    try:
        from playwright import sync_api
    except ImportError:
        _missing("playwright is not installed (it is in the test extra)")
    return sync_api


def expect(locator, **kwargs):
    """Playwright's expect(), which retries until its condition holds (no test code
    runs inside the page: its CSP forbids eval)."""
    return _sync_api().expect(locator, **kwargs)


def launch(playwright):
    """The system's Chromium, headless, under a running Playwright."""
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    return playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])


@contextlib.contextmanager
def chromium():
    """Yields a Playwright Browser on the system's Chromium."""
    sync_playwright = _sync_api().sync_playwright
    with sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            yield browser
        finally:
            browser.close()


def screenshot(page, name: str) -> Path:
    """Saves the page as ARTIFACTS/engine-page/<name>.png (kept by CI as an artifact)."""
    path = ARTIFACTS / "engine-page" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return path
