"""The body of AsyncLLMEngine's engine thread: apply commands, step, hand outputs to event loops."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ironlm.request_stream import Delivery, EngineStepError, RequestStream, deliver

if TYPE_CHECKING:
    from ironlm.async_engine import AsyncLLMEngine

logger = logging.getLogger("ironlm.async_engine")

_ENGINE_KWARGS = ("priority", "deadline", "timeout", "arrival_time", "cache_salt")


class _Outbox:
    """Deliveries of one iteration, grouped per event loop: one call_soon_threadsafe per loop."""

    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}

    def add(self, stream: RequestStream, kind: str, payload: Any) -> None:
        self.by_loop.setdefault(stream.loop, []).append((stream, kind, payload))

    def flush(self) -> list[str]:
        """Send everything; returns ids of requests whose loop is closed (to abort)."""
        orphans: list[str] = []
        for loop, items in self.by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # loop closed under us: nobody will read these requests
                orphans.extend(stream.request_id for stream, _, _ in items)
        self.by_loop = {}
        return orphans


def run_engine_loop(ae: AsyncLLMEngine) -> None:
    from ironlm.async_engine import _MAX_CONSECUTIVE_STEP_FAILURES

    engine = ae.engine
    failures = 0
    outbox = _Outbox()
    while True:
        with ae._cv:
            # Sleep while idle: no busy spin; `_submit` notifies.
            while not ae._commands and not engine.has_unfinished_requests():
                ae._cv.wait()
            commands, ae._commands = ae._commands, []
        stop = _apply_commands(ae, commands, outbox)
        # Acceptances and add errors go out now, not after the step: a step can take a while.
        orphans = outbox.flush()
        if stop:
            return
        if orphans:
            _abort(ae, orphans)
        if engine.has_unfinished_requests():
            ae.step_started_at = time.monotonic()
            try:
                outputs = engine.step()
                failures = 0
            except Exception as exc:
                failures += 1
                logger.exception("engine step raised (%d in a row)", failures)
                if failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                    raise
                _fail_all(ae, EngineStepError(f"engine step failed: {exc!r}"), outbox)
            else:
                now = time.monotonic()
                ae.last_step_time = now
                for output in outputs:
                    stream = ae._streams.get(output.request_id)
                    if stream is None:
                        continue  # aborted meanwhile
                    if output.finished:
                        del ae._streams[output.request_id]
                    outbox.add(stream, "output", output)
                _observe(ae, "on_outputs", outputs, now)
            finally:
                ae.step_started_at = None
        ae._stats = engine.stats()
        orphans = outbox.flush()
        if orphans:
            _abort(ae, orphans)


def _apply_commands(ae: AsyncLLMEngine, commands: list[tuple[str, Any]], outbox: _Outbox) -> bool:
    """Returns True on a stop command."""
    engine = ae.engine
    for kind, payload in commands:
        if kind == "stop":
            return True
        if kind == "abort":
            _abort(ae, payload)
            continue
        stream: RequestStream = payload
        if stream.closed:  # the client left before the request even reached the engine
            continue
        kwargs = {k: v for k, v in stream.engine_kwargs.items() if k in _ENGINE_KWARGS and v is not None}
        try:
            engine.add_request(stream.request_id, stream.prompt, stream.params, **kwargs)
        except Exception as exc:  # noqa: BLE001 - ValueError, QueueFullError, ...: that request's problem only
            outbox.add(stream, "error", exc)
            continue
        ae._streams[stream.request_id] = stream
        outbox.add(stream, "accept", None)
    return False


def _abort(ae: AsyncLLMEngine, request_ids: list[str]) -> None:
    live = [rid for rid in request_ids if ae._streams.pop(rid, None) is not None]
    if live:
        ae.engine.abort_request(live)
        _observe(ae, "on_aborted", live)


def _fail_all(ae: AsyncLLMEngine, exc: BaseException, outbox: _Outbox) -> None:
    streams = list(ae._streams.values())
    for stream in streams:
        outbox.add(stream, "error", exc)
    _abort(ae, [s.request_id for s in streams])  # if this raises too, the loop dies: engine unusable


def _observe(ae: AsyncLLMEngine, method: str, *args: Any) -> None:
    if ae.observer is None:
        return
    try:
        getattr(ae.observer, method)(*args)
    except Exception:  # metrics must never take the engine down
        logger.exception("output observer failed")
