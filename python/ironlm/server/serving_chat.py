"""POST /v1/chat/completions: the model's chat template, then one engine request with n sequences.

Streaming follows OpenAI exactly: a role chunk per choice, content deltas, a finish chunk with an empty
delta, an optional usage chunk with no choices (stream_options.include_usage), then `data: [DONE]`. With
stream_options.continuous_usage_stats too, every chunk carries its choice's usage so far, as vLLM does.
With a reasoning parser (server/reasoning.py) the `<think>` part goes to `reasoning_content` and `reasoning`
(deltas likewise) and only the rest is content, which is what tool calls are parsed from.
"""

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
from ironlm.server import reasoning
from ironlm.server.errors import APIError
from ironlm.server.logprobs import chat_logprobs, prompt_logprobs_wire
from ironlm.server.prompt_limits import chat_prompt_ids
from ironlm.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    UsageInfo,
)
from ironlm.server.serving_beam import beam_chat
from ironlm.server.serving_common import (
    SSE_DONE,
    EngineStreamingResponse,
    check_logprobs_budget,
    check_prompt_logprobs_budget,
    constraint_error,
    continuous_usage,
    final_outputs,
    logprob_entries,
    running_usage,
    sampling_params,
    sse,
    sse_error,
    start_streams,
    usage,
)
from ironlm.server.shedding import Shedder
from ironlm.structured.tool_output import ToolOutput
from ironlm.structured.tool_parsers import ToolParser, get_tool_parser
from ironlm.structured.tools import forced_call_constraint, template_tools


