"""vLLM's frontend flags: server-wide choices about how requests are read and answered
(``FrontendOptions``), the ``X-Request-Id`` header, and the server-load count.

``--default-chat-template-kwargs`` (template variables every chat request gets, under its
own ``chat_template_kwargs``), ``--chat-template-content-format`` (message content given
to the template as a string, or as OpenAI's list of text parts; ``auto``: the parts for a
template that loops over a message's content, ``prompts.content_format``),
``--trust-request-chat-template`` (a request's own ``chat_template`` is rendered; without
it, refused with 400), ``--enable-force-include-usage`` (a streamed answer ends with its usage as if ``stream_options.include_usage`` were
set), ``--return-tokens-as-token-ids`` (the default of the request field),
``--exclude-tools-when-tool-choice-none`` (``tool_choice: none`` hides the tools from the
template too), ``--enable-request-id-headers`` (every response carries
``X-Request-Id``: the request's own, else a new one) and ``--stream-interval`` (the least
a request's ``stream_interval`` is: ``stream_interval.py``), ``--enable-log-requests``,
``--enable-log-outputs`` and ``--max-log-len`` (``request_log.py``). ``GET /load`` (vLLM's
``--enable-server-load-tracking``, always on here) counts the requests in flight."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpserve.server.http.http_errors import route_path
from tpserve.server.http.prompts import RESERVED_TEMPLATE_KWARGS
from tpserve.server.http.request_log import RequestLog

CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass(frozen=True, kw_only=True)
class FrontendOptions:
    """See the module docstring; every default is vLLM's."""

    # a mapping when given; kept as (name, value) pairs (the config is pickled to the
    # engine process and the ranks, which a mapping proxy cannot be)
    default_chat_template_kwargs: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()
    # auto: openai for a template that loops over a message's content, else string
    chat_template_content_format: str = "auto"
    # a request's chat_template rendered (else refused: templates are code the tokenizer
    # thread runs, unbounded)
    trust_request_chat_template: bool = False
    force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    request_id_headers: bool = False
    stream_interval: int = 1  # a stream's chunks: at least this many new tokens
    # --enable-log-requests / --enable-log-outputs / --max-log-len (request_log.py)
    request_log: RequestLog = RequestLog()
    # --responses-store-size: the last this many Responses answers kept (0: none;
    # responses/store.py)
    responses_store_size: int = 0
    # --enable-sleep-mode: /sleep, /wake_up, /pause, ... (control_routes.py)
    control_endpoints: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "default_chat_template_kwargs",
                           tuple(dict(self.default_chat_template_kwargs).items()))
        taken = sorted(set(self.template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"--default-chat-template-kwargs cannot set {', '.join(taken)}: "
                             "they are arguments of the template call itself")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0, got "
                             f"{self.responses_store_size}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"--chat-template-content-format must be one of "
                             f"{', '.join(CONTENT_FORMATS)}, got "
                             f"{self.chat_template_content_format!r}")

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """``--default-chat-template-kwargs`` as a new mapping."""
        return dict(self.default_chat_template_kwargs)


class RequestIdMiddleware:
    """Adds ``X-Request-Id`` to every HTTP response: the request's own header, else a new
    random id (vLLM's ``--enable-request-id-headers``)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers") or () if k == b"x-request-id"), None)
        rid = given if given else uuid.uuid4().hex.encode()

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, with_id)


class LoadCounter:
    """Requests in flight on the routes that run the model (vLLM's server load: ``GET
    /load``), counted from the request's arrival to its last byte sent (a stream's
    included). Touched only on the event loop."""

    COUNTED = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
               "/v1/messages", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
               "/classify")

    def __init__(self) -> None:
        self.in_flight = 0


class LoadMiddleware:
    """Counts the requests ``LoadCounter.COUNTED`` names while they are served (inside
    ``/invocations``' re-routing: counted under the route that serves them)."""

    def __init__(self, app: ASGIApp, *, counter: LoadCounter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in LoadCounter.COUNTED:
            return await self.app(scope, receive, send)
        self.counter.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.in_flight -= 1
