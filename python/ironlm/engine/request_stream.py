"""The caller-side end of one request: an async iterator of cumulative RequestOutputs.

Everything in RequestStream runs on the caller's event loop; the engine thread reaches it only through
an `Outbox`, which hands a step's items to each loop with one `loop.call_soon_threadsafe(deliver, items)`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from ironlm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ironlm.engine.prompts import PromptType

if TYPE_CHECKING:
    from typing_extensions import Self

    from ironlm.sampling_params import SamplingParams

DeliveryKind = Literal["accept", "output", "error"]
# Items the engine thread hands over: (stream, kind, payload); payload is None, a RequestOutput or an exception.
Delivery = tuple["RequestStream", DeliveryKind, Any]


def deliver(items: list[Delivery]) -> None:
    for stream, kind, payload in items:
        stream._handle(kind, payload)


class Outbox:
    """Deliveries of one engine-loop iteration, grouped per event loop: one call_soon_threadsafe per loop
    and step (not per request), which keeps the event loops' share of the GIL small."""

    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}

    def add(self, stream: RequestStream, kind: DeliveryKind, payload: Any) -> None:
        self.by_loop.setdefault(stream.loop, []).append((stream, kind, payload))

    def extend(self, other: Outbox) -> None:
        """Take over `other`'s deliveries, after this one's."""
        for loop, items in other.by_loop.items():
            self.by_loop.setdefault(loop, []).extend(items)
        other.by_loop = {}

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


class RequestStream:
    def __init__(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                 engine_kwargs: dict[str, Any],
                 loop: asyncio.AbstractEventLoop, *, timeout: float | None = None,
                 on_close: Callable[[RequestStream], None] | None = None) -> None:
        self.request_id = request_id
        self.prompt, self.params, self.engine_kwargs = prompt, params, engine_kwargs
        self.loop = loop
        self.finished = False  # the final output (or an error) was handed to the consumer
        self.closed = False  # read by the engine thread: a closed stream need not be added at all
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._last: RequestOutput | None = None
        self._deadline = None if timeout is None else loop.time() + timeout
        self._on_close = on_close

    # ---- fed by the engine thread (always on self.loop) -------------------------------------------
    def _handle(self, kind: DeliveryKind, payload: Any) -> None:
        if kind == "accept":
            if not self._accepted.done():
                self._accepted.set_result(None)
        elif kind == "error" and not self._accepted.done():
            self._accepted.set_exception(payload)
            self._accepted.exception()  # mark retrieved: the awaiting caller may have been cancelled
            self.finished = True
        else:
            self._queue.put_nowait(payload)

    def fail_threadsafe(self, exc: BaseException) -> None:
        """From any thread: end the stream with `exc` (idempotent enough: later items are ignored)."""
        try:
            self.loop.call_soon_threadsafe(self._handle, "error", exc)
        except RuntimeError:  # the caller's loop is gone; nobody is listening
            pass

    async def accepted(self) -> None:
        await self._accepted

    # ---- consumer side ----------------------------------------------------------------------------
    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._next_item()
        # Coalesce: outputs are cumulative, so a slow consumer only needs the newest one. A final output is the
        # answer: an error queued after it (the engine dying just after the request ended) must not replace it.
        while not self._queue.empty() and not isinstance(item, BaseException) and not item.finished:
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            self.close()
            raise item
        self._last = item
        if item.finished:
            self.finished = True
            self.close()
        return item

    async def _next_item(self) -> RequestOutput | BaseException:
        if self._deadline is None:
            return await self._queue.get()
        remaining = self._deadline - self.loop.time()
        try:
            return await asyncio.wait_for(self._queue.get(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            return self._timed_out()

    def _timed_out(self) -> RequestOutput:
        """The request's `timeout` ran out mid-generation: end it with finish_reason 'timeout'."""
        self.close()  # aborts it in the engine
        last = self._last
        n = getattr(self.params, "n", 1) or 1
        outputs = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(n)] if last is None else [
            CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob, o.logprobs,
                             o.finish_reason, o.stop_reason) for o in last.outputs]
        for o in outputs:
            o.finish_reason = o.finish_reason or "timeout"
        metrics = last.metrics if last is not None else RequestMetrics(self.engine_kwargs.get("arrival_time", 0.0))
        return RequestOutput(self.request_id, last.prompt if last else None,
                             last.prompt_token_ids if last else [], outputs, True, metrics,
                             num_cached_tokens=last.num_cached_tokens if last else 0,
                             prompt_logprobs=last.prompt_logprobs if last else None)

    def close(self) -> None:
        """Stop listening; aborts the request in the engine unless it already finished."""
        if not self.closed:
            self.closed = True
            if self._on_close is not None:
                self._on_close(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
