"""vLLM's control endpoints (its ``VLLM_SERVER_DEV_MODE`` routes), served with
``--enable-sleep-mode`` and behind ``--api-key``:

- ``POST /sleep?level=1|2&mode=abort|wait|keep``: give back the device memory of the
  weights (level 1: kept in host memory; level 2: read from the checkpoint again at
  wake-up), the KV pool and the CUDA graphs; answers the bytes by rank;
- ``POST /wake_up`` (``?tags=weights`` / ``?tags=kv_cache``: one of them first); answers the
  bytes taken back, ``is_sleeping`` until both are back;
- ``GET /is_sleeping``;
- ``POST /pause?mode=abort|wait|keep&clear_cache=true|false``, ``POST /resume``,
  ``GET /is_paused``;
- ``POST /reset_prefix_cache?reset_running_requests=false&reset_external=false``
  (running requests preempted first; the host tier's blocks too);
- ``POST /reload_weights`` (``{"path": ...}``: a checkpoint of the same model; none: the
  served one read again) and vLLM's ``POST /collective_rpc`` for its ``reload_weights``
  method: the weights replaced in place, for a trainer's new checkpoint (tpserve's; it
  reads any local path the server can, hence behind the key).

The engine's side is ``server/engine/control.py``; what a mode does to the requests in
flight, and to those that arrive meanwhile (they wait), ``server/engine/pause.py``. A bad
value is a 400 in OpenAI's envelope naming the parameter.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tpserve.server.engine.control import ENGINE_SLEEP_LEVELS, ENGINE_WAKE_TAGS
from tpserve.server.engine.pause import PAUSE_MODES
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.replies import ERROR_RESPONSES
from tpserve.server.http.state import get_state

# a sleep or pause of mode wait answers when the requests it waits for have ended; a
# wake-up captures the CUDA graphs again, and level 2 reads the checkpoint
CONTROL_TIMEOUT_S = 3600.0
CONTROL_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused",
                 "/reset_prefix_cache", "/reload_weights", "/collective_rpc")


def _choice(request: Request, name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = request.query_params.get(name, default)
    if value not in allowed:
        raise APIError.bad_request(f"{name} must be one of {', '.join(allowed)}, got "
                                   f"{value!r}", name)
    return value


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise APIError.bad_request(f"{name} must be true or false, got {value!r}", name)
    return value.lower() in ("true", "1")


async def _json(request: Request) -> dict:
    """The body as a JSON object ({} when empty); a 400 for anything else."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise APIError.bad_request(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError.bad_request("the body must be a JSON object")
    return body


async def _path(request: Request) -> str:
    body = await _json(request)
    unknown = sorted(set(body) - {"path"})
    if unknown:
        raise APIError.bad_request(f"unknown field(s) {', '.join(unknown)}; the body is "
                                   '{"path": FOLDER_OR_FILE} or empty', unknown[0])
    path = body.get("path", "")
    if not isinstance(path, str):
        raise APIError.bad_request("path must be a string", "path")
    return path


async def _ask(request: Request, query: str | tuple):
    return await get_state(request).engine.query(query, timeout=CONTROL_TIMEOUT_S)


def make_control_router() -> APIRouter:
    router = APIRouter(tags=["control"], responses=ERROR_RESPONSES)

    @router.post("/sleep")
    async def sleep(request: Request) -> JSONResponse:
        level = int(_choice(request, "level", "1", tuple(map(str, ENGINE_SLEEP_LEVELS))))
        mode = _choice(request, "mode", "abort", PAUSE_MODES)
        return JSONResponse(await _ask(request, ("sleep", level, mode)))

    @router.post("/wake_up")
    async def wake_up(request: Request) -> JSONResponse:
        tags = request.query_params.getlist("tags")
        for tag in tags:
            if tag not in ENGINE_WAKE_TAGS:
                raise APIError.bad_request(f"tags must be among {', '.join(ENGINE_WAKE_TAGS)}, got "
                                           f"{tag!r}", "tags")
        return JSONResponse(await _ask(request, ("wake_up", tuple(tags) or None)))

    @router.get("/is_sleeping")
    async def is_sleeping(request: Request) -> JSONResponse:
        return JSONResponse({"is_sleeping": await _ask(request, "is_sleeping")})

    @router.post("/pause")
    async def pause(request: Request) -> JSONResponse:
        mode = _choice(request, "mode", "abort", PAUSE_MODES)
        if _flag(request, "wait_for_inflight_requests", False):  # vLLM's older spelling
            mode = "wait"
        await _ask(request, ("pause", mode, _flag(request, "clear_cache", True)))
        return JSONResponse({"status": "paused"})

    @router.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        await _ask(request, "resume")
        return JSONResponse({"status": "resumed"})

    @router.get("/is_paused")
    async def is_paused(request: Request) -> JSONResponse:
        return JSONResponse({"is_paused": await _ask(request, "is_paused")})

    @router.post("/reload_weights")
    async def reload_weights(request: Request) -> JSONResponse:
        return JSONResponse(await _ask(request, ("reload_weights", await _path(request))))

    @router.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        body = await _json(request)
        if body.get("method") != "reload_weights":
            raise APIError.bad_request(f"method {body.get('method')!r} is not served; "
                                       "collective_rpc runs reload_weights only", "method")
        for key in ("args", "kwargs"):
            if body.get(key):
                raise APIError.bad_request(f"reload_weights takes no {key} here (it reads "
                                           "the served checkpoint again; POST "
                                           "/reload_weights names another)", key)
        answer = await _ask(request, ("reload_weights", ""))
        return JSONResponse({"results": [answer]})

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        running = _flag(request, "reset_running_requests", False)
        await _ask(request, ("reset_prefix_cache", running,
                             _flag(request, "reset_external", False)))
        return Response(status_code=200)

    return router
