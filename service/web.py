"""The built-in web view: static files shipped in the package, served at ``/`` and ``/static/``.

The page reads only the public REST API (``/api/v1``), so it needs no routes of its own beyond these files and no
build step. The files are not data: they are served without a token; the API calls they make carry one.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"


def install(app: FastAPI) -> None:
    """Serve ``index.html`` at ``/`` and the page's script and style sheet under ``/static/``."""
    index = STATIC_DIR / "index.html"

    @app.get("/", include_in_schema=False)
    def web_view() -> FileResponse:
        # no-cache: revalidate on every load, so an upgraded collector never serves a stale page.
        return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
