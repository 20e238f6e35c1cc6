"""``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (and its
``/input_tokens``), ``/v1/messages`` (and its ``/count_tokens``), ``/v1/embeddings``,
``/v1/models`` and ``/v1/models/{id}``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tpserve.model.sampling_params import SamplingParams, ThinkingBudget
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.http.access_log import access_record
from tpserve.server.http.beam_search import beam_search, check_beam_search
from tpserve.server.http.echo import Echo, plan_echo
from tpserve.server.http.embeddings import EmbeddingRequest, EmbeddingResponse, create_embeddings
from tpserve.server.http.engine_client import data_parallel_rank
from tpserve.server.http.generation import engine_outputs, tracked, unless_disconnected
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.lora_names import ServedAdapter
from tpserve.server.http.messages.answer import message_events, whole_message
from tpserve.server.http.messages.request import PASSED_THROUGH as MESSAGES_PASSED_THROUGH
from tpserve.server.http.messages.request import CountTokensRequest, MessagesRequest, messages_error
from tpserve.server.http.messages.request import chat_request as messages_chat_request
from tpserve.server.http.metrics import RequestTracker
from tpserve.server.http.multi_prompt import merged_outputs
from tpserve.server.http.openai_format import (
    OutputAccumulator,
    ResponseContext,
    chat_response,
    completion_response,
    tokens_named_by_id,
)
from tpserve.server.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from tpserve.server.http.reasoning import ReasoningPlan
from tpserve.server.http.replies import (
    ANTHROPIC_ERROR_RESPONSES,
    ERROR_RESPONSES,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from tpserve.server.http.request_log import log_request
from tpserve.server.http.request_params import (
    bad_words_token_ids,
    build_sampling_params,
    chosen_logprob_tokens,
    truncated_prompt,
)
from tpserve.server.http.responses.events import response_events
from tpserve.server.http.responses.output import whole_response
from tpserve.server.http.responses.request import (
    PASSED_THROUGH,
    ResponsesRequest,
    chat_request,
    echo_fields,
    input_items,
    responses_error,
)
from tpserve.server.http.state import ServerState, get_state
from tpserve.server.http.stream_interval import batched
from tpserve.server.http.streaming import SSEResponse, chat_events, completion_events
from tpserve.server.http.structured import allowed_token_ids, logit_bias, structured_output
from tpserve.server.http.tools import ToolPlan, plan_tools, template_tools
from tpserve.server.http.unsupported import refuse_unsupported, warn_unknown_fields

STREAM_RESPONSE: dict[int | str, dict] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@dataclass(frozen=True)
class Answer:
    """How an endpoint answers: its stream of server-sent events, or its whole body."""

    events: Callable[[RequestOutput, AsyncIterator[RequestOutput], ResponseContext],
                     AsyncIterator[bytes]]
    whole: Callable[[OutputAccumulator, ResponseContext], dict[str, Any]]


CHAT = Answer(chat_events, lambda acc, ctx: chat_response(acc, ctx).model_dump())
COMPLETIONS = Answer(completion_events,
                     lambda acc, ctx: completion_response(acc, ctx).model_dump())


def _messages_answer(stop_sequences: list[str] | None) -> Answer:
    """Anthropic's Messages answer; ``stop_sequences`` name a stop's ``stop_sequence``."""
    return Answer(lambda first, outputs, ctx: message_events(first, outputs, ctx,
                                                             stop_sequences),
                  lambda acc, ctx: whole_message(chat_response(acc, ctx), ctx,
                                                 stop_sequences))


def _responses_answer(echo: dict[str, Any],
                      keep: Callable[[dict[str, Any]], None] | None = None) -> Answer:
    """The Responses API's answer; ``echo``: what it repeats of its request; ``keep``
    takes the whole response once it is made (the response store)."""
    def whole(acc: OutputAccumulator, ctx: ResponseContext) -> dict[str, Any]:
        response = whole_response(chat_response(acc, ctx), ctx, echo)
        if keep is not None:
            keep(response)
        return response

    return Answer(lambda first, outputs, ctx: response_events(first, outputs, ctx, echo,
                                                              keep), whole)


async def _collect(first: RequestOutput, rest: AsyncIterator[RequestOutput], n: int
                   ) -> OutputAccumulator:
    acc = OutputAccumulator(n)
    acc.add(first)
    async for out in rest:
        acc.add(out)
    return acc


async def _checked_constraints(state: ServerState, body: SamplingRequest) -> dict[str, Any]:
    """Refuses fields the server cannot honour, logs unknown ones, and returns the
    request's validated ``logit_bias``, ``allowed_token_ids``, ``logprob_token_ids``, bad
    words (tokenized) and structured-output constraint (400s on error)."""
    refuse_unsupported(body, state.priority_scheduling)
    warn_unknown_fields(body, state.warned_fields)
    return {"logit_bias": logit_bias(body, state.engine.vocab_size),
            "allowed_token_ids": allowed_token_ids(body, state.engine.vocab_size),
            "logprob_token_ids": chosen_logprob_tokens(body, state.engine.vocab_size),
            "bad_words_token_ids": await bad_words_token_ids(body.bad_words, state.prompts),
            "structured": structured_output(body)}


def _thinking(body: SamplingRequest, plan: ReasoningPlan | None) -> ThinkingBudget | None:
    """The request's ``thinking_token_budget`` on the output ``plan`` splits (None: the
    server has no ``--reasoning-parser``, and a budget is a 400: nothing says where the
    thinking ends)."""
    if body.thinking_token_budget is None:
        return None
    if plan is None:
        raise APIError.bad_request("thinking_token_budget needs a reasoning model: this "
                                   "server was started without --reasoning-parser",
                                   "thinking_token_budget")
    return plan.budget(body.thinking_token_budget)


def _with_tools(plan: ToolPlan | None, constraints: dict[str, Any]) -> None:
    """Puts a tool plan's constraint (``required``, a named function) into ``constraints``
    (400 if the request sets another)."""
    if plan is None or plan.structured is None:
        return
    if constraints["structured"] is not None:
        raise APIError.bad_request(
            "tool_choice 'required' or a named function cannot be combined with "
            "another structured-output constraint", "tool_choice")
    constraints["structured"] = plan.structured


def _base_card(state: ServerState, name: str) -> ModelCard:
    """The base model's entry in /v1/models under ``name``, listed or retrieved alike."""
    return ModelCard(id=name, created=state.created, root=state.engine.model_name,
                     max_model_len=state.engine.max_model_len,
                     default_sampling_params=state.default_sampling_params)


