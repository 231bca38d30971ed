"""The dashboard's routes: the page and its static files, served by the ingress itself so
that an operator needs nothing but a browser and the cluster's address (no build step, no
CDN: the page must work on a cluster that reaches no network).

The routes are plain functions on the module-level ``app`` (like ``install_openapi``'s
document), not methods of the Serve class: they read nothing of the ingress's state, and
the page gets its numbers from ``/cluster/stats`` and ``/cluster/decisions`` like any
client. The API-key middleware guards them (``cluster.api.auth``: Basic credentials for a
browser)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

from cluster.api.errors import APIError

STATIC = Path(__file__).resolve().parent / "static"
# the only files served, each with its type: a whitelist, so no path ever reaches the disk
# from a request's text
STATIC_TYPES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "LICENSE.uPlot": "text/plain; charset=utf-8",
}
# a cluster upgraded in place serves new files at the same names: the browser revalidates
NO_CACHE = {"cache-control": "no-cache"}


def install_dashboard(app: FastAPI) -> None:
    """Add ``GET /dashboard`` and ``GET /dashboard/static/{name}`` to ``app``."""
    app.add_api_route(
        "/dashboard",
        dashboard,
        methods=["GET"],
        response_class=FileResponse,
        include_in_schema=False,
    )
    app.add_api_route(
        "/dashboard/static/{name}",
        dashboard_static,
        methods=["GET"],
        response_class=FileResponse,
        include_in_schema=False,
    )


async def dashboard() -> FileResponse:
    """The page: an HTML shell that loads its script and styles from ``/dashboard/static``."""
    return FileResponse(
        STATIC / "index.html", media_type="text/html; charset=utf-8", headers=NO_CACHE
    )


async def dashboard_static(name: str) -> FileResponse:
    """One of the page's files, by name; any other name is a 404 in OpenAI form."""
    media_type = STATIC_TYPES.get(name)
    if media_type is None:
        raise APIError(404, f"No dashboard file named {name!r}", "not_found_error")
    return FileResponse(STATIC / name, media_type=media_type, headers=NO_CACHE)
