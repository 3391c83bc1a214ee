"""ironlm: a small, fast LLM inference and serving engine."""

# numpy first: the core builds numpy arrays, and rust-numpy panics (PanicException) instead of raising when it
# cannot import numpy's C API; importing it here turns a missing numpy into a plain ImportError at `import ironlm`.
import numpy  # noqa: F401

from ironlm import _core
from ironlm.config import EngineConfig
from ironlm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from ironlm.exceptions import (
    CoreError,
    DefaultModelNotInstalled,
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    EngineRestartedError,
    EngineStepError,
    GrammarError,
    InjectedFault,
    InvalidArgumentError,
    LlamaCppNotBuilt,
    PerplexityArgumentError,
    QueueFullError,
    ReplicaRetriesExhausted,
    RequestTooLargeError,
    TemplateLimitError,
    TensorParallelError,
    UnsupportedModelError,
)

__version__ = _core.__version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "CoreError",
    "DefaultModelNotInstalled",
    "DuplicateRequestError",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineRestartedError",
    "EngineStepError",
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
    "TemplateLimitError",
    "TensorParallelError",
    "UnsupportedModelError",
    "__version__",
]


def __getattr__(name: str):
    # torch/transformers load only when the model side is used, so `import ironlm` stays light.
    if name == "LLM":
        from ironlm.llm import LLM
        return LLM
    if name == "LLMEngine":
        from ironlm.engine import LLMEngine
        return LLMEngine
    if name == "SamplingParams":
        from ironlm.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'ironlm' has no attribute {name!r}")