class ChatHandler:
    def __init__(self, engine: EngineClient, model_name: str, shedder: Shedder | None = None,
                 tool_call_parser: str = "auto", max_logprobs: int = ServerConfig.max_request_logprobs,
                 reasoning_parser: str = "none", operator_template: str | None = None) -> None:
        """`tool_call_parser`, `max_logprobs`, `reasoning_parser`: ServerConfig's (max_request_logprobs: see
        check_logprobs_budget); `operator_template`: --chat-template's text, which auto-detection reads first."""
        self.engine, self.model_name, self.shedder = engine, model_name, shedder
        self.tool_call_parser, self.max_logprobs = tool_call_parser, max_logprobs
        self._parser: ToolParser | None = None
        template = operator_template or getattr(engine.tokenizer, "chat_template", None)
        self.reasoning = reasoning.resolve(reasoning_parser, template if isinstance(template, str) else None)

    @property
    def parser(self) -> ToolParser:
        if self._parser is None:
            template = getattr(self.engine.tokenizer, "chat_template", None)
            model_type = getattr(self.engine.model_config, "model_type", None)
            self._parser = get_tool_parser(self.tool_call_parser, template if isinstance(template, str) else None,
                                           model_type)
        return self._parser

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        try:
            if req.tools:
                # Only with tools: templates without tool support, and engines without the keyword, still work.
                tools = template_tools(req.function_tools())
                return self.engine.apply_chat_template(req.message_dicts(), req.add_generation_prompt,
                                                       tools=tools, **(req.chat_template_kwargs or {}))
            return self.engine.apply_chat_template(req.message_dicts(), req.add_generation_prompt,
                                                   **(req.chat_template_kwargs or {}))
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def tool_outputs(self, req: ChatCompletionRequest) -> list[ToolOutput] | None:
        """One per choice when tools shape the answer (None: plain content)."""
        choice = req.tool_choice_resolved()
        if choice.mode == "none":
            return None
        return [ToolOutput(choice, self.parser if choice.mode == "auto" else None, parallel=req.parallel_tool_calls)
                for _ in range(req.n)]

    def splitter(self, req: ChatCompletionRequest, prompt: list[int]) -> reasoning.ReasoningSplitter | None:
        """How this request's outputs split into reasoning and content (None: no reasoning parser, or a forced
        tool call, whose grammar makes the whole output the call)."""
        if self.reasoning == "none" or req.tool_choice_resolved().mode in ("named", "required"):
            return None
        constraint = req.structured()[0]
        state = reasoning.prompt_state(self.engine.tokenizer, prompt)
        if constraint is not None and not reasoning.can_close(constraint):
            state = "closed"  # a grammar that cannot end a think block writes the answer, whatever the prompt opened
        return reasoning.ReasoningSplitter(self.reasoning, state, constrained=constraint is not None)

    async def __call__(self, req: ChatCompletionRequest, request: Request) -> Response:
        if req.use_beam_search:
            return await beam_chat(self, req, request, req.request_id or f"chatcmpl-{uuid.uuid4().hex}")
        rid, prompt, streams = await self.start(req, request)
        if req.stream:
            return EngineStreamingResponse(self._stream(req, rid, streams[0], prompt), streams)
        (out,) = await final_outputs(streams, request)
        tools = self.tool_outputs(req)
        splitter = self.splitter(req, prompt)
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            part = reasoning.Split(None, c.text) if splitter is None else splitter.split(c.text, done=True)
            # Only the content part can hold tool calls; with a reasoning part, no content is null, not "".
            text: str | None = part.content if part.content or part.reasoning is None else None
            if tools is None:
                message, finish = ChatResponseMessage(content=text), c.finish_reason
            else:
                m = tools[c.index].final(part.content, c.finish_reason)
                message = ChatResponseMessage(content=m.content if m.content or part.reasoning is None else None,
                                              tool_calls=[t.to_openai() for t in m.tool_calls] or None)
                finish = m.finish_reason
            message.reasoning_content = message.reasoning = part.reasoning
            choices.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(req, c, 0),
                                      finish_reason=finish, stop_reason=c.stop_reason))
        body = ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                      usage=UsageInfo(**usage([out])),
                                      prompt_logprobs=prompt_logprobs_wire(out.prompt_logprobs))
        dumped = body.model_dump()
        if splitter is None:  # without a reasoning parser the message keeps OpenAI's own fields only
            for choice in dumped["choices"]:
                for key in ("reasoning_content", "reasoning"):
                    choice["message"].pop(key, None)
        return JSONResponse(dumped)

    async def start(self, req: ChatCompletionRequest,
                    request: Request) -> tuple[str, list[int], list[RequestStream]]:
        """Render, check and queue the request: (request id, prompt ids, its engine stream). The Responses and
        Anthropic Messages handlers start their requests here too, so all three share one generation path."""
        prompt = await chat_prompt_ids(self.engine, req, request, self.prompt_ids)  # off the event loop
        max_tokens = req.max_completion_tokens or req.max_tokens  # None: up to max_model_len
        if max_tokens is None and len(prompt) >= self.engine.max_model_len:
            raise APIError(400, f"messages: the prompt ({len(prompt)} tokens) leaves no room to generate within "
                           f"max_model_len ({self.engine.max_model_len})", param="messages",
                           code="context_length_exceeded")
        constraint, source = req.structured()
        forced = forced_call_constraint(req.function_tools(), req.tool_choice_resolved(), req.parallel_tool_calls)
        if forced is not None:
            constraint, source = forced, "tools"  # a tool's parameters schema that does not compile
        kwargs = {**req.sampling_kwargs(), "max_tokens": max_tokens,
                  "logprobs": (req.top_logprobs or 0) if req.logprobs else None, "structured_outputs": constraint}
        if req.tool_choice_resolved().mode == "auto" and self.parser.keeps_special_tokens(self.engine.tokenizer):
            kwargs["skip_special_tokens"] = False  # the call marker is a special token (Mistral's [TOOL_CALLS])
        params = sampling_params(kwargs)
        top = (req.top_logprobs or 0) if req.logprobs else None
        room = max_tokens or self.engine.max_model_len - len(prompt)
        check_logprobs_budget(self.max_logprobs, prompts=1, n=req.n, max_tokens=room, top=top,
                              param="top_logprobs" if req.top_logprobs else "logprobs")
        check_prompt_logprobs_budget(self.max_logprobs, prompt_tokens=len(prompt), top=req.prompt_logprobs, copies=1,
                                     generated=logprob_entries(prompts=1, n=req.n, max_tokens=room, top=top),
                                     param="prompt_logprobs")
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            streams = await start_streams(self.engine, rid, [prompt], params, req, prompt_param="messages",
                                          shedder=self.shedder, tenant_header=request.headers.get("x-tenant"))
        except APIError as err:
            raise constraint_error(err, source) from None
        return rid, prompt, streams

    def _logprobs(self, req: ChatCompletionRequest, c: Any, start: int) -> dict | None:
        if not req.logprobs:
            return None
        return chat_logprobs(c, start, self.engine.tokenizer, req.top_logprobs or 0)

    async def _stream(self, req: ChatCompletionRequest, rid: str, stream: RequestStream,
                      prompt: list[int]) -> AsyncIterator[str]:
        created = int(time.time())
        prompt_tokens = len(prompt)
        splitter = self.splitter(req, prompt)
        thinking = [reasoning.ReasoningStream(splitter) for _ in range(req.n)] if splitter is not None else None
        continuous = continuous_usage(req)
        generated = [0] * req.n  # tokens of each choice so far, for continuous usage stats

        def chunk(index: int, delta: dict, lp: Any = None, finish: str | None = None, stop: Any = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop
            obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                   "model": self.model_name, "choices": [choice]}
            if req.include_usage:
                obj["usage"] = running_usage(prompt_tokens, generated[index]) if continuous else None
            return sse(obj)

        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        done = [False] * req.n
        tools = self.tool_outputs(req)
        last: RequestOutput | None = None
        try:
            # The role chunks go out before the first token: the client sees the stream open at once.
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for out in stream:
                last = out
                if out.error:
                    raise APIError(500, f"the engine failed this request: {out.error}", code="engine_error")
                for c in out.outputs:
                    i = c.index
                    if done[i]:
                        continue
                    generated[i] = len(c.token_ids)
                    text, thought = c.text, False
                    if thinking is not None:
                        r_delta, text = thinking[i].feed(c.text, c.finish_reason is not None)
                        if r_delta:
                            thought = True
                            lp = self._logprobs(req, c, sent_tokens[i]) if tools is None else None
                            yield chunk(i, {"reasoning_content": r_delta, "reasoning": r_delta}, lp)
                            sent_tokens[i] = len(c.token_ids)
                    if tools is not None:
                        deltas, finish = tools[i].deltas(text, c.finish_reason)
                        for d in deltas:
                            yield chunk(i, d)
                        if finish is not None:
                            done[i] = True
                            yield chunk(i, {}, None, finish, c.stop_reason)
                        continue
                    delta = text[sent_text[i]:]
                    if delta or (len(c.token_ids) > sent_tokens[i] and not thought):
                        yield chunk(i, {"content": delta}, self._logprobs(req, c, sent_tokens[i]))
                    sent_text[i], sent_tokens[i] = len(text), len(c.token_ids)
                    if c.finish_reason is not None:
                        done[i] = True
                        yield chunk(i, {}, None, c.finish_reason, c.stop_reason)
            if req.include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": self.model_name, "choices": [], "usage": usage([last])})
        except Exception as exc:  # noqa: BLE001 - engine failure mid-stream: in-band error, then a clean end
            yield sse_error(exc)
        finally:
            stream.close()
        yield SSE_DONE
