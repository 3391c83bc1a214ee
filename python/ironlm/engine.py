"""LLMEngine: one scheduler call, one forward, one sampler call per step.

The Rust scheduler plans the step and hands back ready-made numpy arrays; this file only moves
them to the device, runs the model and the sampler, and turns sampled tokens into outputs.
The only per-request Python work is detokenization of the tokens a step produced.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

import numpy as np
import torch

from ironlm import _core
from ironlm.attention import AttentionMetadata, get_backend
from ironlm.config import EngineConfig
from ironlm.engine_state import EngineRequest, EngineSequence
from ironlm.kv_cache import allocate_kv_caches, copy_blocks, num_kv_blocks
from ironlm.model import load_model, resolve_device, resolve_dtype
from ironlm.outputs import RequestMetrics, RequestOutput
from ironlm.sampler import Sampler
from ironlm.sampling_params import SamplingParams
from ironlm.timing import StepTimer

logger = logging.getLogger("ironlm.engine")

# On CPU the model's advertised context (e.g. 8k) rarely fits a sensible KV pool; cap the default.
_CPU_DEFAULT_MAX_MODEL_LEN = 8192


class LLMEngine:
    """Drives one model. Not thread-safe: exactly one thread calls its methods."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        t0 = time.perf_counter()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        loaded = load_model(config.model, dtype=self.dtype, device=self.device,
                            attn_backend=get_backend(config.attention_backend, self.device))
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_name = config.served_model_name or loaded.name
        self.model_path = loaded.path
        self.startup_timings: dict[str, float] = {"load_model": time.perf_counter() - t0}

        t0 = time.perf_counter()
        mc = self.model_config
        default_budget = 2048 if self.device.type == "cpu" else 8192
        budget = config.max_num_batched_tokens or max(default_budget, config.max_num_seqs)
        num_blocks = num_kv_blocks(config, mc, self.dtype, self.device, lambda: self._profile_forward(budget))
        self.kv_caches = allocate_kv_caches(mc, num_blocks, config.block_size, self.dtype, self.device)
        self.num_blocks = num_blocks
        self.max_model_len = self._max_model_len(num_blocks * config.block_size)
        self.scheduler = _core.Scheduler(
            num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget, max_model_len=self.max_model_len,
            policy=config.scheduling_policy, enable_prefix_caching=config.enable_prefix_caching,
            max_queue_len=config.max_queue_len,
        )
        self.sampler = Sampler(mc.vocab_size, self.device, max_slots=config.max_num_seqs, seed=config.seed)
        self.startup_timings["kv_cache"] = time.perf_counter() - t0

        self.requests: dict[str, EngineRequest] = {}
        self.seqs: dict[int, EngineSequence] = {}  # slot -> sequence
        self.timer = StepTimer()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self._ids = itertools.count()
        if config.warmup:
            t0 = time.perf_counter()
            self._profile_forward(min(budget, 64))
            self.startup_timings["warmup"] = time.perf_counter() - t0
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d, max_model_len %d", self.model_name,
                    self.device, self.dtype, num_blocks, config.block_size, self.max_model_len)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None, *, priority: int = 0,
                    deadline: float | None = None, timeout: float | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        text, token_ids = self._encode(prompt)
        max_tokens = params.max_tokens
        if max_tokens is None:  # up to max_model_len; a prompt already that long is the core's to reject
            max_tokens = max(1, self.max_model_len - len(token_ids))
        eos = [] if params.ignore_eos else list(self.model_config.eos_token_ids)
        arrival = _core.monotonic() if arrival_time is None else arrival_time
        slots = self.scheduler.add_request(
            request_id, token_ids, max_tokens, min_tokens=params.min_tokens, n=params.n,
            priority=priority, eos_token_ids=eos, stop_token_ids=list(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos, deadline=deadline,
            timeout=timeout if timeout is not None else self.config.request_timeout,
            namespace=cache_salt, arrival_time=arrival,
        )
        request = EngineRequest(request_id, text, token_ids, params, RequestMetrics(arrival_time=arrival))
        for index, slot in enumerate(slots):
            seed = None if params.seed is None else params.seed + index
            self.sampler.add(slot, params, token_ids, self.model_config.eos_token_ids, seed)
            seq = EngineSequence.create(index, slot, request, self.tokenizer)
            request.seqs.append(seq)
            self.seqs[slot] = seq
        self.requests[request_id] = request
        self.prompt_tokens_total += len(token_ids)
        return request_id

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            self.scheduler.abort(rid)
            self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        timer = self.timer
        timer.start()
        plan = self.scheduler.schedule()
        timer.lap("schedule")
        touched: dict[str, EngineRequest] = {}
        for rid, slot, reason in plan.finished:  # timed out while waiting
            self._finish_seq(slot, reason, touched)
        if plan.is_empty:
            return self._collect(touched)
        now = _core.monotonic()
        for rid in plan.new_request_ids:
            request = self.requests.get(rid)
            if request is not None and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        try:
            sampled = self._execute(plan)
        except Exception as exc:  # a failed step fails its requests, never the engine
            logger.exception("step failed; failing the %d sequences in it", plan.num_seqs)
            return self._fail_step(plan, exc, touched)
        finished = {slot: reason for _, slot, reason in self.scheduler.update(sampled.token_ids)}
        timer.lap("update")
        self._postprocess(plan, sampled, finished, touched)
        timer.lap("detokenize")
        outputs = self._collect(touched)
        timer.lap("output")
        self.num_steps += 1
        return outputs

    def _execute(self, plan: _core.SchedulerPlan):
        timer, device = self.timer, self.device
        if len(plan.cow_pairs):
            copy_blocks(self.kv_caches, plan.cow_pairs)
        input_ids = torch.from_numpy(plan.input_ids).to(device, non_blocking=True)
        positions = torch.from_numpy(plan.positions).to(device, non_blocking=True)
        logits_indices = torch.from_numpy(plan.logits_indices).to(device, non_blocking=True)
        meta = AttentionMetadata.from_numpy(
            slot_mapping=plan.slot_mapping, query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens,
            context_lens=plan.context_lens, block_tables=plan.block_tables,
            max_query_len=plan.max_query_len, max_seq_len=plan.max_seq_len, device=device)
        timer.lap("prepare")
        with torch.inference_mode():
            logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
            timer.lap("forward", sync=device)
            out = self.sampler.sample(logits, plan.sample_slots)
        timer.lap("sample")
        return out

    def _postprocess(self, plan, sampled, finished: dict[int, str], touched: dict) -> None:
        now = _core.monotonic()
        tokens = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        self.generation_tokens_total += len(tokens)
        for row, slot in enumerate(plan.sample_slots.tolist()):
            seq = self.seqs.get(slot)
            if seq is None:
                continue
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            top = None if top_ids is None else (top_ids[row], top_lps[row])
            stop_token = finished.get(slot) == "stop"
            stop = seq.append(tokens[row], logprobs[row], top, self.tokenizer, stop_token)
            touched[request.request_id] = request
            if stop is not None:
                seq.stop_reason = stop
                if slot not in finished:
                    self.scheduler.finish(slot, "stop")
                    finished[slot] = "stop"
        for slot, reason in finished.items():
            self._finish_seq(slot, reason, touched)

    def _finish_seq(self, slot: int, reason: str, touched: dict) -> None:
        seq = self.seqs.pop(slot, None)
        if seq is None:
            return
        self.sampler.remove(slot)
        seq.finish(reason, self.model_config.eos_token_ids)
        touched[seq.request.request_id] = seq.request

    def _collect(self, touched: dict[str, EngineRequest]) -> list[RequestOutput]:
        outputs = []
        now = _core.monotonic()
        for rid, request in touched.items():
            if request.finished and request.metrics.finished_time is None:
                request.metrics.finished_time = now
                self.requests.pop(rid, None)
            outputs.append(request.output())
        return outputs

    def _fail_step(self, plan, exc: Exception, touched: dict) -> list[RequestOutput]:
        failed = {self.seqs[s].request for s in plan.seq_slots.tolist() if s in self.seqs}
        for request in failed:
            self.scheduler.abort(request.request_id)
            request.error = f"{type(exc).__name__}: {exc}"
            self._release(request, reason="error")
            touched[request.request_id] = request
        return self._collect(touched)

    def _release(self, request: EngineRequest, reason: str = "abort") -> None:
        for seq in request.seqs:
            if self.seqs.pop(seq.slot, None) is not None:
                self.sampler.remove(seq.slot)
            if seq.finish_reason is None:
                seq.finish(reason, ())

    # ---- helpers -----------------------------------------------------------------------------
    def _encode(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, self._check_ids(list(prompt))
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, ids) -> list[int]:
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
                raise ValueError("each message needs a 'role' and a string 'content'")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, **kwargs)
        except Exception as exc:
            raise ValueError(f"messages: chat template failed: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _max_model_len(self, pool_tokens: int) -> int:
        requested = self.config.max_model_len
        native = self.model_config.max_model_len  # capped to a sliding window the model really uses
        if requested is not None:
            if requested > pool_tokens:
                raise ValueError(f"max_model_len ({requested}) is larger than the KV cache ({pool_tokens} "
                                 "tokens): raise kv_cache_memory/num_kv_blocks or lower max_model_len")
            return requested
        limit = native if self.device.type == "cuda" else min(native, _CPU_DEFAULT_MAX_MODEL_LEN)
        return min(limit, pool_tokens)

    def _profile_forward(self, num_tokens: int) -> None:
        """A forward over `num_tokens` fresh tokens: compiles kernels / warms allocators.

        It writes KV rows into the first blocks of the cache; those blocks are free, and a block's
        rows are always written before they are read, so nothing leaks into real requests.
        """
        bs = self.config.block_size
        caches = getattr(self, "kv_caches", None)
        n = max(1, num_tokens if caches is None else min(num_tokens, self.num_blocks * bs))
        nblocks = -(-n // bs)
        if caches is None:  # GPU memory profiling runs before the real pool exists
            caches = allocate_kv_caches(self.model_config, nblocks, bs, self.dtype, self.device)
        meta = AttentionMetadata.from_numpy(
            slot_mapping=np.arange(n, dtype=np.int64), query_start_loc=np.array([0, n], dtype=np.int64),
            seq_lens=np.array([n], dtype=np.int64), context_lens=np.zeros(1, dtype=np.int64),
            block_tables=np.arange(nblocks, dtype=np.int32)[None, :], max_query_len=n, max_seq_len=n,
            device=self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        with torch.inference_mode():
            self.model(ids, pos, caches, meta, torch.tensor([n - 1], device=self.device))

    # ---- observability -----------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler.stats()
        total = max(1, s["blocks_total"])
        return {
            "num_requests_running": s["num_running"],
            "num_requests_waiting": s["num_waiting"],
            "kv_cache_usage_perc": s["blocks_used"] / total,
            "prefix_cache_queries": s["prefix_queries"],
            "prefix_cache_hits": s["prefix_hits"],
            "num_preemptions": s["num_preemptions"],
            "num_timeouts": s["num_timeouts"],
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "blocks_total": s["blocks_total"],
            "blocks_free": s["blocks_free"],
            "blocks_used": s["blocks_used"],
            "blocks_cached": s["blocks_cached"],
            "num_steps": self.num_steps,
        }

    def step_breakdown(self) -> dict[str, float]:
        """Seconds spent per phase of `step` so far (schedule, prepare, forward, sample, ...)."""
        return dict(self.timer.totals)
