"""Connection limits uvicorn does not have: a deadline and a size cap on reading a request head.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but any byte resets that timer and a
fresh connection that never sends anything has no timer at all, so a client dripping header bytes (or just
connecting) holds a connection, and its file descriptor, forever. The protocol classes here arm one deadline when
a connection opens and again when a response completes; the request head (request line + headers) must be
complete before it, and no larger than `max_head_bytes`, else the client gets 408 / 431 and the connection
closes. Once a head is complete the app owns the request, and the deadline is off until its response ends.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ironlm.config import ServerConfig
from ironlm.server.errors import error_body

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _HeadLimits:
    """Mixed in front of uvicorn's H11Protocol / HttpToolsProtocol (both keep the current `cycle` and call
    `on_response_complete`; a new cycle object means a request head was complete)."""

    head_timeout: float
    max_head_bytes: int
    # uvicorn's protocol attributes this mixin reads
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        waiting, cycle = self._head_timer is not None, self.cycle
        super().data_received(data)  # type: ignore[misc]
        if not waiting:
            return
        if self.cycle is not cycle:  # the head is complete (this chunk may carry body bytes too: measure the head)
            self._disarm()
            head = sum(len(k) + len(v) + 4 for k, v in self.cycle.scope["headers"])
            if head > self.max_head_bytes:
                self.cycle.disconnected = True  # the app, already started, reads a disconnect and writes nothing
                self._refuse(431, f"request headers exceed {self.max_head_bytes} bytes")
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._refuse(431, f"request line and headers exceed {self.max_head_bytes} bytes")

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # type: ignore[misc]
        if self.cycle is cycle and not self.transport.is_closing():  # not pipelined: wait for the next head
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.head_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timed_out(self) -> None:
        self._head_timer = None
        if self._head_bytes:  # a head was under way: say why it ends; an idle connection just closes
            self._refuse(408, f"the request head was not complete within {self.head_timeout:g} s")
        elif not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        body = json.dumps(error_body(status, message)).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (status, _REASONS[status], len(body)))
        self.transport.write(head + body)
        self.transport.close()


def limited_protocol(config: ServerConfig, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`base`, by default the one `http="auto"` picks) with the head limits."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    attrs = {"head_timeout": config.timeout_request_header, "max_head_bytes": config.max_request_header_bytes}
    return type(f"Limited{base.__name__}", (_HeadLimits, base), attrs)


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The connection settings of `uvicorn.Config` that come from ServerConfig."""
    return {"http": limited_protocol(config), "timeout_keep_alive": config.timeout_keep_alive,
            "h11_max_incomplete_event_size": config.max_request_header_bytes}
