"""The engine's node of the config tree: rank 0's step loop, its front and its process."""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.model.sampling_params import LOGPROBS_MODES, check_logprobs_mode
from tpserve.server.engine.speculative import SpeculativeConfig


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    served_model_name: str | None = None
    check_integrity: bool = False
    max_num_queued_requests: int = 1024
    max_num_queued_tokens: int = 1 << 20
    async_scheduling: bool = True
    engine_process: bool = True
    # --speculative-config (None: off); steps are synchronous while it drafts
    speculative: SpeculativeConfig | None = None
    # --logprobs-mode: what logprobs report where a request names no mode (sampler.py)
    logprobs_mode: str = LOGPROBS_MODES[0]
    # --enable-sleep-mode: /sleep, /wake_up, /pause, /resume (pause.py, control.py)
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        check_logprobs_mode(self.logprobs_mode, "--logprobs-mode")
        if self.max_num_queued_requests < 0 or self.max_num_queued_tokens < 0:
            raise ValueError("--max-num-queued-requests/--max-num-queued-tokens must be >= 0")