def _adapter_card(state: ServerState, adapter: ServedAdapter) -> ModelCard:
    """A LoRA adapter's entry in /v1/models, as vLLM lists one: its folder as ``root``, the
    base model as ``parent``."""
    return ModelCard(id=adapter.name, created=state.created, root=adapter.path,
                     parent=adapter.parent or state.served_model_names[0],
                     max_model_len=state.engine.max_model_len,
                     default_sampling_params=state.default_sampling_params)


async def _serve(request: Request, state: ServerState, body: SamplingRequest, prefix: str,
                 prompts: list[tuple[list[int], SamplingParams]], model: str,
                 tracker: RequestTracker, tools: ToolPlan | None = None,
                 echo: Echo | None = None, chat_echo: str | None = None,
                 reasoning: ReasoningPlan | None = None, answer: Answer | None = None,
                 role: str = "assistant", prompt_text: str | None = None) -> Response:
    """Runs the request (one engine request per prompt, or a beam search of each:
    ``http/beam_search.py``) and answers it, streamed or whole: as its endpoint does, or
    as ``answer`` says."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"  # the engine's: unique
    check_beam_search(body, prompts[0][1], state.max_logprobs)  # the same for every prompt
    rank = data_parallel_rank(request.headers)  # vLLM's X-data-parallel-rank: that replica
    engine = state.engine if rank is None else state.engine.at_rank(rank)
    adapter = state.adapter(model)
    if adapter is not None:  # the adapter the request named
        prompts = [(ids, replace(p, lora_slot=adapter.slot, lora_id=adapter.lora_id))
                   for ids, p in prompts]
    params = prompts[0][1]
    # OpenAI's response ids and Anthropic's message ids are resp_... and msg_... (vLLM's
    # too); completions' are cmpl-... and chatcmpl-...
    # named as vLLM names completions: the X-Request-Id header, else the body's
    # request_id, else the engine's (a uuid; the engine's own id stays unique either way).
    # Not a stored response's: a header a gateway repeats would name two of them alike
    sep = "_" if prefix in ("resp", "msg") else "-"
    header = request.headers.get("x-request-id") if sep == "-" else None
    given = header or body.request_id
    answer_id = f"{prefix}{sep}{given or request_id.partition('-')[2]}"
    usage = body.include_usage or state.frontend.force_include_usage  # a stream's last chunk
    ctx = ResponseContext(id=answer_id, created=int(time.time()), model=model,
                          n=params.n * len(prompts), logprobs=params.logprobs is not None,
                          include_usage=usage,
                          continuous_usage=usage and bool(
                              body.stream_options
                              and body.stream_options.continuous_usage_stats),
                          tools=tools if tools is not None and tools.parses_output else None,
                          reasoning=reasoning,
                          echo=echo, prompt_logprobs=body.prompt_logprobs,
                          chat_echo=chat_echo,
                          prompt_ids=tuple(ids for ids, _ in prompts)
                          if body.return_token_ids else None, per_prompt=params.n,
                          role=role, prompt_text=prompt_text)
    record = access_record(request)
    counted = record
    if echo is not None and echo.only:  # the prompt alone: its one sampled token is dropped
        record.prompt_tokens = sum(len(ids) for ids, _ in prompts)
        record.completion_tokens, counted = 0, None
    def run(rid: str, ids: list[int], p: SamplingParams, track: RequestTracker
            ) -> AsyncIterator[RequestOutput]:
        log = state.frontend.request_log
        if body.use_beam_search:
            searched = beam_search(engine, rid, ids, p, body.length_penalty)
            return tracked(searched, rid, track, counted,
                           log_request(log, rid, ids, p, state.engine.tokenizer))
        return engine_outputs(engine, rid, ids, p, track, counted, log)

    if len(prompts) == 1:
        outputs = run(request_id, prompts[0][0], params, tracker)
    else:
        outputs = merged_outputs(request_id, [
            run(f"{request_id}-{k}", ids, p, tracker if k == 0 else state.metrics.track())
            for k, (ids, p) in enumerate(prompts)], params.n)
    if body.return_tokens_as_token_ids:
        outputs = tokens_named_by_id(outputs)
    interval = max(body.stream_interval or 1, state.frontend.stream_interval)
    if body.stream and interval > 1:
        outputs = batched(outputs, interval)
    handed_over = False
    try:
        # The first output is awaited before answering, so that errors raised on submission
        # (overload, shutdown, dead engine) get their HTTP status even when streaming.
        first = await unless_disconnected(request, anext(outputs))
        if answer is None:
            answer = CHAT if isinstance(body, ChatCompletionRequest) else COMPLETIONS
        if body.stream:
            handed_over = True
            return SSEResponse(answer.events(first, outputs, ctx))
        acc = await unless_disconnected(request, _collect(first, outputs, ctx.n))
        return JSONResponse(answer.whole(acc, ctx))
    finally:
        if not handed_over:
            await outputs.aclose()


def make_openai_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    @router.get("/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models(request: Request) -> ModelList:
        state = get_state(request)
        return ModelList(data=[_base_card(state, name) for name in state.served_model_names] + [
            _adapter_card(state, m) for m in state.loras.adapters.values()])

    @router.get("/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def retrieve_model(model_id: str, request: Request) -> ModelCard:
        state = get_state(request)
        adapter = state.adapter(model_id)
        if adapter is not None:
            return _adapter_card(state, adapter)
        if not state.serves_base(model_id):
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return _base_card(state, model_id)

    @router.post("/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        """OpenAI's embeddings, on a --runner pooling server (http/embeddings.py)."""
        return await create_embeddings(body, request, get_state(request))

    @router.post("/completions", response_model=CompletionResponse,
                 responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        state = get_state(request)
        tracker = state.metrics.track()  # latencies count from here
        model = state.resolve_model(body.model)
        state.check_generative()
        body = _with_server_defaults(state, body)
        constraints = await _checked_constraints(state, body)
        state.check_available()
        prompt_ids = [truncated_prompt(ids, body.truncate_prompt_tokens,
                                       state.engine.max_model_len, body.truncation_side)
                      for ids in await state.prompts.completion_prompts(
                          body.prompt, body.add_special_tokens)]
        # a completion is never split: its prompt is planned only for a thinking budget
        parser = state.reasoning_parser if body.thinking_token_budget is not None else None
        prompts = [(ids, build_sampling_params(
            body, len(ids), state.engine.max_model_len, state.default_sampling_params,
            {**constraints, "thinking": _thinking(
                body, None if parser is None else parser.plan(ids))}, state.max_logprobs))
                   for ids in prompt_ids]
        echo = await plan_echo(body, prompt_ids, state.prompts, prompts[0][1].n)
        return await _serve(request, state, body, "cmpl", prompts, model, tracker, echo=echo)

    @router.post("/chat/completions", response_model=ChatCompletionResponse,
                 responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        state = get_state(request)
        tracker = state.metrics.track()
        model = state.resolve_model(body.model)
        return await _chat(request, state, body, tracker, model)

    @router.post("/responses", responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, answered by the chat machinery; kept, and continued by
        ``previous_response_id``, where the server stores responses (responses/store.py)."""
        state = get_state(request)
        tracker = state.metrics.track()
        model = state.resolve_model(body.model)
        warn_unknown_fields(body, state.warned_fields, known=PASSED_THROUGH)
        store, previous = state.responses, _previous_conversation(state, body)
        own, keep = input_items(body), None
        if store is not None and body.store is not False:
            keep = partial(store.put, inputs=[*previous, *own])
        try:
            return await _chat(request, state, chat_request(body, previous, own), tracker,
                               model, "resp",
                               _responses_answer(echo_fields(body, keep is not None,
                                                              state.default_sampling_params),
                                                  keep))
        except APIError as exc:
            raise responses_error(exc) from None

    @router.post("/messages", responses={**ANTHROPIC_ERROR_RESPONSES, **STREAM_RESPONSE},
                 tags=["anthropic"])
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API, answered by the chat machinery (messages/)."""
        state = get_state(request)
        tracker = state.metrics.track()
        model = state.resolve_model(body.model)
        warn_unknown_fields(body, state.warned_fields, known=MESSAGES_PASSED_THROUGH)
        chat = messages_chat_request(body, state.reasoning_parser is not None)
        try:
            return await _chat(request, state, chat, tracker, model, "msg",
                               _messages_answer(body.stop_sequences))
        except APIError as exc:
            raise messages_error(exc) from None

    @router.post("/messages/count_tokens", responses=ANTHROPIC_ERROR_RESPONSES,
                 tags=["anthropic"])
    async def count_message_tokens(body: CountTokensRequest, request: Request
                                   ) -> dict[str, int]:
        """Anthropic's token count: the prompt /v1/messages would read for ``body``."""
        state = get_state(request)
        state.resolve_model(body.model)
        warn_unknown_fields(body, state.warned_fields, known=MESSAGES_PASSED_THROUGH)
        chat = messages_chat_request(body, state.reasoning_parser is not None)
        return {"input_tokens": await _count_prompt(state, chat)}

    @router.post("/responses/input_tokens", responses=ERROR_RESPONSES)
    async def count_response_input_tokens(body: ResponsesRequest, request: Request
                                          ) -> dict[str, Any]:
        """OpenAI's input token count: the prompt /v1/responses would read for ``body``."""
        state = get_state(request)
        state.resolve_model(body.model)
        warn_unknown_fields(body, state.warned_fields, known=PASSED_THROUGH)
        previous = _previous_conversation(state, body)
        try:
            count = await _count_prompt(state, chat_request(body, previous))
        except APIError as exc:
            raise responses_error(exc) from None
        return {"object": "response.input_tokens", "input_tokens": count}

    return router


def _previous_conversation(state: ServerState, body: ResponsesRequest) -> list[Any]:
    """The stored conversation ``previous_response_id`` continues ([] without one): a 400
    where the server keeps no responses, a 404 for an id it does not hold."""
    if body.previous_response_id is None:
        return []
    if state.responses is None:
        raise APIError.bad_request("previous_response_id needs stored responses: this "
                                   "server keeps none (--responses-store-size)",
                                   "previous_response_id")
    return state.responses.get(body.previous_response_id, "previous_response_id").conversation


async def _chat_prompt(state: ServerState, body: ChatCompletionRequest,
                       tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
    """The prompt of a chat request as the chat template wrote it, its tools (``tools``)
    shown to the template, and its token ids before any truncation."""
    return await state.prompts.chat_prompt(body.messages, body,
                                           add_special_tokens=body.add_special_tokens,
                                           tools=tools)


_Body = TypeVar("_Body", bound=SamplingRequest)


def _shown_tools(state: ServerState, body: ChatCompletionRequest,
                 tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools the chat template is shown: none for ``tool_choice: none`` under
    ``--exclude-tools-when-tool-choice-none``."""
    if state.frontend.exclude_tools_when_tool_choice_none and body.tool_choice == "none":
        return None
    return tools


def _with_server_defaults(state: ServerState, body: _Body) -> _Body:
    """``body`` with the server's defaults for fields it leaves unset
    (``--return-tokens-as-token-ids``)."""
    if body.return_tokens_as_token_ids is None and state.frontend.return_tokens_as_token_ids:
        return body.model_copy(update={"return_tokens_as_token_ids": True})
    return body


async def _count_prompt(state: ServerState, body: ChatCompletionRequest) -> int:
    """The length of the prompt ``_chat`` would build for ``body``: its tools are shown to
    the template whatever the tool choice (unless ``_shown_tools`` hides them), and need
    no tool-call parser to be counted."""
    state.check_generative()
    shown = _shown_tools(state, body, template_tools(body))
    return len((await _chat_prompt(state, body, shown))[1])


async def _chat(request: Request, state: ServerState, body: ChatCompletionRequest,
                tracker: RequestTracker, model: str, prefix: str = "chatcmpl",
                answer: Answer | None = None) -> Response:
    """Answers a chat request (or the chat request of another endpoint, ``answer``):
    its constraints, tools and reasoning plan, its prompt and sampling parameters."""
    state.check_generative()
    body = _with_server_defaults(state, body)
    constraints = await _checked_constraints(state, body)
    tools = plan_tools(body, state.auto_tool_parser)
    _with_tools(tools, constraints)
    parsers = (tools.parser if tools is not None else None, state.reasoning_parser)
    if any(p is not None and p.needs_special_tokens for p in parsers):
        body = body.model_copy(update={"skip_special_tokens": False})  # keep their tags
    state.check_available()
    prompt_text, prompt_ids = await _chat_prompt(state, body, _shown_tools(
        state, body, tools.template_tools if tools is not None else None))
    prompt_ids = truncated_prompt(prompt_ids, body.truncate_prompt_tokens,
                                  state.engine.max_model_len, body.truncation_side)
    reasoning = None
    if state.reasoning_parser is not None:
        reasoning = state.reasoning_parser.plan(prompt_ids, body.include_reasoning)
    constraints["thinking"] = _thinking(body, reasoning)
    if reasoning is not None:
        if constraints["structured"] is not None and reasoning.grammar_after is not None:
            # the grammar (or the forced tool call) constrains the answer only
            constraints["structured_after"] = reasoning.grammar_after
            constraints["structured_after_if_first"] = reasoning.grammar_after_if_first
    params = build_sampling_params(body, len(prompt_ids), state.engine.max_model_len,
                                   state.default_sampling_params, constraints,
                                   state.max_logprobs)
    last = body.messages[-1]
    # as vLLM: without a generation prompt the answer continues the last message's turn,
    # and echo repeats the last message where its role is the answer's
    role = state.response_role if body.add_generation_prompt else last.role
    echo = last.text() if body.echo and last.role == role else None
    return await _serve(request, state, body, prefix, [(prompt_ids, params)], model,
                        tracker, tools, chat_echo=echo, reasoning=reasoning, answer=answer,
                        role=role, prompt_text=prompt_text if body.return_prompt_text else None)
