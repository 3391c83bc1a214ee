"""A light streaming client for one request: HTTP/1.1 over a blocking socket, SSE events timed as they arrive.

`ironlm bench latency --streamed` runs the client on the same 2 cores as the server. The async httpx client
(bench/serve.py, right for many concurrent users) spends ~0.5-0.9 ms of CPU per streamed token here
(event loop, h11, line iteration), taken from the engine's 2 threads mid-step, so it measured part of itself.
This one blocks in `recv` and does per event only the chunked-body framing and one `json.loads`, as a remote
client's cost would not show at all. Results and token counting are those of bench/serve.py's client.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from ironlm.bench.serve import RequestResult


class _Body:
    """The response after its head: decodes `Transfer-Encoding: chunked` (or reads a plain body) into bytes."""

    def __init__(self, sock: socket.socket, rest: bytes, chunked: bool) -> None:
        self.sock, self.buf, self.chunked = sock, rest, chunked
        self.done = False

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buf += data
        return True

    def read(self) -> bytes:
        """The next piece of the body (b"" at its end)."""
        if self.done:
            return b""
        if not self.chunked:
            if not self.buf and not self._fill():
                self.done = True
                return b""
            out, self.buf = self.buf, b""
            return out
        while b"\r\n" not in self.buf:
            if not self._fill():
                raise ConnectionError("connection closed inside a chunk header")
        head, _, self.buf = self.buf.partition(b"\r\n")
        size = int(head.split(b";", 1)[0], 16)
        while len(self.buf) < size + 2:
            if not self._fill():
                raise ConnectionError("connection closed inside a chunk")
        out, self.buf = self.buf[:size], self.buf[size + 2:]
        if size == 0:
            self.done = True
        return out


def _head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("connection closed before the response head")
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, rest


def stream_request(url: str, payload: dict[str, Any], res: RequestResult, timeout_s: float) -> None:
    """POST `payload` to `url` (an http:// /v1/completions URL) and fill `res` as bench/serve.py's client does."""
    parts = urlsplit(url)
    body = json.dumps(payload).encode()
    request = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
               f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    res.start = time.perf_counter()
    try:
        _exchange(parts.hostname or "127.0.0.1", parts.port or 80, request + body, res, timeout_s)
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a malformed response
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.end = time.perf_counter()
    res.latency = res.end - res.start
    if res.error:  # an HTTP error, one in the stream, or a broken connection: not a success
        return
    if not res.output_tokens:
        res.output_tokens = res.token_chunks
    res.success = res.token_chunks > 0
    if not res.success:
        res.error = "no tokens streamed"


def _exchange(host: str, port: int, message: bytes, res: RequestResult, timeout_s: float) -> None:
    last = res.start
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(message)
        status, headers, rest = _head(sock)
        reader = _Body(sock, rest, headers.get("transfer-encoding", "").lower() == "chunked")
        if status != 200:
            text = b"".join(iter(reader.read, b"")).decode(errors="replace")
            res.error = f"HTTP {status}: {text[:300]}"
            return
        pending = b""
        while True:
            piece = reader.read()
            if not piece:
                break
            pending += piece
            now = time.perf_counter()  # when the bytes arrived, before any parsing
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data:"):
                    continue
                data = event[5:].strip()
                if data == b"[DONE]":
                    return
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:300]
                    return
                last = res.take(obj, now, last)
