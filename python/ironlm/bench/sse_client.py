"""Light streaming clients: HTTP/1.1 straight over a socket, SSE events timed as they arrive.

The bench clients run on the same 2 cores as the server they measure. httpx's async client spent ~0.5-0.9 ms of
CPU per streamed token of a single stream here (event loop, h11, line iteration), taken from the engine's two
threads mid-step, so it measured part of itself; over W at 64 concurrent streams (8,885 tokens) it took 0.87-0.90 s
of CPU against 0.26-0.27 s for `astream_request` (2-core Zen 4, `ironlm bench serve`'s `cpu` record). These
clients do per event only the chunked-body framing (`SseDecoder`, no I/O of its own) and one `json.loads`, closer
to a remote client, whose cost would not show at all:
- `stream_request` blocks in `recv` (one stream at a time: `ironlm bench latency --streamed`);
- `astream_request` runs on asyncio's streams (many at once: `ironlm bench serve`, its default client).
Both fill a `RequestResult`, the record every bench client keeps of a request.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

HEAD_LIMIT = 65536  # bytes of a response head; a server sending more is broken, not slow


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_tokens: int = 0
    token_chunks: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    error: str = ""
    retries: int = 0

    def take(self, event: dict[str, Any], now: float, last: float) -> float:
        """One SSE event (its usage, its token chunks) into the result, at time `now`; returns when the last
        token chunk so far arrived (`last` if this event carried none)."""
        usage = event.get("usage")
        if usage:
            self.output_tokens = int(usage.get("completion_tokens", 0))
        for choice in event.get("choices") or ():
            if choice.get("text") or choice.get("finish_reason") is None:  # a token, not the end marker
                if self.token_chunks == 0:
                    self.ttft = now - self.start
                else:
                    self.itl.append(now - last)
                self.token_chunks += 1
                last = now
        return last

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class SseDecoder:
    """A response body in (`Transfer-Encoding: chunked` or plain), complete SSE events' data out, as bytes."""

    def __init__(self, chunked: bool, length: int | None = None) -> None:
        self.chunked, self.length = chunked, length  # length: a plain body's Content-Length, if sent
        self.seen = 0  # bytes of a plain body so far
        self.raw = b""  # undecoded chunked framing
        self.left = 0  # bytes of the current chunk still to come (chunked only)
        self.text = b""  # decoded body not yet split into events
        self.ended = False  # the zero-size chunk seen

    def feed(self, data: bytes) -> list[bytes]:
        """The data fields of the events completed by `data` (`[DONE]` included), in order. Lines may end in LF or
        CRLF (SSE allows both)."""
        self.unframe(data)
        if b"\r\n" in self.text:
            self.text = self.text.replace(b"\r\n", b"\n")
        *events, self.text = self.text.split(b"\n\n")
        return [e[5:].strip() for e in events if e.startswith(b"data:")]

    def unframe(self, data: bytes) -> None:
        """`data` decoded onto `text`, not split into events (an error response's body)."""
        if self.chunked:
            self.raw += data
            self._unchunk()
        else:
            self.text += data
            self.seen += len(data)

    @property
    def complete(self) -> bool:
        """Whether the body is known to be whole: a chunked one's end seen, a plain one's Content-Length read (without
        one, a plain body ends with the connection)."""
        if self.chunked:
            return self.ended
        return self.length is not None and self.seen >= self.length

    def _unchunk(self) -> None:
        raw = self.raw
        while raw and not self.ended:
            if self.left > 0:
                take = raw[:self.left]
                self.text += take
                self.left -= len(take)
                raw = raw[len(take):]
                if self.left:
                    break
                self.left = -2  # the CRLF after the chunk's data
            if self.left < 0:
                if len(raw) < -self.left:
                    break
                raw = raw[-self.left:]
                self.left = 0
                continue
            line, sep, rest = raw.partition(b"\r\n")
            if not sep:
                if len(raw) > 1024:
                    raise ValueError("chunk header over 1 KiB")
                break
            size = int(line.split(b";", 1)[0], 16)
            raw = rest
            if size == 0:
                self.ended = True
            self.left = size
        self.raw = raw


