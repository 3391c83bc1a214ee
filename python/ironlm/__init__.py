"""ironlm: a small, fast LLM inference and serving engine."""

import importlib
from typing import TYPE_CHECKING

# numpy first: the core builds numpy arrays, and rust-numpy panics (PanicException) instead of raising when it
# cannot import numpy's C API; importing it here turns a missing numpy into a plain ImportError at `import ironlm`.
import numpy  # noqa: F401

from ironlm import _core
from ironlm.config import EngineConfig
from ironlm.exceptions import (
    ConfigFileError,
    CoreError,
    DefaultModelNotInstalled,
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    EngineRestartedError,
    EngineStepError,
    GrammarBusyError,
    GrammarError,
    InjectedFault,
    InvalidArgumentError,
    LlamaCppNotBuilt,
    PerplexityArgumentError,
    QueueFullError,
    ReplicaRetriesExhausted,
    RequestTooLargeError,
    ShareGPTMissing,
    TemplateLimitError,
    TensorParallelError,
    UnsupportedModelError,
    VllmCpuNotBuilt,
)

if TYPE_CHECKING:
    from ironlm.engine import LLMEngine
    from ironlm.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from ironlm.llm import LLM
    from ironlm.sampling_params import SamplingParams

__version__ = _core.__version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigFileError",
    "CoreError",
    "DefaultModelNotInstalled",
    "DuplicateRequestError",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineRestartedError",
    "EngineStepError",
    "GrammarBusyError",
    "GrammarError",
    "InjectedFault",
    "InvalidArgumentError",
    "LLMEngine",
    "LlamaCppNotBuilt",
    "Logprob",
    "PerplexityArgumentError",
    "QueueFullError",
    "ReplicaRetriesExhausted",
    "RequestOutput",
    "RequestTooLargeError",
    "SamplingParams",
    "ShareGPTMissing",
    "TemplateLimitError",
    "TensorParallelError",
    "UnsupportedModelError",
    "VllmCpuNotBuilt",
    "__version__",
]


# name -> the module that defines it, imported on first use: `import ironlm` (and so `import ironlm._core`, which
# runs this file first) loads neither the engine nor torch/transformers.
_LAZY = {
    "LLM": "ironlm.llm",
    "LLMEngine": "ironlm.engine",
    "SamplingParams": "ironlm.sampling_params",
    "CompletionOutput": "ironlm.engine.outputs",
    "Logprob": "ironlm.engine.outputs",
    "RequestOutput": "ironlm.engine.outputs",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ironlm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
