"""GET / and /ui serve the page; /ui/static/ its scripts and styles, from the package.

The page holds no data (everything comes from the public endpoints, with the key the
user types when --api-key is set), so it is served without a key: a browser cannot
send one when it opens a page. Its Content-Security-Policy lets it run only its own
scripts and reach only this server, so text the model writes can never become code
on it, even if some day it were put in as HTML (it is always put in as text)."""
from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = files("kvserve.server.ui") / "static"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class _StaticFiles(StaticFiles):
    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-cache"  # an upgrade shows at once
        return response


def install_ui(app: FastAPI) -> None:
    page = (STATIC / "index.html").read_text(encoding="utf-8")

    async def index():
        return HTMLResponse(page, headers=PAGE_HEADERS)

    for path in ("/", "/ui", "/ui/"):
        app.add_api_route(path, index, methods=["GET"], include_in_schema=False)
    app.mount("/ui/static", _StaticFiles(packages=[("kvserve.server.ui", "static")]), name="ui")