def request_bytes(url: str, payload: dict[str, Any]) -> tuple[str, int, bytes]:
    """(host, port, the whole POST) for `payload` as JSON to `url` (http:// only)."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"the light client speaks plain http only, got {url!r}")
    body = json.dumps(payload).encode()
    head = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return parts.hostname or "127.0.0.1", parts.port or 80, head + body


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers


def body_decoder(headers: dict[str, str]) -> SseDecoder:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return SseDecoder(chunked=True)
    length = headers.get("content-length")
    return SseDecoder(chunked=False, length=int(length) if length is not None else None)


def take_events(datas: list[bytes], now: float, res: RequestResult, last: float) -> tuple[bool, float]:
    """Events' data into `res` at time `now`: (whether the stream is over, the time of the last token chunk)."""
    for data in datas:
        if data == b"[DONE]":
            return True, last
        obj = json.loads(data)
        if "error" in obj:  # mid-stream: tokens may have been sent already
            res.error = str(obj["error"])[:300]
            return True, last
        last = res.take(obj, now, last)
    return False, last


def finish(res: RequestResult) -> None:
    res.end = time.perf_counter()
    res.latency = res.end - res.start
    if res.error:  # an HTTP error, one in the stream, or a broken connection: not a success
        return
    if not res.output_tokens:  # a server that sends no usage: one token per chunk
        res.output_tokens = res.token_chunks
    res.success = res.token_chunks > 0
    if not res.success:
        res.error = "no tokens streamed"


def stream_request(url: str, payload: dict[str, Any], res: RequestResult, timeout_s: float) -> None:
    """POST `payload` to `url` (an http:// /v1/completions URL) and fill `res` as bench/serve.py's client does."""
    res.start = time.perf_counter()
    try:
        host, port, message = request_bytes(url, payload)
        _exchange(host, port, message, res, timeout_s)
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a malformed response
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finish(res)


def _exchange(host: str, port: int, message: bytes, res: RequestResult, timeout_s: float) -> None:
    last = res.start
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(message)
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("connection closed before the response head")
            buf += data
            if len(buf) > HEAD_LIMIT and b"\r\n\r\n" not in buf:
                raise ValueError(f"response head over {HEAD_LIMIT} bytes")
        head, _, rest = buf.partition(b"\r\n\r\n")
        status, headers = parse_head(head)
        decoder = body_decoder(headers)
        if status != 200:
            decoder.unframe(rest)
            while not decoder.complete and (data := sock.recv(65536)):
                decoder.unframe(data)
            res.error = f"HTTP {status}: {decoder.text.decode(errors='replace')[:300]}"
            return
        data = rest
        while True:
            now = time.perf_counter()  # when the bytes arrived, before any parsing
            done, last = take_events(decoder.feed(data), now, res, last)
            if done or decoder.complete:
                return
            data = sock.recv(65536)
            if not data:
                return


async def astream_request(url: str, payload: dict[str, Any], res: RequestResult,
                          timeout_s: float) -> tuple[bool, str | None]:
    """One try of a streamed POST into `res`, on asyncio: (whether to retry it, the server's Retry-After if any).

    A 503 or a refused connection (nothing was sent) may be retried; an error mid-stream never is. `timeout_s`
    bounds the whole exchange."""
    res.error = ""
    try:
        host, port, message = request_bytes(url, payload)
        retry = await asyncio.wait_for(_aexchange(host, port, message, res), timeout_s)
    except ConnectionRefusedError as exc:  # nothing was sent: retrying is safe
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return True, None
    except (OSError, ValueError, KeyError, TypeError, asyncio.TimeoutError, asyncio.IncompleteReadError,
            asyncio.LimitOverrunError) as exc:  # counted as a failed request, never fatal to the benchmark
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        retry = None
    if retry is not None:  # an HTTP error status
        return retry
    finish(res)
    return False, None


async def _aexchange(host: str, port: int, message: bytes, res: RequestResult) -> tuple[bool, str | None] | None:
    """The exchange into `res`: None once the stream is read, else (retry?, Retry-After) of an HTTP error status."""
    last = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, limit=HEAD_LIMIT)
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(message)
        head = await reader.readuntil(b"\r\n\r\n")
        status, headers = parse_head(head[:-4])
        decoder = body_decoder(headers)
        if status != 200:
            while not decoder.complete and (data := await reader.read(65536)):
                decoder.unframe(data)
            res.error = f"HTTP {status}: {decoder.text.decode(errors='replace')[:300]}"
            return status == 503, headers.get("retry-after")
        while not decoder.complete:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()  # when the bytes arrived, before any parsing
            done, last = take_events(decoder.feed(data), now, res, last)
            if done:
                break
        return None
    finally:
        writer.close()
