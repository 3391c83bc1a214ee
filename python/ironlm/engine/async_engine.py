"""AsyncLLMEngine: an LLMEngine driven by one dedicated thread, consumed from asyncio.

The engine is not thread-safe, so exactly one thread (the "engine loop", `_run_loop` below) ever touches
it. Callers hand requests and aborts over through a locked command list, applied between steps, so a
new request joins the running batch at the very next step. Outputs travel back through an `Outbox`:
one `loop.call_soon_threadsafe` per event loop per step (not per request).

Which thread owns what: `_streams` (accepted, unfinished requests) belongs to the engine thread,
`_inflight` (added by a caller, not yet finished) to the callers; `_commands` and `_dead` are shared
under `_cv`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ironlm import _core
from ironlm.config import ServerConfig
from ironlm.engine import faults
from ironlm.engine.dedupe import Deduper, RequestKey, request_key
from ironlm.engine.outputs import RequestOutput
from ironlm.engine.prompts import PromptType
from ironlm.engine.protocol import OutputObserver, StepEngine
from ironlm.engine.request_stream import Outbox, RequestStream
from ironlm.exceptions import (
    EngineDeadError,
    EngineOverloadedError,
    EngineRestartedError,
    EngineStepError,
    InvalidArgumentError,
)

if TYPE_CHECKING:
    from ironlm.config import EngineConfig
    from ironlm.model.config import ModelConfig
    from ironlm.sampling_params import SamplingParams

logger = logging.getLogger("ironlm.async_engine")

# The loop's fault policy, defaults from ServerConfig (their one home; `ironlm serve` flags of the same names):
# - max_step_failures (engine_restart_after_failures): failed steps in a row before the loop restarts the engine
#   (`StepEngine.reset`, when it has one; else it is dead). A step fails when it raises (its bookkeeping failed:
#   the loop fails the requests in flight) or when the engine failed its forward (`last_step_error`: the engine
#   failed that step's requests itself). A forward that always fails must not look like a working engine;
# - max_restarts (engine_max_restarts): restarts in a row with no successful step in between before the engine
#   is declared dead: restarting did not help, so /health turns 503 and the orchestrator restarts the process;
# - stall_timeout_s (health_stall_timeout): a step running longer (a hung kernel, a deadlock) makes /health
#   answer 503 "engine_stalled". Far above any real step: a full prefill budget on a laptop CPU takes seconds.
_DEFAULTS = ServerConfig()
# The keyword arguments of StepEngine.add_request a caller may pass through `add_request(**kwargs)`.
# add_request keyword -> LLMEngine.add_request keyword: a request's `timeout` (the whole request) also
# bounds its wait in the queue.
_ENGINE_KWARGS = {"priority": "priority", "deadline": "deadline", "timeout": "queue_timeout",
                  "arrival_time": "arrival_time", "cache_salt": "cache_salt", "grammar": "grammar",
                  "tenant": "tenant"}

# "add" carries one request's streams, or several a caller asked to be admitted all or none (`add_requests`).
Command = (tuple[Literal["add"], list[RequestStream]] | tuple[Literal["abort"], list[str]]
           | tuple[Literal["stop"], None])


class AsyncLLMEngine:
    def __init__(self, engine: StepEngine, *, observer: OutputObserver | None = None, start: bool = True,
                 stall_timeout_s: float = _DEFAULTS.health_stall_timeout,
                 max_step_failures: int = _DEFAULTS.engine_restart_after_failures,
                 max_restarts: int = _DEFAULTS.engine_max_restarts, dedupe: bool = _DEFAULTS.dedupe_requests,
                 result_cache_size: int = _DEFAULTS.result_cache_size) -> None:
        """`dedupe`: identical deterministic requests in flight share one sequence; `result_cache_size`: finished
        deterministic results kept for identical later requests (engine/dedupe.py). Both off by default."""
        if not stall_timeout_s > 0:
            raise InvalidArgumentError(f"stall_timeout_s must be > 0, got {stall_timeout_s}",
                                       param="stall_timeout_s")
        for name, value, low in (("max_step_failures", max_step_failures, 1), ("max_restarts", max_restarts, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
        self.max_step_failures, self.max_restarts = max_step_failures, max_restarts
        self.num_restarts = 0
        self.step_failures = 0  # failed steps in a row (engine thread)
        self._faults = faults.from_env()  # None unless a test sets IRONLM_FAULT
        self.engine = engine
        # What the servers read of the model (see protocol.EngineClient): the step engine's, fixed at load; an
        # engine without a model config or device (a test double) reports None and "cpu".
        self.tokenizer, self.model_name, self.max_model_len = engine.tokenizer, engine.model_name, engine.max_model_len
        self.model_config: ModelConfig | None = getattr(engine, "model_config", None)
        self.device: Any = getattr(engine, "device", "cpu")
        self.stall_timeout_s = stall_timeout_s
        self.step_started_at: float | None = None  # set by the engine thread while a step runs
        self.last_step_time: float | None = None
        self.observer = observer
        self._cv = threading.Condition()
        self._commands: list[Command] = []
        self._streams: dict[str, RequestStream] = {}
        self._inflight: dict[str, RequestStream] = {}
        self._dead: BaseException | None = None
        self._draining = False
        self._stats: dict[str, Any] = dict(engine.stats())
        self._thread: threading.Thread | None = None
        deduper = Deduper(share_inflight=dedupe, result_cache_size=result_cache_size)
        self._dedupe = deduper if deduper.enabled else None  # engine thread only
        if start:
            self.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLMEngine:
        from ironlm.engine.llm_engine import LLMEngine  # torch loads here, not at `import ironlm.engine`

        return cls(LLMEngine(config), **kwargs)

    # ---- health and load (see protocol.EngineClient) ------------------------------------------------
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

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        """Callable from any thread: it only reads the tokenizer, never the engine's state. `kwargs` go to the
        template (e.g. `tools`)."""
        return self.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of the end of the last step (a snapshot: LLMEngine is single-threaded), and
        `num_engine_restarts`, the loop's restarts so far."""
        dedupe = self._dedupe.stats() if self._dedupe is not None else {}
        return {**self._stats, **dedupe, "num_engine_restarts": self.num_restarts,
                "engine_step_failures_in_a_row": self.step_failures}

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
        self._submit(("abort", [s.request_id for s in leftover]))
        self._submit(("stop", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    # ---- requests (any event loop) ------------------------------------------------------------------
    async def add_request(self, request_id: str | None, prompt: PromptType,
                          params: SamplingParams | None = None, **kwargs: Any) -> RequestStream:
        """Queue a request; returns its output stream once the engine accepted it.

        Raises what LLMEngine.add_request raises (InvalidArgumentError, QueueFullError), EngineDeadError, or
        EngineOverloadedError while draining. `kwargs`: priority, deadline, timeout, cache_salt,
        arrival_time, tenant. `timeout` bounds the whole request; the engine gets it as its `queue_timeout`.
        """
        (stream,) = await self.add_requests([request_id], [prompt], params, **kwargs)
        return stream

    async def add_requests(self, request_ids: Sequence[str | None], prompts: Sequence[PromptType],
                           params: SamplingParams | None = None, **kwargs: Any) -> list[RequestStream]:
        """Queue one request per prompt (the same `params` and `kwargs`), all or none: the engine admits them
        together, in order, between two other commands, or admits none (each raises the first one's error and
        those already added are taken back before anything else is admitted). So lists arriving together never
        each take part of the queue and then all fail (a multi-prompt completion). Raises as `add_request`."""
        if len(request_ids) != len(prompts) or not prompts:
            raise InvalidArgumentError(f"{len(request_ids)} request ids for {len(prompts)} prompts",
                                       param="request_ids")
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}")
        if self._draining:
            raise EngineOverloadedError("the server is shutting down")
        ids = [request_id or uuid.uuid4().hex for request_id in request_ids]
        for i, request_id in enumerate(ids):
            if request_id in self._inflight or request_id in ids[:i]:
                raise InvalidArgumentError(f"request_id: {request_id!r} is already in flight", param="request_id")
        kwargs.setdefault("arrival_time", _core.monotonic())  # the engine's clock: TTFT covers the hand-off
        compile_grammar = getattr(self.engine, "compile_grammar", None)
        if params is not None and params.structured_outputs is not None and compile_grammar is not None:
            # Compiled here, before queueing, on the grammar cache's own bounded pool (not the loop's default
            # threads, which tokenize for everyone): a slow grammar delays and fails only its own request.
            # GrammarError propagates (a 400), GrammarBusyError too (a 429: the tenant's compiles are capped).
            compile_async = getattr(getattr(self.engine, "grammars", None), "compile_async", None)
            if compile_async is not None:
                kwargs["grammar"] = await compile_async(params.structured_outputs, kwargs.get("tenant"))
            else:
                kwargs["grammar"] = await asyncio.to_thread(compile_grammar, params.structured_outputs)
        loop = asyncio.get_running_loop()
        streams = [RequestStream(request_id, prompt, params, dict(kwargs), loop, timeout=kwargs.get("timeout"),
                                 on_close=self._on_stream_closed) for request_id, prompt in zip(ids, prompts)]
        for stream in streams:
            self._inflight[stream.request_id] = stream
        self._submit(("add", streams))
        try:
            for stream in streams:  # all accepted, or all failed with the same error
                await stream.accepted()
        except asyncio.CancelledError:
            self.abort(ids)
            raise
        except BaseException:
            for request_id in ids:
                self._inflight.pop(request_id, None)
            raise
        return streams

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
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
        self._submit(("abort", ids))

    def _on_stream_closed(self, stream: RequestStream) -> None:
        if self._inflight.pop(stream.request_id, None) is not None and not stream.finished:
            self._submit(("abort", [stream.request_id]))

    def _submit(self, command: Command) -> None:
        with self._cv:
            if self._dead is not None and command[0] == "add":
                for stream in command[1]:
                    stream.fail_threadsafe(EngineDeadError(f"the engine is dead: {self._dead!r}"))
                return
            self._commands.append(command)
            self._cv.notify()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._run_loop()
        except BaseException as exc:  # whatever killed the loop: fail everyone fast
            logger.exception("engine loop died")
            self._die(exc)
            return
        # Stopped by `shutdown`: end the engine on its own thread (a disk KV tier saves its index here).
        end = getattr(self.engine, "shutdown", None)
        if callable(end):
            try:
                end()
            except Exception:
                logger.exception("engine shutdown failed")

    def _run_loop(self) -> None:
        engine = self.engine
        restarts = 0  # since the last good step
        outbox = Outbox()
        while True:
            with self._cv:
                while not self._commands and not engine.has_unfinished_requests():
                    self._cv.wait()  # idle: sleep until `_submit` notifies
                commands, self._commands = self._commands, []
            answered: list[RequestOutput] = []
            stop = self._apply_commands(commands, outbox, answered)
            if answered and self.observer is not None:
                self._observe(self.observer.on_outputs, answered, time.monotonic())
            # Acceptances and add errors go out now, not after the step: a step can take a while.
            orphans = outbox.flush()
            if stop:
                return
            self._abort(orphans)
            if engine.has_unfinished_requests():
                self.step_started_at = time.monotonic()
                try:
                    if self._faults is not None:
                        self._faults.check("step")
                    outputs = engine.step()
                except EngineDeadError:
                    raise  # e.g. a tensor-parallel rank died: restarting the loop cannot bring it back
                except Exception as exc:
                    logger.exception("engine step raised (%d in a row)", self.step_failures + 1)
                    restarts = self._step_failed(exc, restarts, outbox, raised=True)
                else:
                    self.last_step_time = now = time.monotonic()
                    routed = self._route(outputs, outbox)
                    if self.observer is not None:
                        self._observe(self.observer.on_outputs, routed, now)
                    failed = getattr(engine, "last_step_error", None)
                    if failed is None:
                        self.step_failures = restarts = 0
                    else:  # the forward failed: the engine failed the step's requests (routed above) itself
                        restarts = self._step_failed(failed, restarts, outbox, raised=False)
                finally:
                    self.step_started_at = None
            self._stats = engine.stats()
            self._abort(outbox.flush())

    def _apply_commands(self, commands: list[Command], outbox: Outbox, answered: list[RequestOutput]) -> bool:
        """Returns True on a stop command. Requests answered without the engine (result cache) go to `answered`."""
        for command in commands:
            if command[0] == "stop":
                return True
            if command[0] == "abort":
                self._abort(command[1])
                continue
            # A stream closed already: the client left before the request even reached the engine.
            self._add_all([stream for stream in command[1] if not stream.closed], outbox, answered)
        return False

    def _add_all(self, streams: list[RequestStream], outbox: Outbox, answered: list[RequestOutput]) -> None:
        """Admit `streams` in order, or none: on the first error, those added are taken back (no other command
        runs in between) and every stream gets that error."""
        staged, staged_answers = Outbox(), list[RequestOutput]()
        added: list[str] = []
        for stream in streams:
            try:
                self._add_one(stream, staged, staged_answers)
            except Exception as exc:  # noqa: BLE001 - ValueError, QueueFullError, ...: that request's problem only
                self._abort(added)
                for failed in streams:
                    outbox.add(failed, "error", exc)
                return
            added.append(stream.request_id)
        outbox.extend(staged)
        answered.extend(staged_answers)

    def _add_one(self, stream: RequestStream, outbox: Outbox, answered: list[RequestOutput]) -> None:
        """Raises what the engine's add_request raises."""
        key: RequestKey | None = None
        if self._dedupe is not None:
            key = request_key(self.engine.model_name, stream.prompt, stream.params, stream.engine_kwargs)
            if self._dedupe_add(stream, key, outbox, answered):
                return
        kwargs = {_ENGINE_KWARGS[k]: v for k, v in stream.engine_kwargs.items()
                  if k in _ENGINE_KWARGS and v is not None}
        self.engine.add_request(stream.request_id, stream.prompt, stream.params, **kwargs)
        self._streams[stream.request_id] = stream
        if self._dedupe is not None:
            self._dedupe.lead(key, stream.request_id, stream.engine_kwargs["arrival_time"])
        outbox.add(stream, "accept", None)

    def _dedupe_add(self, stream: RequestStream, key: RequestKey | None, outbox: Outbox,
                    answered: list[RequestOutput]) -> bool:
        """Answer the request from the result cache or attach it to an identical running sequence; False when it
        needs a sequence of its own."""
        assert self._dedupe is not None
        rid, arrival = stream.request_id, stream.engine_kwargs["arrival_time"]
        cached = self._dedupe.cached(key, rid, arrival, _core.monotonic())
        if cached is not None:
            outbox.add(stream, "accept", None)
            outbox.add(stream, "output", cached)
            answered.append(cached)
            return True
        joined, latest = self._dedupe.join(key, rid, arrival)
        if not joined:
            return False
        self._streams[rid] = stream
        outbox.add(stream, "accept", None)
        if latest is not None:  # a late joiner gets the tokens so far at once, not after the next step
            outbox.add(stream, "output", latest)
        return True

    def _route(self, outputs: list[RequestOutput], outbox: Outbox) -> list[RequestOutput]:
        """Hand each output to its stream (a shared sequence's to every listener, under its own id); returns
        what was handed out, one output per request."""
        if self._dedupe is not None:
            outputs = [out for output in outputs for out in self._dedupe.fan_out(output)]
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if output.finished:
                del self._streams[output.request_id]
            outbox.add(stream, "output", output)
        return outputs

    def _abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if live:
            # A shared sequence is aborted only once its last listener left.
            engine_ids = live if self._dedupe is None else self._dedupe.release(live)
            if engine_ids:
                self.engine.abort_request(engine_ids)
            if self.observer is not None:
                self._observe(self.observer.on_aborted, live)

    def _step_failed(self, exc: Exception, restarts: int, outbox: Outbox, *, raised: bool) -> int:
        """Count a failed step; returns the restarts since the last good step. A step that `raised` fails the
        requests in flight here (when that raises too, the engine restarts at once). `max_step_failures` in a row
        restart the engine; once `max_restarts` restarts did not help, `exc` is raised: the loop dies and /health turns 503."""
        self.step_failures += 1
        if self.step_failures < self.max_step_failures and (not raised or self._fail_step(exc, outbox)):
            return restarts
        if restarts >= self.max_restarts or not callable(getattr(self.engine, "reset", None)):
            outbox.flush()  # what the step already answered (its failed requests' errors) goes out first
            raise exc  # restarting did not help (or cannot be done): the engine is dead
        self._restart(exc, self.step_failures, outbox)
        self.step_failures = 0
        return restarts + 1

    def _fail_step(self, exc: Exception, outbox: Outbox) -> bool:
        """Fail the requests in flight after a step raised; False if aborting them raised too (restart then)."""
        try:
            self._fail_all(EngineStepError(f"engine step failed: {exc!r}"), outbox)
        except Exception:
            logger.exception("aborting the failed step's requests raised too")
            return False
        return True

    def _restart(self, exc: Exception, failures: int, outbox: Outbox) -> None:
        """Restart the loop's engine state (not the process): fail every request in flight with a clear error,
        then `engine.reset()` (fresh scheduler and KV block pool). If that raises, the loop dies (/health 503)."""
        error = EngineRestartedError(f"the engine loop restarted after {failures} failed steps in a row (last: "
                                     f"{exc!r}); requests in flight were failed")
        streams = list(self._streams.values())
        self._streams.clear()
        if self._dedupe is not None:
            self._dedupe.drop_inflight()
        for stream in streams:
            outbox.add(stream, "error", error)
        logger.error("restarting the engine loop after %d failed steps in a row; failing %d requests",
                     failures, len(streams))
        if self.observer is not None and streams:
            self._observe(self.observer.on_aborted, [s.request_id for s in streams])
        outbox.flush()  # the failures go out first: the reset may take a while, or fail and kill the loop
        if self._faults is not None:
            self._faults.check("restart")
        # `reset` is optional (not in StepEngine: test doubles need not have it); the caller checked it exists.
        self.engine.reset()  # type: ignore[attr-defined]
        self.num_restarts += 1

    def _fail_all(self, exc: BaseException, outbox: Outbox) -> None:
        streams = list(self._streams.values())
        for stream in streams:
            outbox.add(stream, "error", exc)
        self._abort([s.request_id for s in streams])  # if this raises too, the loop dies: engine unusable

    def _observe(self, hook: Callable[..., None], *args: Any) -> None:
        try:
            hook(*args)
        except Exception:  # metrics must never take the engine down
            logger.exception("output observer failed")

    def _die(self, exc: BaseException) -> None:
        with self._cv:
            self._dead = exc
            pending, self._commands = self._commands, []
        error = EngineDeadError(f"the engine is dead: {exc!r}")
        for command in pending:
            if command[0] == "add":
                for stream in command[1]:
                    stream.fail_threadsafe(error)
        for stream in list(self._streams.values()) + list(self._inflight.values()):
            stream.fail_threadsafe(error)
        self._streams.clear()
