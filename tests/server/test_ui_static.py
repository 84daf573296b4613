"""The engine page's files (server/ui/static): everything the page loads is ours,
shipped in the package and served with a type the browser accepts for it; nothing
comes from elsewhere. The browser tests (test_engine_page_browser.py) show it works;
these show it works from a plain `pip install .` and without a network."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from kvserve.server.ui.routes import CSP
from tests.support.server import running_server

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "server" / "ui" / "static"
LINKS = re.compile(r'\b(?:src|href)="([^"]*)"')
IMPORTS = re.compile(r'^import\b[^;]*?from\s+"([^"]+)"', re.MULTILINE)


def page_links() -> list[str]:
    return LINKS.findall((STATIC / "index.html").read_text())


def module_imports(path: Path) -> list[str]:
    return IMPORTS.findall(path.read_text())


def test_the_page_loads_only_its_own_files():
    links = page_links()
    assert "/ui/static/main.js" in links and "/ui/static/style.css" in links
    for link in links:
        if link.startswith("data:"):
            continue
        assert link.startswith("/ui/static/"), f"{link}: not served by kvserve"
        assert (STATIC / link.removeprefix("/ui/static/")).is_file(), link


def test_every_module_import_is_a_shipped_file():
    modules = sorted(STATIC.glob("*.js"))
    assert len(modules) >= 5
    for module in modules:
        for target in module_imports(module):
            assert target.startswith("./"), f"{module.name} imports {target} from elsewhere"
            assert (STATIC / target[2:]).is_file(), f"{module.name}: {target} is missing"


def test_package_data_ships_every_static_file():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["kvserve.server.ui"]
    shipped = {p for g in globs for p in (ROOT / "server" / "ui").glob(g)}
    assert set(STATIC.iterdir()) <= shipped


@pytest.fixture(scope="module")
def page_server(tiny_engine_factory):
    with running_server(build_app(AsyncEngine(tiny_engine_factory()), ["tiny"])) as url:
        yield url


@pytest.mark.parametrize("path", ["/", "/ui", "/ui/"])
def test_the_page_is_served_with_its_content_security_policy(page_server, path):
    r = httpx.get(page_server + path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == CSP
    assert "script-src 'self'" in CSP and "unsafe" not in CSP
    assert r.text == (STATIC / "index.html").read_text()


def test_each_file_is_served_with_a_type_the_browser_accepts(page_server):
    # A module script served as anything but JavaScript is refused by the browser.
    want = {".js": "javascript", ".css": "text/css", ".html": "text/html"}
    for path in STATIC.iterdir():
        r = httpx.get(f"{page_server}/ui/static/{path.name}")
        assert r.status_code == 200, path.name
        assert want[path.suffix] in r.headers["content-type"], (path.name, r.headers)
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.content == path.read_bytes()
    assert httpx.get(f"{page_server}/ui/static/nothing.js").status_code == 404
