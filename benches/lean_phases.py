"""Per-phase timers for the lean CPU step (benches/bench_lean_rows.py --phases): every core call the step makes
and every matmul it runs, timed in place, so a t-row verification step's cost splits into the GEMMs of each
projection (and the LM head), attention, the norms and activation, and the glue around them (the Python loop, the
embedding, the plan)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ironlm.model import lean

# The lean step's core calls, named as the report groups them.
_CORE_PHASES = {"rms_norm": "norms", "residual_add": "norms", "decode_attention_qkv": "attention",
                "silu_and_mul": "act", "gelu_tanh_and_mul": "act"}
LINEARS = ("qkv", "o", "gate_up", "down")


class PhaseClock:
    """Seconds per phase since the last `take`, on `now` (wall time, or with one thread the thread's CPU time:
    on a loaded machine the CPU a step took, without the time it spent descheduled)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.now = now

    def timed(self, phase: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] += self.now() - t0

        return call

    def take(self) -> dict[str, float]:
        out, self.spent = dict(self.spent), defaultdict(float)
        return out


class _CoreProxy:
    """`ironlm._core` with the lean step's calls timed."""

    def __init__(self, core: Any, clock: PhaseClock) -> None:
        self._core, self._clock = core, clock

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._core, name)
        phase = _CORE_PHASES.get(name)
        return fn if phase is None else self._clock.timed(phase, fn)


class _TimedLinear:
    """A linear whose `into` / `accumulate` / call are timed as `phase` (the matrix kind appended)."""

    def __init__(self, linear: Any, phase: str, clock: PhaseClock) -> None:
        kind = getattr(getattr(linear, "matrix", None), "kind", "dense")
        self._linear, self._phase = linear, f"{phase}:{kind}"
        self.into = clock.timed(self._phase, linear.into)
        self.accumulate = clock.timed(self._phase, linear.accumulate)
        self._call = clock.timed(self._phase, linear.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._linear, name)


def instrument(model: Any, clock: PhaseClock) -> Any:
    """Time `model`'s lean step in place; returns an undo callable."""
    saved_core = lean._core
    lean._core = _CoreProxy(saved_core, clock)  # type: ignore[assignment]
    saved: list[tuple[Any, str, Any]] = []
    for layer in model.layers:
        for name in LINEARS:
            saved.append((layer, name, getattr(layer, name)))
            setattr(layer, name, _TimedLinear(getattr(layer, name), name, clock))
    saved.append((model, "head", model.head))
    model.head = _TimedLinear(model.head, "head", clock)

    def undo() -> None:
        lean._core = saved_core  # type: ignore[assignment]
        for obj, name, value in saved:
            setattr(obj, name, value)

    return undo


def timed_step(model: Any, clock: PhaseClock, run: Any) -> dict[str, float]:
    """`run()` (one model step) split into phases; `glue` is the step's time outside every timed call."""
    clock.take()
    t0 = clock.now()
    with torch.inference_mode():
        run()
    total = clock.now() - t0
    phases = clock.take()
    phases["glue"] = total - sum(phases.values())
    phases["total"] = total
    return phases
