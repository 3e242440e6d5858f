"""`GET /dashboard`: a live page of sessions, KV pages, prefix reuse, latency and snapshots for a person
watching the server (Prometheus text is for machines).

The page and its script and style are static files shipped in the package (kiln/server/dashboard_assets:
plain HTML, CSS and JavaScript drawing SVG charts; no CDN, no build step) and open, like /healthz: they
hold no data. The data comes from `GET /dashboard/state.json`, which the page polls every second and
which is authenticated like the API: with keys on, the page asks for a key and sends it as a Bearer
token; a key sees its own sessions, an admin key (kiln/server/auth.py) everyone's.
`GET /dashboard/sessions/{id}.json` is one session's drill-down. Both answer from the shared reading of
kiln/server/dashboard_state.py, rebuilt on a worker thread at most twice a second, its JSON encoded
there once per caller scope. Any other path under /dashboard is 404 (401 first without a key).
"""

from __future__ import annotations

import asyncio
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kiln.errors import NotFoundError
from kiln.server.auth import ApiKeys
from kiln.server.dashboard_state import DashboardState
from kiln.server.http_auth import caller

ASSETS = {  # path -> (file in dashboard_assets, media type)
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/style.css": ("style.css", "text/css; charset=utf-8"),
}
NO_STORE = {"Cache-Control": "no-store"}


def _asset(name: str) -> bytes:
    return resources.files("kiln.server").joinpath("dashboard_assets", name).read_bytes()


class DashboardRoutes:
    def __init__(self, keys: ApiKeys, state: DashboardState) -> None:
        self.keys = keys
        self.state = state
        self.files = {path: (_asset(name), media) for path, (name, media) in ASSETS.items()}

    def router(self) -> APIRouter:
        router = APIRouter(include_in_schema=False)
        for path in self.files:
            router.add_api_route(path, self._serve_asset, methods=["GET"], name=f"dashboard{path[10:]}")

        @router.get("/dashboard/state.json")
        async def dashboard_state(request: Request) -> Response:
            owner = caller(request)
            body = await asyncio.to_thread(lambda: self.state.reading().encoded(owner, self.keys.sees_all(owner)))
            return Response(body, media_type="application/json", headers=NO_STORE)

        @router.get("/dashboard/sessions/{session_id}.json")
        async def dashboard_session(request: Request, session_id: str) -> JSONResponse:
            owner = caller(request)
            detail = await asyncio.to_thread(lambda: self.state.reading().session(session_id, owner, self.keys.sees_all(owner)))
            if detail is None:
                raise NotFoundError(f"no live session {session_id[:64]!r}")
            return JSONResponse(detail, headers=NO_STORE)

        return router

    async def _serve_asset(self, request: Request) -> Response:
        body, media = self.files[request.url.path]
        return Response(body, media_type=media, headers=NO_STORE)
