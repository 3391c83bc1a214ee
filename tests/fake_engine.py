"""A deterministic stand-in for LLMEngine (same contract), with fault injection.

Used by the AsyncLLMEngine unit tests, which need control the real engine cannot give (a gate inside the
step, a step that raises from the engine's own bookkeeping, exact letters to assert on); the server tests
run the real engine with faults injected into its forward (server_utils.ForwardFaults). Tokens are bytes;
the "model" emits the letter after the last token (greedy) or a seeded pseudo-random letter (temperature > 0).

It follows the real engine's rules where they are observable: a step first admits waiting requests up to
`max_num_seqs` (arrival order), and `max_queue_len` bounds the *waiting* requests only, as the core's queue
does, so a full batch never makes a new request fail while the queue has room.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable

from ironlm import _core
from ironlm.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

EOS = 0


class FakeTokenizer:
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return 256


class FakeEngine:
    def __init__(self, max_model_len: int = 256, num_blocks: int = 64, block_size: int = 16,
                 max_queue_len: int | None = None, max_num_seqs: int = 256, step_delay: float = 0.0) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_queue_len = max_queue_len
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.requests: dict[str, dict] = {}  # arrival order; the first `len(running)` were admitted
        self.running: list[str] = []
        self.raise_in_step: BaseException | None = None  # step() raises this (every time while set)
        self.fail_forward_once = False  # step() fails its requests the way LLMEngine does
        self.gate = threading.Event()  # cleared: step() blocks (to hold requests in flight)
        self.gate.set()
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.thread_ids: set[int] = set()

    # ---- contract ---------------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params=None, *, priority=0, deadline=None, queue_timeout=None,
                    arrival_time=None, cache_salt=None, grammar=None, tenant=None) -> str:
        from ironlm.sampling_params import SamplingParams

        self.thread_ids.add(threading.get_ident())
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                             f"({self.max_model_len})")
        if self.max_queue_len is not None and self.num_waiting >= self.max_queue_len:
            raise _core.QueueFullError(f"the waiting queue already holds max_queue_len ({self.max_queue_len}) "
                                       "requests")
        if request_id in self.requests:
            raise _core.DuplicateRequestError(request_id)
        arrival = _core.monotonic() if arrival_time is None else arrival_time
        self.requests[request_id] = {
            "prompt": prompt if isinstance(prompt, str) else None, "ids": ids, "params": params,
            "max_tokens": max_tokens, "metrics": RequestMetrics(arrival_time=arrival),
            "seqs": [{"tokens": [], "lps": [], "finish": None, "stop": None,
                      "rng": random.Random(None if params.seed is None else params.seed + i)}
                     for i in range(params.n)]}
        self.prompt_tokens_total += len(ids)
        return request_id

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        self.thread_ids.add(threading.get_ident())
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self._drop(rid)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    def _drop(self, rid: str) -> None:
        self.requests.pop(rid, None)
        if rid in self.running:
            self.running.remove(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        for rid in self.requests:  # admission comes first, as in the core's schedule()
            if len(self.running) >= self.max_num_seqs:
                break
            if rid not in self.running:
                self.running.append(rid)
        self.gate.wait(10)
        if self.step_delay:
            threading.Event().wait(self.step_delay)
        if self.raise_in_step is not None:
            raise self.raise_in_step
        now = _core.monotonic()
        outputs = []
        for rid in list(self.running):
            req = self.requests[rid]
            m = req["metrics"]
            m.first_scheduled_time = m.first_scheduled_time or now
            if self.fail_forward_once:
                for s in req["seqs"]:
                    s["finish"] = s["finish"] or "error"
                outputs.append(self._output(rid, req, error="RuntimeError: injected forward failure"))
                self._drop(rid)
                continue
            for s in req["seqs"]:
                if s["finish"] is None:
                    self._advance(req, s)
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            out = self._output(rid, req)
            if out.finished:
                m.finished_time = now
                out.metrics = m
                self._drop(rid)
            outputs.append(out)
        self.fail_forward_once = False
        return outputs

    def _advance(self, req: dict, s: dict) -> None:
        p = req["params"]
        last = (s["tokens"] or req["ids"])[-1]
        tok = 97 + (last - 96) % 26 if p.temperature < 1e-5 else 97 + s["rng"].randrange(26)
        s["tokens"].append(tok)
        s["lps"].append({tok: Logprob(-0.5, rank=1, decoded_token=chr(tok)),
                         **{97 + (tok - 96) % 26 + j: Logprob(-2.0 - j, rank=2 + j,
                                                              decoded_token=chr(97 + (tok - 96) % 26 + j))
                            for j in range(max(0, (p.logprobs or 0) - 1))}})
        self.generation_tokens_total += 1
        text = self.tokenizer.decode(s["tokens"])
        for stop in p.stop_strings:
            if stop in text:
                s["finish"], s["stop"] = "stop", stop
                return
        if tok in (p.stop_token_ids or ()):
            s["finish"], s["stop"] = "stop", tok
        elif len(s["tokens"]) >= req["max_tokens"]:
            s["finish"] = "length"

    def _output(self, rid: str, req: dict, error: str | None = None) -> RequestOutput:
        outs = []
        for i, s in enumerate(req["seqs"]):
            text = self.tokenizer.decode(s["tokens"])
            if s["finish"] == "stop" and isinstance(s["stop"], str):
                text = text[: text.index(s["stop"])]
            outs.append(CompletionOutput(i, text, list(s["tokens"]), -0.5 * len(s["tokens"]),
                                         list(s["lps"]) if req["params"].logprobs is not None else None,
                                         s["finish"], s["stop"]))
        finished = all(o.finish_reason for o in outs)
        return RequestOutput(rid, req["prompt"], req["ids"], outs, finished, req["metrics"], error=error)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not messages:
            raise ValueError("messages must be a non-empty list")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.tokenizer.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def stats(self) -> dict:
        used = sum(-(-(len(r["ids"]) + max(len(s["tokens"]) for s in r["seqs"])) // self.block_size)
                   for r in (self.requests[rid] for rid in self.running))  # waiting requests hold no blocks
        return {"num_requests_running": len(self.running), "num_requests_waiting": self.num_waiting,
                "kv_cache_usage_perc": used / self.num_blocks, "prefix_cache_queries": self.prompt_tokens_total,
                "prefix_cache_hits": 0, "num_preemptions": 0, "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total, "blocks_total": self.num_blocks,
                "blocks_free": self.num_blocks - used, "blocks_used": used, "blocks_cached": 0}
