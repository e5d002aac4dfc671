"""``GET /sdk/<file>``: onceflow's browser SDK (``onceflow/sdk/js``), served by ``onceflow api``.

A page imports it as an ES module — ``import { WorkspaceClient } from "/sdk/index.js"`` —
with no build step; the same folder is the npm package ``@onceflow/client`` (its
``package.json``, type declarations and README). Only the folder's top-level ``.js`` and
``.d.ts`` files are served (a fixed list read at start-up: no path from the URL reaches the
file system), without a key (it is public code), with an ETag so a reload revalidates
cheaply, and with ``Access-Control-Allow-Origin: *`` so a page on another origin may import
it (its calls to ``/v1`` are then cross-origin: add CORS for that origin yourself).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final

from fastapi import APIRouter, Request, Response
from starlette.responses import JSONResponse

SDK_DIR: Final = Path(__file__).resolve().parents[2] / "sdk" / "js"
_TYPES: Final = {".js": "text/javascript; charset=utf-8", ".ts": "text/plain; charset=utf-8"}


def _load() -> dict[str, tuple[bytes, str, str]]:
    files: dict[str, tuple[bytes, str, str]] = {}
    for path in sorted(SDK_DIR.glob("*")):
        if path.is_file() and (path.name.endswith(".js") or path.name.endswith(".d.ts")):
            data = path.read_bytes()
            etag = '"' + hashlib.sha256(data).hexdigest()[:32] + '"'
            files[path.name] = (data, _TYPES[path.suffix], etag)
    return files


def create_sdk_router() -> APIRouter:
    """The ``/sdk/{name}`` route over the files present when the app is built."""
    files = _load()
    router = APIRouter(include_in_schema=False)

    @router.get("/sdk/{name}")
    def sdk_file(name: str, request: Request) -> Response:
        found = files.get(name)
        if found is None:
            return JSONResponse({"detail": "no such SDK file", "code": "not_found"}, 404)
        data, media_type, etag = found
        headers = {
            "ETag": etag,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
            "Access-Control-Allow-Origin": "*",
        }
        if etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        return Response(data, media_type=media_type, headers=headers)

    return router
