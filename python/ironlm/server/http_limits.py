"""Connection limits uvicorn does not have: deadlines on reading a request head and its body, a size cap on the
head, and a cap on the connections one client address holds open.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but any byte resets that timer and a
fresh connection that never sends anything has no timer at all, so a client dripping header bytes (or just
connecting) holds a connection, and its file descriptor, forever. The protocol classes here arm one deadline when
a connection opens and again when a response completes; the request head (request line + headers) must be
complete before it, and no larger than `max_head_bytes`, else the client gets 408 / 431 and the connection
closes. Once a head is complete a second deadline covers its body (`body_timeout`, the whole body, so dripping
one byte at a time does not reset it): a body still incomplete then, with no response started, gets 408 and the
connection closes (the app, waiting in its body read, sees a disconnect). The app owns the request from then
until its response ends. A client address over `max_per_client` open connections gets 429 on the extra ones.
A refusal of a counted connection (408, 431), and any response sent before its request body was read, half-closes
the connection and lingers briefly so the client can read the answer (`_linger`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ironlm.config import ServerConfig
from ironlm.server.errors import error_body

_REASONS = {408: b"Request Timeout", 429: b"Too Many Requests", 431: b"Request Header Fields Too Large"}


class _HeadLimits:
    """Mixed in front of uvicorn's H11Protocol / HttpToolsProtocol (both keep the current `cycle` and call
    `on_response_complete`; a new cycle object means a request head was complete)."""

    head_timeout: float
    max_head_bytes: int
    body_timeout: float
    max_per_client: int  # 0: no cap
    open_per_client: dict[str, int]  # one per protocol class, i.e. per server: client host -> open connections
    linger_timeout: float
    max_drain_bytes: int
    # uvicorn's protocol attributes this mixin reads
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._client: str | None = None
        self._lingering = False
        self._drained = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._told_close: Any = None  # the cycle whose early answer said `connection: close`
        super().connection_made(transport)  # type: ignore[misc]
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) and peer else None  # None: a Unix socket, not capped
        if self.max_per_client and host is not None:
            if self.open_per_client.get(host, 0) >= self.max_per_client:
                # Closed at once, not lingering: a lingering refusal would hold the very descriptor the cap
                # protects (the connections that linger are those the cap counts).
                self._refuse(429, f"too many open connections from {host}: at most {self.max_per_client}",
                             "too_many_connections", linger=False)
                return
            self.open_per_client[host] = self.open_per_client.get(host, 0) + 1
            self._client = host
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # refused or timed out: read and discard, nothing more is parsed
            self._drained += len(data)
            if self._drained > self.max_drain_bytes:
                self.transport.close()
            return
        waiting, cycle = self._head_timer is not None, self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self._body_timer is not None and not self.cycle.more_body:
            self._disarm_body()
        if not waiting:
            return
        if self.cycle is not cycle:  # the head is complete (this chunk may carry body bytes too: measure the head)
            self._disarm()
            head = sum(len(k) + len(v) + 4 for k, v in self.cycle.scope["headers"])
            if head > self.max_head_bytes:
                self.cycle.disconnected = True  # the app, already started, reads a disconnect and writes nothing
                self._refuse(431, f"request headers exceed {self.max_head_bytes} bytes")
            elif self.cycle.more_body:
                self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out)
                self._close_if_answered_early(self.cycle)
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._refuse(431, f"request line and headers exceed {self.max_head_bytes} bytes")

    def _close_if_answered_early(self, cycle: Any) -> None:
        """A response that starts before its request's body has come in says `connection: close`: that connection
        ends after it (`on_response_complete` lingers, then closes), and a keep-alive client that pooled it would
        send its next request into that close and read "disconnected without a response". httptools' cycle would
        also close at once on the header, resetting a client still sending its body, so its keep-alive flag is
        put back as it was and `_linger` does the closing (also if the rest of the body arrives meanwhile: the
        client was told). h11's cycle (uvicorn's fallback without httptools) keeps the old behaviour: its state
        machine cannot be told to send the header and still linger."""
        if hasattr(cycle, "conn"):  # h11
            return
        send = cycle.send

        async def send_closing(message: Any) -> None:
            if message["type"] != "http.response.start" or not cycle.more_body:
                await send(message)
                return
            headers = [*message.get("headers", ())]
            if not any(k.lower() == b"connection" and b"close" in v.lower() for k, v in headers):
                headers.append((b"connection", b"close"))
            keep_alive = cycle.keep_alive
            await send({**message, "headers": headers})
            cycle.keep_alive = keep_alive  # as it was before our header: a client that asked to close is closed
            self._told_close = cycle

        cycle.send = send_closing

    def on_response_complete(self) -> None:
        cycle = self.cycle
        self._disarm_body()
        # Answered before its body was read (401, 503, ...), or told `connection: close` for that reason even if
        # the rest of the body came in meanwhile: the connection ends either way.
        unread = cycle is not None and (cycle.more_body or cycle is self._told_close)
        super().on_response_complete()  # type: ignore[misc]
        if self.cycle is not cycle or self.transport.is_closing():  # pipelined, or closing anyway
            return
        if unread:  # the rest of that body is no next request: end the connection once the client is done
            self._linger()
        else:  # wait for the next head
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._client is not None:
            left = self.open_per_client.get(self._client, 1) - 1
            if left > 0:
                self.open_per_client[self._client] = left
            else:
                self.open_per_client.pop(self._client, None)  # the map holds only addresses with connections
            self._client = None
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.head_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _disarm_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_started or not cycle.more_body:
            return  # the app answered without waiting for the body: the head deadline covers what is left
        self._refuse(408, f"the request body was not complete within {self.body_timeout:g} s")

    def _timed_out(self) -> None:
        self._head_timer = None
        if self._head_bytes:  # a head was under way: say why it ends; an idle connection just closes
            self._refuse(408, f"the request head was not complete within {self.head_timeout:g} s")
        elif not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str | None = None, linger: bool = True) -> None:
        self._disarm()
        self._disarm_body()
        if self.transport.is_closing():
            return
        body = json.dumps(error_body(status, message, code=code)).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (status, _REASONS[status], len(body)))
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app, waiting in a body read, sees a disconnect and writes nothing
            cycle.message_event.set()
        self.transport.write(head + body)
        if linger:
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        """Close after the client read the answer: a client still sending when the connection closes gets a
        reset, which on most systems discards the answer before it is read. So send our end's FIN and discard
        what still comes (at most `max_drain_bytes`, for at most `linger_timeout` s) until the client closes
        (uvicorn's `eof_received` closes the transport on the client's FIN)."""
        if not self.transport.can_write_eof():  # TLS: no half-close
            self.transport.close()
            return
        self._lingering = True
        self._drained = 0
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(self.linger_timeout, self.transport.close)

    def shutdown(self) -> None:
        if self._lingering:
            self.transport.close()
        else:
            super().shutdown()  # type: ignore[misc]


def limited_protocol(config: ServerConfig, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`base`, by default the one `http="auto"` picks) with the head limits."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    attrs = {"head_timeout": config.timeout_request_header, "max_head_bytes": config.max_request_header_bytes,
             "body_timeout": config.timeout_request_body, "max_per_client": config.max_connections_per_client,
             "open_per_client": {}, "linger_timeout": config.timeout_keep_alive,
             "max_drain_bytes": config.max_request_drain_bytes}
    return type(f"Limited{base.__name__}", (_HeadLimits, base), attrs)


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The connection settings of `uvicorn.Config` that come from ServerConfig."""
    return {"http": limited_protocol(config), "timeout_keep_alive": config.timeout_keep_alive,
            "h11_max_incomplete_event_size": config.max_request_header_bytes}
