"""Per-request sampling parameters, field-compatible with vLLM's `SamplingParams`."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal, TypeGuard

from ironlm.exceptions import InvalidArgumentError
from ironlm.structured.params import StructuredOutputsParams

# Every invalid field raises InvalidArgumentError (a ValueError, not a TypeError even for a wrong type, as
# vLLM does) with the field in `param`: callers such as the HTTP layer map exactly that to a 400 response.

# Below this temperature the request is greedy (vLLM's threshold): dividing by it would overflow anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0


def _invalid(param: str, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{param} {reason}", param=param)


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; `n=True` is almost certainly a bug, so reject it.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[float]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N raw logprobs per token; the chosen token's is always included
    # Per prompt token after the first: its raw logprob and the top-N (vLLM's semantics; the first is None).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> bias added to the logit, clamped to [-100, 100]
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)

    def __post_init__(self) -> None:
        self._check_int("n", self.n, low=1)
        self._check_real("temperature", self.temperature, low=0.0)
        self._check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise _invalid("top_p", f"must be in (0, 1], got {self.top_p}")
        self._check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise _invalid("top_k", f"must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        self._check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise _invalid("min_p", f"must be in [0, 1], got {self.min_p}")
        self._check_real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise _invalid("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check_real(name, value)
            if not -2.0 <= value <= 2.0:
                raise _invalid(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            self._check_int("seed", self.seed)
        self._check_stop()
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise _invalid("stop_token_ids", f"must be a list of ints, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
            for tid in self.stop_token_ids:
                if not _is_int(tid) or tid < 0:
                    raise _invalid("stop_token_ids", f"must be non-negative ints, got {tid!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens, low=1)
        self._check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            self._check_int("logprobs", self.logprobs, low=0)
            if self.logprobs > MAX_LOGPROBS:
                raise _invalid("logprobs", f"must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", self.prompt_logprobs, low=0)
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise _invalid("prompt_logprobs", f"must be <= {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        self._check_logit_bias()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _invalid("structured_outputs", f"must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if not self.detokenize and self.stop_strings:
            # Stop strings are matched on text; without detokenization there is no text to match.
            raise _invalid("stop", "strings are only supported when detokenize is True")

    # -- helpers -------------------------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    # -- validation ----------------------------------------------------------------------------------

    @staticmethod
    def _check_int(name: str, value: object, low: int | None = None) -> None:
        if not _is_int(value):
            raise _invalid(name, f"must be an int, got {value!r}")
        if low is not None and value < low:
            raise _invalid(name, f"must be >= {low}, got {value}")

    @staticmethod
    def _check_real(name: str, value: object, low: float | None = None) -> None:
        if not _is_real(value) or not math.isfinite(value):
            raise _invalid(name, f"must be a finite number, got {value!r}")
        if low is not None and value < low:
            raise _invalid(name, f"must be >= {low:g}, got {value}")

    def _check_stop(self) -> None:
        if self.stop is None or isinstance(self.stop, str):
            strings = [] if self.stop is None else [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            strings = list(self.stop)
        else:
            raise _invalid("stop", f"must be a str, a list of str or None, got {self.stop!r}")
        for s in strings:
            if not isinstance(s, str):
                raise _invalid("stop", f"must contain only strings, got {s!r}")
            if not s:
                raise _invalid("stop", "cannot contain an empty string")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise _invalid("logit_bias", f"must be a dict of token id -> bias, got {self.logit_bias!r}")
        clean: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            # JSON (OpenAI API) object keys are strings: accept "123" as token 123.
            tid = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if not _is_int(tid) or tid < 0:
                raise _invalid("logit_bias", f"keys must be non-negative token ids, got {key!r}")
            if not _is_real(bias) or math.isnan(bias):
                raise _invalid("logit_bias", f"values must be numbers, got {bias!r} for token {key!r}")
            clean[int(tid)] = float(min(max(bias, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT))
        self.logit_bias = clean


EarlyStopping = bool | Literal["never"]


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (`LLM.beam_search`), plus transformers' `early_stopping`: True stops once beam_width
    sequences finished, False by transformers' heuristic, "never" only when no live beam can beat them (see
    engine/beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = "never"

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise _invalid(name, f"must be an int >= 1, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise _invalid("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if not _is_real(self.temperature) or self.temperature != 0:
            # Beam search keeps the most likely beams; sampling them (transformers' do_sample beams) is not built.
            raise _invalid("temperature", f"must be 0 for beam search (it is deterministic), got {self.temperature!r}")
        lp = self.length_penalty
        if not _is_real(lp) or not math.isfinite(lp):
            raise _invalid("length_penalty", f"must be a finite number, got {lp!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise _invalid("early_stopping", f"must be true, false or 'never', got {self.early_stopping!r}")

    def top_logprobs(self, num_eos: int) -> int:
        """Logprobs asked per beam and step: enough for the global top candidates (engine/beam_search.py)."""
        top = self.beam_width + (0 if self.ignore_eos else num_eos)
        if top > MAX_LOGPROBS:
            raise _invalid("beam_width", f"must be <= {MAX_LOGPROBS - top + self.beam_width} (each step reads the "
                           f"top beam_width + {top - self.beam_width} EOS logprobs, at most {MAX_LOGPROBS}), "
                           f"got {self.beam_width}")
        return top
