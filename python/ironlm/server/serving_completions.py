"""POST /v1/completions: one engine request per prompt, choices numbered prompt * n + index.

`echo` with `logprobs` returns the prompt's token logprobs first in the legacy `logprobs` object (None for the first
token), computed by the engine as prompt logprobs; `max_tokens: 0` with echo returns the prompt alone, as OpenAI's
legacy API did (the engine samples one token, which is dropped, as in vLLM). `prompt_logprobs` (vLLM's extension)
comes back on each choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ironlm.config import ServerConfig
from ironlm.engine import EngineClient, RequestStream
from ironlm.engine.outputs import CompletionOutput, RequestOutput
from ironlm.server.errors import APIError
from ironlm.server.logprobs import (
    completion_logprobs,
    echo_logprobs,
    join_legacy,
    prompt_logprobs_wire,
    prompt_offsets,
)
from ironlm.server.prompt_limits import completion_prompts
from ironlm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from ironlm.server.serving_beam import beam_completions
from ironlm.server.serving_common import (
    SSE_DONE,
    EngineStreamingResponse,
    SSEChunks,
    check_logprobs_budget,
    check_prompt_logprobs_budget,
    constraint_error,
    continuous_usage,
    decode,
    final_outputs,
    logprob_entries,
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
        if req.use_beam_search:
            rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
            return await beam_completions(self.engine, self.model_name, req, request, rid, self.shedder)
        echo_only = req.max_tokens == 0  # with echo (protocol checks it): the prompt alone comes back
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        prompt_top = _prompt_top(req)
        params = sampling_params({**req.sampling_kwargs(), "max_tokens": max(1, max_tokens),
                                  "logprobs": req.logprobs, "prompt_logprobs": prompt_top})
        source = req.structured()[1]
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        check_logprobs_budget(self.max_logprobs, prompts=len(req.prompts()), n=req.n, max_tokens=max_tokens,
                              top=req.logprobs, param="logprobs")
        prompts = await completion_prompts(self.engine, req, request)
        # Each choice of an echo carries the prompt's logprobs; vLLM's prompt_logprobs field does once per prompt.
        copies = (req.n if req.echo and req.logprobs is not None else 0) + (req.prompt_logprobs is not None)
        check_prompt_logprobs_budget(
            self.max_logprobs, prompt_tokens=sum(map(_prompt_len, prompts)), top=prompt_top, copies=copies,
            generated=logprob_entries(prompts=len(prompts), n=req.n, max_tokens=max_tokens, top=req.logprobs),
            param="logprobs" if req.prompt_logprobs is None else "prompt_logprobs")
        try:
            streams = await start_streams(self.engine, rid, prompts, params, req, shedder=self.shedder,
                                          tenant_header=request.headers.get("x-tenant"))
        except APIError as err:
            raise constraint_error(err, source) from None
        if req.stream:
            return EngineStreamingResponse(self._stream(req, rid, streams), streams)
        outputs = await final_outputs(streams, request)
        if echo_only:
            outputs = [_prompt_only(out) for out in outputs]
        offsets = await self._offsets(req, outputs)
        choices = []
        for i, out in enumerate(outputs):
            prefix = self._prompt_text(out) if req.echo else ""
            plp = prompt_logprobs_wire(out.prompt_logprobs) if req.prompt_logprobs is not None else None
            for c in sorted(out.outputs, key=lambda c: c.index):
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prefix + c.text,
                                                logprobs=self._logprobs(req, out, c, 0, len(prefix), req.echo,
                                                                        offsets[i])[0],
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=plp))
        body = CompletionResponse(id=rid, model=self.model_name, choices=choices,
                                  usage=UsageInfo(**usage(outputs)))
        return JSONResponse(body.model_dump())

    def _logprobs(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, start: int, offset: int,
                  echo: bool, prompt_offsets: list[int] | None = None) -> tuple[dict | None, int]:
        """Legacy logprobs of tokens [start:] from text offset `offset`, after the prompt's when `echo` (the first
        chunk of an echoed choice; `prompt_offsets`: see `_offsets`); returns them and the next offset."""
        if req.logprobs is None:
            return None, offset
        lp, end = completion_logprobs(c, start, self.engine.tokenizer, offset)
        if echo:
            lp = join_legacy(echo_logprobs(out, self.engine.tokenizer, req.logprobs, prompt_offsets), lp)
        return lp, end

    async def _offsets(self, req: CompletionRequest, outputs: list[RequestOutput]) -> list[list[int] | None]:
        """Each echoed prompt's token offsets in its text (tokenized again, in a worker thread)."""
        if not req.echo or req.logprobs is None:
            return [None] * len(outputs)
        tokenizer = self.engine.tokenizer
        return await asyncio.to_thread(lambda: [prompt_offsets(out, tokenizer) for out in outputs])

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else decode(self.engine.tokenizer, out.prompt_token_ids)

    async def _stream(self, req: CompletionRequest, rid: str, streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        continuous = continuous_usage(req)
        prompt_tokens: dict[int, int] = {}  # per choice index, for continuous usage stats
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        prompt_offs: dict[int, list[int] | None] = {}  # per prompt (stream), for echo
        done: set[int] = set()
        last: list[RequestOutput | None] = [None] * len(streams)

        template = SSEChunks({"id": rid, "object": "text_completion", "created": created, "model": self.model_name},
                             ("text", "logprobs", "finish_reason", "stop_reason"), req.include_usage)

        def chunk(idx: int, text: str, lp: Any, finish: str | None = None, stop: Any = None,
                  plp: RequestOutput | None = None) -> str:
            if plp is None:  # every token but a choice's first with prompt_logprobs: the template, same bytes
                running = running_usage(prompt_tokens[idx], sent_tokens[idx]) if continuous else None
                return template.chunk(idx, (text, lp, finish, stop), running)
            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop,
                      "prompt_logprobs": prompt_logprobs_wire(plp.prompt_logprobs)}  # vLLM's, with the first chunk
            obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                   "model": self.model_name, "choices": [choice]}
            if req.include_usage:
                obj["usage"] = running_usage(prompt_tokens[idx], sent_tokens[idx]) if continuous else None
            return sse(obj)

        try:
            async for i, out in merge_streams(streams):
                if out.error:
                    raise APIError(500, f"the engine failed this request: {out.error}", code="engine_error")
                if req.max_tokens == 0:
                    out = _prompt_only(out)
                last[i] = out
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
                        echo = first and req.echo
                        if echo and i not in prompt_offs:
                            prompt_offs[i] = (await self._offsets(req, [out]))[0]
                        lp, offsets[idx] = self._logprobs(req, out, c, start_tok, offsets.get(idx, len(prefix)), echo,
                                                          prompt_offs.get(i))
                        yield chunk(idx, delta, lp, plp=out if first and req.prompt_logprobs is not None else None)
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


def _prompt_top(req: CompletionRequest) -> int | None:
    """The prompt logprobs the engine computes: vLLM's `prompt_logprobs`, else echo's `logprobs`."""
    if req.prompt_logprobs is not None:
        return max(req.prompt_logprobs, req.logprobs or 0) if req.echo else req.prompt_logprobs
    return req.logprobs if req.echo else None


def _prompt_len(prompt: str | list[int] | dict[str, Any]) -> int:
    if isinstance(prompt, dict):
        return len(prompt["prompt_token_ids"])
    return len(prompt)  # token ids: the texts came back tokenized (completion_prompts)


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """`out` without its generated token (max_tokens 0 with echo): what the client gets is the prompt alone."""
    outputs = [dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None,
                                   logprobs=None if c.logprobs is None else [],
                                   finish_reason="length" if c.finish_reason in ("stop", "length")
                                   else c.finish_reason, stop_reason=None)
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)
