"""What the routes of one app share: the engine, model names, prompt processor, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from tpserve.model.pooling import PoolerConfig
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.errors import EngineDeadError, EngineShuttingDownError
from tpserve.server.http.engine_client import EngineClient
from tpserve.server.http.frontend import FrontendOptions, LoadCounter
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.lora_names import LoraNames, ServedAdapter
from tpserve.server.http.metrics import ServerMetrics
from tpserve.server.http.prompts import PromptProcessor
from tpserve.server.http.reasoning import ReasoningParser
from tpserve.server.http.responses.store import ResponseStore
from tpserve.server.http.tool_parsers import ToolParser


@dataclass
class ServerState:
    engine: EngineClient
    served_model_names: tuple[str, ...]
    prompts: PromptProcessor
    metrics: ServerMetrics
    created: int
    # names a request may use that /v1/models does not list (a model path as given)
    unlisted_model_names: tuple[str, ...] = ()
    # the model's sampling defaults for fields a request omits (--generation-config)
    default_sampling_params: dict[str, float | int] = field(default_factory=dict)
    warned_fields: set[str] = field(default_factory=set)  # unknown request fields logged
    # --tool-call-parser when --enable-auto-tool-choice is set (tool_choice auto), else None
    auto_tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    priority_scheduling: bool = False  # --scheduling-policy priority: requests' priority
    response_role: str = "assistant"  # --response-role: chat answers' role
    # --max-logprobs: the most logprobs / top_logprobs / prompt_logprobs a request may ask
    max_logprobs: int = SamplingParams.MAX_LOGPROBS
    # --runner pooling: how embeddings are pooled (the server answers /v1/embeddings only);
    # None: a generative server
    pooler: PoolerConfig | None = None
    # the LoRA adapters served beside the base model (--lora-modules, then runtime loads)
    loras: LoraNames = field(default_factory=LoraNames)
    # --download-dir: where /v1/load_lora_adapter fetches an adapter named by repository id
    download_dir: str | None = None
    frontend: FrontendOptions = field(default_factory=FrontendOptions)  # vLLM's frontend flags
    load: LoadCounter = field(default_factory=LoadCounter)  # GET /load
    # --responses-store-size: the Responses API's stored responses (None: none kept)
    responses: ResponseStore | None = None

    def adapter(self, model: str) -> ServedAdapter | None:
        """The LoRA adapter served as ``model``; None for the base model."""
        return self.loras.get(model)

    def serves_base(self, name: str) -> bool:
        """Whether ``name`` names the base model (listed or not)."""
        return name in self.served_model_names or name in self.unlisted_model_names

    def resolve_model(self, requested: str | None) -> str:
        """The served name to answer with (the base model's or an adapter's); 404 for a
        model this server does not serve."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if self.serves_base(requested) or self.adapter(requested) is not None:
            return requested
        raise APIError(404, f"The model `{requested}` does not exist.", param="model",
                       code="model_not_found")

    def check_generative(self) -> None:
        """400 for a completions, chat or Responses request to an embedding server."""
        if self.pooler is not None and self.pooler.classifies:
            raise APIError.bad_request(
                "this server runs a sequence classifier (--runner pooling): it answers "
                "/classify, /score and /rerank only, not completions or chat", "model")
        if self.pooler is not None:
            raise APIError.bad_request(
                "this server runs an embedding model (--runner pooling): it answers "
                "/v1/embeddings only, not completions or chat", "model")

    def check_available(self) -> None:
        """503 before doing any work when the engine is dead or draining."""
        if self.engine.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self.engine.dead_reason}")
        if not self.engine.accepting:
            raise EngineShuttingDownError("server is shutting down")


def get_state(request: Request) -> ServerState:
    return request.app.state.tpserve
