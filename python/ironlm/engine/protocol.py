"""The engine's contracts, written down: what the servers rely on, and what the async engine drives.

- `EngineClient`: everything server/ (HTTP and gRPC) uses of the async engine. AsyncLLMEngine implements it;
  a server should need nothing else.
- `StepEngine`: the single-threaded engine AsyncLLMEngine drives from its thread. LLMEngine implements it
  (and so does the test suite's fake engine).
- `OutputObserver`: the hook the server's metrics use to see every step's outputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm import _core
    from ironlm.engine.outputs import RequestOutput
    from ironlm.engine.prompts import PromptType
    from ironlm.engine.request_stream import RequestStream
    from ironlm.model.config import ModelConfig
    from ironlm.sampling_params import SamplingParams


class OutputObserver(Protocol):
    """Called on the engine thread; must be cheap and must not raise (errors are logged)."""

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_aborted(self, request_ids: list[str]) -> None: ...


@runtime_checkable
class StepEngine(Protocol):
    """One model, one caller thread: add requests, `step()` until none is unfinished."""

    # What the engine loaded, fixed for its life (AsyncLLMEngine copies these once).
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    max_model_len: int

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None, *,
                    priority: int = 0, deadline: float | None = None, queue_timeout: float | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    grammar: _core.CompiledGrammar | None = None, tenant: str | None = None) -> str:
        """Queue a request (raises ValueError / QueueFullError and the like on bad input); returns its id.
        `tenant`: who it is served for (fair-share scheduling)."""
        ...

    def abort_request(self, request_id: str | Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One scheduler step; the cumulative output of every request it touched (finished ones last time)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]: ...


@runtime_checkable
class EngineClient(Protocol):
    """The async engine as the servers see it. Every member may be used from the server's event loop."""

    observer: OutputObserver | None  # set once by the server before it serves (metrics)
    stall_timeout_s: float  # a step running longer makes /health report the engine stalled

    # ---- the model (fixed for the engine's life)
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    max_model_len: int
    model_config: ModelConfig | None
    device: Any  # a torch.device or its name: where /health reads device memory

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        ...

    # ---- health and load
    @property
    def is_healthy(self) -> bool: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def stalled_for(self) -> float | None: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    @property
    def num_inflight(self) -> int: ...

    def stats(self) -> dict[str, Any]:
        """LLMEngine.stats() as of the last step (see the keys there)."""
        ...

    # ---- requests
    async def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                          **kwargs: Any) -> RequestStream:
        """Returns once the engine accepted the request; raises what StepEngine.add_request raises,
        EngineDeadError, or EngineOverloadedError while draining."""
        ...

    async def add_requests(self, request_ids: Sequence[str | None], prompts: Sequence[PromptType],
                           params: SamplingParams | None = None, **kwargs: Any) -> list[RequestStream]:
        """One request per prompt, admitted all or none, in order; raises as `add_request`."""
        ...

    def abort(self, request_id: str | Iterable[str]) -> None: ...

    # ---- lifecycle
    def begin_drain(self) -> None: ...

    async def shutdown(self, drain_timeout: float = 30.0) -> None: ...
