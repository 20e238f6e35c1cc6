"""The LoRA adapters served by name, and vLLM's runtime routes that change them:
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``), answered as vLLM answers them
(plain-text success, 400 for a name already served or an adapter that cannot be loaded,
404 for a path that holds no adapter (vLLM's "No adapter found") and for unloading a name
not served). A ``lora_path`` that is a Hugging Face repository id
(not a local path) is fetched into the cache (``--download-dir``) first, off the event
loop, as vLLM resolves one. They need ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
at start-up (the engine refuses them otherwise, 400).

The engine owns the slots (``server/engine/lora_slots``); this side maps names to
``(slot, id)``, updated only after the engine has answered, one change at a time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tpserve.model.loader.hub import local_folder
from tpserve.model.lora.adapter import CONFIG_FILE
from tpserve.server.engine.errors import InvalidRequestError
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.lora_names import ServedAdapter
from tpserve.server.http.replies import ERROR_RESPONSES
from tpserve.server.http.state import get_state


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    # vLLM's: replace the adapter served under lora_name by lora_path's (RL trainers push
    # new weights so); the new weights load into a free slot beside the old ones, the name
    # then moves to them and the old slot is unloaded (its requests finish on the old)
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name alone says which


def make_lora_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["lora"])

    @router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> str:
        state = get_state(request)
        name = body.lora_name
        if not name or not body.lora_path:
            raise APIError.bad_request("lora_name and lora_path must not be empty",
                                       "lora_name" if not name else "lora_path")
        try:  # a repository id, as vLLM takes one: its snapshot in the cache
            path = await asyncio.to_thread(local_folder, body.lora_path, state.download_dir)
        except FileNotFoundError as e:
            raise _no_adapter(name, body.lora_path, str(e)) from None
        if not await asyncio.to_thread(Path(path, CONFIG_FILE).is_file):
            raise _no_adapter(name, path, f"no {CONFIG_FILE} in {path}")
        async with state.loras.lock:
            old = state.loras.get(name)
            if state.serves_base(name) or (old is not None and not body.load_inplace):
                raise APIError.bad_request(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.", "lora_name")
            try:
                slot, lora_id = await state.engine.query(("lora_load", path))
            except InvalidRequestError as e:
                if old is None:
                    raise
                raise APIError.bad_request(
                    f"load_inplace of '{name}' loads the new weights beside the old ones, "
                    f"which their requests finish on: {e}", "load_inplace") from None
            state.loras.adapters[name] = ServedAdapter(
                name, path, None if old is None else old.parent, slot, lora_id)
            if old is not None:
                await state.engine.query(("lora_unload", old.slot, old.lora_id))
        return f"Success: LoRA adapter '{name}' added successfully."

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> str:
        state = get_state(request)
        name = body.lora_name
        async with state.loras.lock:
            adapter = state.loras.get(name)
            if adapter is None:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                               param="lora_name", code="model_not_found")
            await state.engine.query(("lora_unload", adapter.slot, adapter.lora_id))
            del state.loras.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    return router


def _no_adapter(name: str, path: str, why: str) -> APIError:
    """vLLM's answer to a path without an adapter: 404, NotFoundError."""
    return APIError(404, f"Loading lora {name} failed: No adapter found for {path} ({why})",
                    param="lora_path")
