"""What a hostile client must not get past before any handler runs: the body size cap and the JSON content type.

Pure ASGI (not BaseHTTPMiddleware, which would buffer streaming responses). The size cap is enforced while the
body is read, so a chunked body without Content-Length is cut off at the limit instead of being buffered whole.
A refused body is still read, and discarded, up to `drain_bytes` before the 413 goes out: a client that sends its
whole body before reading (most do) would otherwise write into a closed connection and see a reset instead of the
413. Past that bound the 413 goes out at once and the connection closes.
The content-type check is what makes a browser send a CORS preflight first: a page may post `text/plain` or a
form to any origin without one, but not `application/json`.
"""

from __future__ import annotations

import json

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ironlm.config import ServerConfig
from ironlm.server.errors import APIError, error_body


def is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class RequestGuardMiddleware:
    """413 for a body over `max_bytes` (by Content-Length at once, else as soon as the bytes read pass it), 415 for
    a body-carrying request to a JSON route without a JSON content type."""

    def __init__(self, app: ASGIApp, max_bytes: int, json_paths: frozenset[str], drain_bytes: int) -> None:
        self.app, self.max_bytes, self.json_paths, self.drain_bytes = app, max_bytes, json_paths, drain_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(receive, send, length, 413, f"request body too large: at most {self.max_bytes} "
                               "bytes are accepted", "request_too_large")
            return
        if scope["path"].rstrip("/") in self.json_paths:
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            if not is_json_type(content_type):
                await self._refuse(receive, send, length, 415, "Content-Type must be application/json, got "
                                   f"{content_type or 'none'!r}", "unsupported_media_type")
                return
        seen = 0

        async def capped_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the handler's body read: the APIError handler answers.
                    drained = not message.get("more_body", False) or await _drain(receive, seen, self.drain_bytes)
                    raise APIError(413, f"request body too large: at most {self.max_bytes} bytes are accepted",
                                   code="request_too_large", headers=None if drained else {"Connection": "close"})
            return message

        await self.app(scope, capped_receive, send)

    async def _refuse(self, receive: Receive, send: Send, length: bytes | None, status: int, message: str,
                      code: str) -> None:
        """Answer without the app; drain the body first when its length is unknown or within the bound."""
        drained = False
        if length is None or (length.isdigit() and int(length) <= self.drain_bytes):
            drained = await _drain(receive, 0, self.drain_bytes)
        await _reply(send, status, message, code, close=not drained)


async def _drain(receive: Receive, seen: int, bound: int) -> bool:
    """Read and discard the rest of a body; False once more than `bound` bytes in all came (or the client left).
    The body deadline (server/http_limits.py) bounds how long this may take."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return False
        seen += len(message.get("body", b""))
        if seen > bound:
            return False
        if not message.get("more_body", False):
            return True


async def _reply(send: Send, status: int, message: str, code: str, close: bool) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"connection", b"close")] if close else headers})
    await send({"type": "http.response.body", "body": body})


def install_guards(app: FastAPI, config: ServerConfig, json_paths: frozenset[str]) -> None:
    app.add_middleware(RequestGuardMiddleware, max_bytes=config.max_request_bytes, json_paths=json_paths,
                       drain_bytes=config.max_request_drain_bytes)


def install_cors(app: FastAPI, config: ServerConfig) -> None:
    """CORS only when origins are configured; added last, so outermost: preflights are answered before the key
    check (browsers never send credentials on a preflight)."""
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)
