"""The engine: the step (LLMEngine), the model runner, and the thread + asyncio bridge (AsyncLLMEngine).

Imports flow one way: async_engine -> request_stream -> outputs; llm_engine -> model_runner -> kv_cache.
LLMEngine and ModelRunner load lazily, so importing this package (and `ironlm`) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ironlm.engine.async_engine import AsyncLLMEngine
from ironlm.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ironlm.engine.prompts import PromptType
from ironlm.engine.protocol import EngineClient, OutputObserver, StepEngine
from ironlm.engine.request_stream import RequestStream

if TYPE_CHECKING:
    from ironlm.engine.llm_engine import LLMEngine
    from ironlm.engine.model_runner import ModelRunner

__all__ = [
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineClient",
    "LLMEngine",
    "Logprob",
    "ModelRunner",
    "OutputObserver",
    "PromptType",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "StepEngine",
]


def __getattr__(name: str) -> object:
    if name == "LLMEngine":
        from ironlm.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "ModelRunner":
        from ironlm.engine.model_runner import ModelRunner

        return ModelRunner
    raise AttributeError(f"module 'ironlm.engine' has no attribute {name!r}")
