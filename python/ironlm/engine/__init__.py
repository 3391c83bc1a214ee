"""The engine: the step (LLMEngine), the model runner, the KV tier (kv/), and the thread + asyncio bridge
(AsyncLLMEngine).

Imports flow one way: async_engine -> request_stream -> outputs; llm_engine -> {kv.lifecycle, model_runner}
-> kv.tier -> kv_cache. Every name below loads on first use, so importing this package (or any submodule, such
as `ironlm.engine.outputs`) runs nothing else, and torch loads only with LLMEngine / ModelRunner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ironlm.engine.async_engine import AsyncLLMEngine
    from ironlm.engine.llm_engine import LLMEngine
    from ironlm.engine.model_runner import ModelRunner
    from ironlm.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from ironlm.engine.prompts import PromptType
    from ironlm.engine.protocol import EngineClient, OutputObserver, StepEngine
    from ironlm.engine.request_stream import RequestStream

# name -> the submodule that defines it
_LAZY = {
    "AsyncLLMEngine": "async_engine",
    "CompletionOutput": "outputs",
    "EngineClient": "protocol",
    "LLMEngine": "llm_engine",
    "Logprob": "outputs",
    "ModelRunner": "model_runner",
    "OutputObserver": "protocol",
    "PromptType": "prompts",
    "RequestMetrics": "outputs",
    "RequestOutput": "outputs",
    "RequestStream": "request_stream",
    "StepEngine": "protocol",
}

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
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ironlm.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ironlm.engine.{module}"), name)
