"""`speculative_config`, as vLLM spells it: a dict or its JSON text, e.g.
`{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}`, or a draft
model: `{"model": PATH, "num_speculative_tokens": 4}` (method "draft_model", implied by "model").

ironlm's own fields: each step's proposal budget comes from a measured cost model (engine/spec/cost.py) unless
`"cost_model": false`; `"max_batch_tokens": N` caps the decode rows + proposals of a step on top of it; a fixed
`"step_costs": [[rows, seconds], ...]` table (a calibrated machine) replaces the online measurements.

Outside ironlm.engine: config.py reads it, and `import ironlm` must not load the engine package.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ironlm.exceptions import InvalidArgumentError

_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
           "max_batch_tokens", "cost_model", "step_costs")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    # ironlm's own: a user cap, no proposals once a step's decode rows + proposals would exceed it (None: none).
    max_batch_tokens: int | None = None
    # method "draft_model": the draft's path (an HF folder or a GGUF file sharing the target's tokenizer).
    model: str | None = None
    # The per-step budget from measured step costs and acceptance (False: speculate wherever the cap allows).
    cost_model: bool = True
    # A fixed (rows, seconds) step-cost table for the cost model instead of learning one online.
    step_costs: tuple[tuple[int, float], ...] | None = None


def _param(name: str) -> str:
    return f"speculative_config.{name}"


def _int(raw: Mapping[str, Any], name: str, default: int | None, low: int) -> int:
    value = raw.get(name, default)
    if value is None:
        raise InvalidArgumentError(f"{_param(name)} is required", _param(name))
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"{_param(name)} must be an integer >= {low}, got {value!r}", _param(name))
    return value


def parse_speculative_config(value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """None / "" / {}: off. Errors are InvalidArgumentError naming the field."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"speculative_config is not valid JSON: {exc}", "speculative_config") from None
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"speculative_config must be a JSON object, got {type(value).__name__}",
                                   "speculative_config")
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise InvalidArgumentError(f"speculative_config: unknown field {unknown[0]!r} (known: {', '.join(_FIELDS)})",
                                   _param(unknown[0]))
    model = value.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidArgumentError(f"speculative_config.model must be a path, got {model!r}", _param("model"))
    method = value.get("method", "draft_model" if model else "ngram")
    if method not in ("ngram", "[ngram]", "draft_model"):
        raise InvalidArgumentError(f"speculative_config.method must be 'ngram' or 'draft_model', got {method!r}",
                                   _param("method"))
    if (method == "draft_model") != (model is not None):
        raise InvalidArgumentError("speculative_config.model is required by method 'draft_model' and only by it",
                                   _param("model"))
    k = _int(value, "num_speculative_tokens", None, 1)
    low = _int(value, "prompt_lookup_min", 1, 1)
    high = _int(value, "prompt_lookup_max", max(low, 4), 1)
    if high < low:
        raise InvalidArgumentError(f"speculative_config.prompt_lookup_max ({high}) must be >= prompt_lookup_min "
                                   f"({low})", _param("prompt_lookup_max"))
    cap = None if value.get("max_batch_tokens") is None else _int(value, "max_batch_tokens", None, 0)
    auto = value.get("cost_model", True)
    if not isinstance(auto, bool):
        raise InvalidArgumentError(f"speculative_config.cost_model must be true or false, got {auto!r}",
                                   _param("cost_model"))
    return SpeculativeConfig("ngram" if model is None else "draft_model", k, high, low, cap, model, auto,
                             _table(value.get("step_costs")))


def _table(raw: Any) -> tuple[tuple[int, float], ...] | None:
    """`step_costs`: at least two [rows, seconds] pairs, rows >= 1 ascending, seconds > 0."""
    if raw is None:
        return None
    name = _param("step_costs")
    bad = InvalidArgumentError(f"{name} must be a list of at least two [rows, seconds] pairs with rows >= 1 "
                               f"ascending and seconds > 0, got {raw!r}", name)
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise bad
    out: list[tuple[int, float]] = []
    for pair in raw:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise bad
        rows, secs = pair
        if (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or isinstance(secs, bool)
                or not isinstance(secs, int | float) or not (secs > 0 and math.isfinite(secs)) or (out and rows <= out[-1][0])):
            raise bad
        out.append((rows, float(secs)))
    return tuple(out)
