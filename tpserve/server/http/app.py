"""The FastAPI application: OpenAI-compatible routes over an ``EngineClient``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import tpserve
from tpserve.model.lora.adapter import LoraModule
from tpserve.model.pooling import PoolerConfig
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.http.access_log import AccessLogMiddleware
from tpserve.server.http.control_routes import CONTROL_PATHS, make_control_router
from tpserve.server.http.cors import CorsConfig
from tpserve.server.http.engine_client import EngineClient
from tpserve.server.http.frontend import FrontendOptions, LoadMiddleware, RequestIdMiddleware
from tpserve.server.http.http_errors import install_exception_handlers
from tpserve.server.http.invocations import InvocationsMiddleware, make_invocations_router
from tpserve.server.http.lora import make_lora_router
from tpserve.server.http.lora_names import LoraNames
from tpserve.server.http.metrics import ServerMetrics
from tpserve.server.http.middleware import ApiKeyMiddleware, BodyLimitMiddleware, CatchAllMiddleware
from tpserve.server.http.prompts import PromptProcessor
from tpserve.server.http.reasoning import REASONING_PARSERS
from tpserve.server.http.responses.store import ResponseStore
from tpserve.server.http.responses.stored_routes import make_stored_responses_router
from tpserve.server.http.routes_extra import make_extra_router
from tpserve.server.http.routes_openai import make_openai_router
from tpserve.server.http.scores import make_scores_router
from tpserve.server.http.state import ServerState
from tpserve.server.http.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20


def needs_api_key(path: str) -> bool:
    """The paths ``--api-key`` protects; /health, /ping, /metrics, /memory, /version and
    docs stay open. /memory/snapshot is protected: it holds the server's source paths and stacks and
    costs the engine thread time."""
    return path == "/v1" or path.startswith(("/v1/", "/v2/")) or path in (
        "/tokenize", "/detokenize", "/memory/snapshot", "/score", "/rerank", "/invocations",
        "/classify", *CONTROL_PATHS)


def build_app(engine: EngineClient, *, served_model_names: tuple[str, ...],
              unlisted_model_names: tuple[str, ...] = (),
              api_key: str | tuple[str, ...] | None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              default_sampling_params: Mapping[str, float | int] | None = None,
              log_requests: bool = False, chat_template: str | None = None,
              auto_tool_parser: str | None = None,
              reasoning_parser: str | None = None,
              priority_scheduling: bool = False, cors: CorsConfig | None = None,
              response_role: str = "assistant",
              max_logprobs: int = SamplingParams.MAX_LOGPROBS,
              root_path: str | None = None, docs: bool = True,
              pooler: PoolerConfig | None = None,
              lora_modules: tuple[LoraModule, ...] = (),
              download_dir: str | None = None,
              metrics_namespace: str = "tpserve",
              frontend: FrontendOptions | None = None) -> FastAPI:
    """The HTTP app for ``engine``; ``served_model_names[0]`` answers requests naming no model;
    ``unlisted_model_names`` name the base model too, unlisted by ``/v1/models``.
    ``default_sampling_params`` fill the sampling fields a request omits; ``log_requests``
    writes one access-log line per request; ``chat_template`` (Jinja) replaces the
    tokenizer's; ``auto_tool_parser`` (a ``TOOL_PARSERS`` name) enables ``tool_choice``
    ``auto`` with that parser; ``reasoning_parser`` (a ``REASONING_PARSERS`` name) splits
    chat answers into reasoning and content; ``priority_scheduling`` accepts requests'
    ``priority`` (the engine runs ``--scheduling-policy priority``); ``cors`` answers
    browsers' cross-origin requests (preflights too, before the API-key check).
    ``response_role`` is the role of chat answers to requests with
    ``add_generation_prompt``; ``max_logprobs`` the most logprobs a request may ask;
    ``root_path`` FastAPI's (routes answer with and without the prefix); ``docs`` false
    drops /openapi.json, /docs and /redoc; ``pooler`` (``--runner pooling``): the engine
    pools, and the app answers /v1/embeddings instead of completions and chat;
    ``lora_modules``: the LoRA adapters served (slot i: ``lora_modules[i]``), each a model
    name a request may choose; ``download_dir``: the Hugging Face cache runtime LoRA loads
    by repository id fetch into; ``metrics_namespace``: /metrics' prefix (``tpserve`` or
    ``vllm``); ``frontend``: vLLM's frontend flags (``http/frontend.py``)."""
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpserve-tokenizer")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            executor.shutdown(wait=False, cancel_futures=True)

    no_docs = {} if docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="tpserve", version=tpserve.__version__, lifespan=lifespan,
                  description="Tensor-parallel, OpenAI-compatible LLM inference server",
                  **no_docs)
    if root_path:  # as vLLM sets it (FastAPI's constructor argument is deprecated)
        app.root_path = root_path
    loras = LoraNames(tuple(lora_modules))
    frontend = frontend or FrontendOptions()
    state = app.state.tpserve = ServerState(
        engine=engine,
        served_model_names=tuple(served_model_names),
        unlisted_model_names=tuple(unlisted_model_names),
        prompts=PromptProcessor(engine.tokenizer, executor, chat_template,
                                frontend.template_kwargs,
                                frontend.chat_template_content_format,
                                frontend.trust_request_chat_template),
        metrics=ServerMetrics(engine.stats, engine.model_name, loras.names_by_id,
                              metrics_namespace, engine.max_model_len,
                              len(getattr(engine, "engines", ())) or 1),
        created=int(time.time()),
        default_sampling_params=dict(default_sampling_params or {}),
        auto_tool_parser=(TOOL_PARSERS[auto_tool_parser]() if auto_tool_parser is not None
                          else None),
        reasoning_parser=(REASONING_PARSERS[reasoning_parser](engine.tokenizer)
                          if reasoning_parser is not None else None),
        priority_scheduling=priority_scheduling,
        response_role=response_role,
        max_logprobs=max_logprobs,
        pooler=pooler,
        loras=loras,
        download_dir=download_dir,
        frontend=frontend,
        responses=(ResponseStore(frontend.responses_store_size)
                   if frontend.responses_store_size else None),
    )
    install_exception_handlers(app)
    app.include_router(make_openai_router())
    app.include_router(make_stored_responses_router())
    app.include_router(make_extra_router())
    app.include_router(make_scores_router())
    app.include_router(make_lora_router())
    app.include_router(make_invocations_router())
    if frontend.control_endpoints:  # --enable-sleep-mode
        app.include_router(make_control_router())
    # Added last = outermost: CatchAll wraps the API-key check, which wraps the body limit,
    # which wraps /invocations' re-routing (its body read inside the limit).
    # inside /invocations' re-routing: a request is counted under the route that serves it
    app.add_middleware(LoadMiddleware, counter=state.load)
    app.add_middleware(InvocationsMiddleware, pooler=pooler)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, protected=needs_api_key)
    app.add_middleware(CatchAllMiddleware)
    if cors is not None:  # outside the key check: a preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods),
                           allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
    if frontend.request_id_headers:  # every answer, errors and 401s included
        app.add_middleware(RequestIdMiddleware)
    if log_requests:  # outermost: it sees the status CatchAll answers with
        app.add_middleware(AccessLogMiddleware)
    return app
