"""The built-in web view: static files shipped in the package, served at ``/`` and ``/static/``.

The page reads only the public REST API (``/api/v1``), so it needs no routes of its own beyond these files and no
build step: its scripts are ES modules (``static/*.js``, loaded by ``<script type="module">``) served as they are. The
files are not data: they are served without a token; the API calls they make carry one.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

STATIC_DIR = Path(__file__).resolve().parent / "static"
JAVASCRIPT = "text/javascript; charset=utf-8"
"""The content type of the page's modules (RFC 9239): browsers refuse a module script served as anything else, so it
is set here rather than left to the host's ``mimetypes`` table."""


class _StaticFiles(StaticFiles):
    """Starlette's static files, with the JavaScript content type on modules and revalidation on every load (an
    upgraded collector must never mix a stale module with fresh ones)."""

    def file_response(
        self, full_path: str | os.PathLike[str], stat_result: os.stat_result, scope: Scope, status_code: int = 200
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        if str(full_path).endswith(".js"):
            response.headers["content-type"] = JAVASCRIPT
        response.headers["cache-control"] = "no-cache"
        return response


def install(app: FastAPI) -> None:
    """Serve ``index.html`` at ``/`` and the page's modules and style sheet under ``/static/``."""
    index = STATIC_DIR / "index.html"

    @app.get("/", include_in_schema=False)
    def web_view() -> FileResponse:
        # no-cache: revalidate on every load, so an upgraded collector never serves a stale page.
        return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", _StaticFiles(directory=STATIC_DIR), name="static")
