"""AsyncLLMEngine: an LLMEngine driven by one dedicated thread, consumed from asyncio.

The engine is not thread-safe, so exactly one thread (the "engine loop") ever touches it. Requests and
aborts are handed over through a locked command list and applied between steps, so a new request joins
the running batch at the very next step. Outputs travel back with `loop.call_soon_threadsafe`, one call
per event loop per step (not per request), which keeps the event loop's share of the GIL small.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from ironlm.outputs import RequestOutput
from ironlm.request_stream import EngineDeadError, EngineOverloadedError, RequestStream

logger = logging.getLogger("ironlm.async_engine")

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineOverloadedError", "RequestStream"]

# A step that raises (the engine already turns forward errors into per-request errors, so this means
# its own bookkeeping failed) fails the requests in flight; this many in a row and the engine is dead.
_MAX_CONSECUTIVE_STEP_FAILURES = 3


class OutputObserver(Protocol):
    """Called on the engine thread; must be cheap and must not raise (errors are logged)."""

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_aborted(self, request_ids: list[str]) -> None: ...


class AsyncLLMEngine:
    def __init__(self, engine: Any, *, observer: OutputObserver | None = None, start: bool = True,
                 stall_timeout_s: float = 300.0) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.engine = engine
        # A step running longer than this (a hung kernel, a deadlock) makes /health answer 503 "engine_stalled",
        # so an orchestrator restarts the process. Far above any real step: a full prefill budget on a laptop
        # CPU takes seconds.
        self.stall_timeout_s = stall_timeout_s
        self.step_started_at: float | None = None  # set by the engine thread while a step runs
        self.observer = observer
        self._cv = threading.Condition()
        self._commands: list[tuple[str, Any]] = []  # ("add", RequestStream) | ("abort", [ids]) | ("stop", None)
        self._streams: dict[str, RequestStream] = {}  # engine-thread side: accepted and unfinished
        self._inflight: dict[str, RequestStream] = {}  # caller side: added and not yet finished
        self._dead: BaseException | None = None
        self._draining = False
        self._stats: dict = dict(engine.stats())
        self._thread: threading.Thread | None = None
        self._started_at = time.monotonic()
        self.last_step_time: float | None = None
        if start:
            self.start()

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> AsyncLLMEngine:
        from ironlm.engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    # ---- properties the server reads --------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def stalled_for(self) -> float | None:
        """Seconds the running step has taken once past ``stall_timeout_s``; None while steps are normal."""
        started = self.step_started_at
        if started is None:
            return None
        running = time.monotonic() - started
        return running if running > self.stall_timeout_s else None

    @property
    def is_ready(self) -> bool:
        """Loaded, warmed up (LLMEngine.__init__ did both), loop running and not draining."""
        return self.is_healthy and not self._draining

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Callable from any thread: it only reads the tokenizer, never the engine's state."""
        return self.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def stats(self) -> dict:
        """The engine's stats as of the end of the last step (a snapshot: LLMEngine is single-threaded)."""
        return self._stats

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ironlm-engine", daemon=True)
            self._thread.start()

    def begin_drain(self) -> None:
        """Refuse new requests from now on (SIGTERM); in-flight ones carry on."""
        self._draining = True

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `drain_timeout` s, abort the rest."""
        self.begin_drain()
        deadline = time.monotonic() + drain_timeout
        while self._inflight and time.monotonic() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        leftover = list(self._inflight.values())
        if leftover:
            logger.warning("shutdown: aborting %d requests still in flight", len(leftover))
        for stream in leftover:
            stream.fail_threadsafe(EngineOverloadedError("the server is shutting down"))
        self._submit("abort", [s.request_id for s in leftover])
        self._submit("stop", None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    # ---- requests ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                          params: Any = None, **kwargs: Any) -> RequestStream:
        """Queue a request; returns its output stream once the engine accepted it.

        Raises what LLMEngine.add_request raises (ValueError, QueueFullError), EngineDeadError, or
        EngineOverloadedError while draining. `kwargs`: priority, deadline, timeout, cache_salt,
        arrival_time. `timeout` also bounds the whole request here (the engine only bounds queueing).
        """
        from ironlm import _core

        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}")
        if self._draining:
            raise EngineOverloadedError("the server is shutting down")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._inflight:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        kwargs.setdefault("arrival_time", _core.monotonic())  # the engine's clock: TTFT covers the hand-off
        stream = RequestStream(request_id, prompt, params, kwargs, asyncio.get_running_loop(),
                               timeout=kwargs.get("timeout"), on_close=self._on_stream_closed)
        self._inflight[request_id] = stream
        self._submit("add", stream)
        try:
            await stream.accepted()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._inflight.pop(request_id, None)
            raise
        return stream

    async def generate(self, prompt: str | list[int] | dict, params: Any = None,
                       request_id: str | None = None, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; closing or cancelling the iterator aborts it."""
        stream = await self.add_request(request_id, prompt, params, **kwargs)
        async with stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Thread-safe; the blocks are freed before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._inflight.pop(rid, None)
        self._submit("abort", ids)

    def _on_stream_closed(self, stream: RequestStream) -> None:
        if self._inflight.pop(stream.request_id, None) is not None and not stream.finished:
            self._submit("abort", [stream.request_id])

    def _submit(self, kind: str, payload: Any) -> None:
        with self._cv:
            if self._dead is not None and kind == "add":
                payload.fail_threadsafe(EngineDeadError(f"the engine is dead: {self._dead!r}"))
                return
            self._commands.append((kind, payload))
            self._cv.notify()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        from ironlm.engine_loop import run_engine_loop

        try:
            run_engine_loop(self)
        except BaseException as exc:  # whatever killed the loop: fail everyone fast
            logger.exception("engine loop died")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        with self._cv:
            self._dead = exc
            pending, self._commands = self._commands, []
        error = EngineDeadError(f"the engine is dead: {exc!r}")
        for kind, payload in pending:
            if kind == "add":
                payload.fail_threadsafe(error)
        for stream in list(self._streams.values()) + list(self._inflight.values()):
            stream.fail_threadsafe(error)
        self._streams.clear()
