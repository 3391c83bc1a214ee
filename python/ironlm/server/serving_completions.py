"""POST /v1/completions: one engine request per prompt, choices numbered prompt * n + index."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ironlm.config import ServerConfig
from ironlm.engine import EngineClient, RequestStream
from ironlm.engine.outputs import RequestOutput
from ironlm.server.errors import APIError
from ironlm.server.logprobs import completion_logprobs
from ironlm.server.prompt_limits import completion_prompts
from ironlm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from ironlm.server.serving_common import (
    SSE_DONE,
    EngineStreamingResponse,
    check_logprobs_budget,
    constraint_error,
    continuous_usage,
    decode,
    final_outputs,
    merge_streams,
    running_usage,
    sampling_params,
    sse,
    sse_error,
    start_streams,
    usage,
)
from ironlm.server.shedding import Shedder


class CompletionHandler:
    def __init__(self, engine: EngineClient, model_name: str, shedder: Shedder | None = None,
                 max_logprobs: int = ServerConfig.max_request_logprobs) -> None:
        """`max_logprobs`: ServerConfig.max_request_logprobs (see check_logprobs_budget)."""
        self.engine, self.model_name, self.shedder = engine, model_name, shedder
        self.max_logprobs = max_logprobs

    async def __call__(self, req: CompletionRequest, request: Request) -> Response:
        max_tokens = req.max_tokens or 16
        params = sampling_params({**req.sampling_kwargs(), "max_tokens": max_tokens, "logprobs": req.logprobs})
        source = req.structured()[1]
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        check_logprobs_budget(self.max_logprobs, prompts=len(req.prompts()), n=req.n, max_tokens=max_tokens,
                              top=req.logprobs, param="logprobs")
        prompts = await completion_prompts(self.engine, req, request)
        try:
            streams = await start_streams(self.engine, rid, prompts, params, req, shedder=self.shedder,
                                          tenant_header=request.headers.get("x-tenant"))
        except APIError as err:
            raise constraint_error(err, source) from None
        if req.stream:
            return EngineStreamingResponse(self._stream(req, rid, streams), streams)
        outputs = await final_outputs(streams, request)
        choices = []
        for i, out in enumerate(outputs):
            prefix = self._prompt_text(out) if req.echo else ""
            for c in sorted(out.outputs, key=lambda c: c.index):
                lp = None
                if req.logprobs is not None:
                    lp, _ = completion_logprobs(c, 0, self.engine.tokenizer, len(prefix))
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        body = CompletionResponse(id=rid, model=self.model_name, choices=choices,
                                  usage=UsageInfo(**usage(outputs)))
        return JSONResponse(body.model_dump())

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else decode(self.engine.tokenizer, out.prompt_token_ids)

    async def _stream(self, req: CompletionRequest, rid: str, streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        continuous = continuous_usage(req)
        prompt_tokens: dict[int, int] = {}  # per choice index, for continuous usage stats
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        done: set[int] = set()
        last: list[RequestOutput | None] = [None] * len(streams)

        def chunk(idx: int, text: str, lp: Any, finish: str | None = None, stop: Any = None) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                   "model": self.model_name, "choices": [
                                       {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish,
                                        "stop_reason": stop}]}
            if req.include_usage:
                obj["usage"] = running_usage(prompt_tokens[idx], sent_tokens[idx]) if continuous else None
            return sse(obj)

        try:
            async for i, out in merge_streams(streams):
                last[i] = out
                if out.error:
                    raise APIError(500, f"the engine failed this request: {out.error}", code="engine_error")
                for c in out.outputs:
                    idx = i * req.n + c.index
                    if idx in done:
                        continue
                    first = idx not in sent_tokens
                    prefix = self._prompt_text(out) if first and req.echo else ""
                    start_tok, start_txt = sent_tokens.get(idx, 0), sent_text.get(idx, 0)
                    delta = prefix + c.text[start_txt:]
                    prompt_tokens[idx] = len(out.prompt_token_ids)
                    sent_tokens[idx], sent_text[idx] = len(c.token_ids), len(c.text)
                    if delta or len(c.token_ids) > start_tok:
                        lp = None
                        if req.logprobs is not None:
                            lp, offsets[idx] = completion_logprobs(c, start_tok, self.engine.tokenizer,
                                                                   offsets.get(idx, len(prefix)))
                        yield chunk(idx, delta, lp)
                    if c.finish_reason is not None:
                        done.add(idx)
                        yield chunk(idx, "", None, c.finish_reason, c.stop_reason)
            if req.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [], "usage": usage(last)})
        except Exception as exc:  # noqa: BLE001 - engine failure mid-stream: tell the client in-band, then end cleanly
            yield sse_error(exc)
        finally:
            for s in streams:
                s.close()
        yield SSE_DONE
