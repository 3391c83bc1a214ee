"""API-key check as a pure ASGI middleware: `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client-disconnect
cancellation pass through untouched. Only SHA-256 digests are kept and compared with
`hmac.compare_digest`, so the comparison takes the same time whatever the key's length or prefix.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from ironlm.server.errors import error_body

# Probes and scrapers usually run without credentials.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyChecker:
    def __init__(self, api_keys: str | Iterable[str]) -> None:
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
        if not keys or any(not k for k in keys):
            raise ValueError("api_key must be a non-empty string")
        self._digests = [_digest(k) for k in keys]

    def check(self, authorization: str | None) -> bool:
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = _digest(token.strip())
        ok = False
        for d in self._digests:  # no early exit: timing does not reveal which key matched
            ok |= hmac.compare_digest(given, d)
        return ok


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: str | Iterable[str]) -> None:
        self.app = app
        self.checker = KeyChecker(api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
            if name == b"x-api-key" and header is None:  # Anthropic's clients send the key so
                header = "Bearer " + value.decode("latin-1")
        if self.checker.check(header):
            await self.app(scope, receive, send)
            return
        message = "Missing API key" if header is None else "Incorrect API key provided"
        body = json.dumps(error_body(401, message, code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
