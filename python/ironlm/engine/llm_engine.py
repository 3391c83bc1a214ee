"""LLMEngine: one scheduler call, one forward, one sampler call per step.

The Rust scheduler plans the step and hands back ready-made numpy arrays; the model runner turns them
into logits, the sampler into tokens, and the sequence table turns sampled tokens into outputs.
The only per-request Python work is detokenization of the tokens a step produced.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ironlm import _core
from ironlm.config import EngineConfig
from ironlm.engine import faults
from ironlm.engine.model_runner import ModelRunner
from ironlm.engine.outputs import RequestMetrics, RequestOutput
from ironlm.engine.prompts import PromptType, apply_chat_template, encode_prompt
from ironlm.engine.sequence_table import EngineRequest, SequenceTable
from ironlm.engine.timing import StepTimer
from ironlm.exceptions import TensorParallelError
from ironlm.sampler import Sampler, SamplerOutput
from ironlm.sampling_params import SamplingParams
from ironlm.structured.compiler import GrammarCache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm.model.config import ModelConfig
    from ironlm.structured.params import StructuredOutputsParams

logger = logging.getLogger("ironlm.engine")


class LLMEngine:
    """Drives one model. Not thread-safe: exactly one thread calls its methods."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.runner = ModelRunner(config)
        self.faults = faults.from_env()  # None unless a test sets IRONLM_FAULT
        self._new_state()
        self.timer = StepTimer()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self._ids = itertools.count()
        eos = list(self.model_config.eos_token_ids)
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        self._eos_ids = frozenset(self.model_config.eos_token_ids)
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size, eos,
                                     cache_size=config.grammar_cache_size, timeout=config.grammar_compile_timeout)
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d, max_model_len %d", self.model_name,
                    self.device, self.dtype, self.num_blocks, config.block_size, self.max_model_len)

    def _new_state(self) -> None:
        """A fresh scheduler (empty queue, every KV block free, empty prefix cache), sampler and sequence table."""
        config, runner = self.config, self.runner
        self.scheduler = _core.Scheduler(
            num_blocks=runner.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=runner.token_budget, max_model_len=runner.max_model_len,
            policy=config.scheduling_policy, enable_prefix_caching=config.enable_prefix_caching,
            # The capacity is max_num_seqs running + max_queue_len waiting (checked in add_request): requests that
            # arrive together all wait until the next step schedules them, so the core's waiting bound is the sum.
            max_queue_len=None if config.max_queue_len is None else config.max_queue_len + config.max_num_seqs,
            tenant_weights=config.tenant_weight_map(), input_token_weight=config.fair_input_token_weight,
            output_token_weight=config.fair_output_token_weight, scheduler_delay_factor=config.scheduler_delay_factor,
        )
        self.sampler = Sampler(runner.model_config.vocab_size, runner.device, max_slots=config.max_num_seqs,
                               seed=config.seed)
        self.table = SequenceTable(self.sampler, runner.tokenizer)

    def reset(self) -> list[str]:
        """Drop every request and rebuild the request state; returns the dropped request ids.

        What AsyncLLMEngine's loop restart calls after repeated step failures: the old scheduler and tables may be
        inconsistent, so nothing is aborted through them, they are replaced. The model and its KV tensors stay
        (a fresh block pool with an empty prefix cache never reads what the old blocks hold).
        """
        dropped = list(self.table.requests)
        self._new_state()
        return dropped

    # ---- what the model runner loaded (read by the CLI, the server and the benchmarks) --------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.runner.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def model_name(self) -> str:
        return self.runner.model_name

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def model_path(self) -> str:
        return self.runner.model_path

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def startup_timings(self) -> dict[str, float]:
        return self.runner.startup_timings

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None, *, priority: int = 0,
                    deadline: float | None = None, queue_timeout: float | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    grammar: _core.CompiledGrammar | None = None, tenant: str | None = None) -> str:
        """`grammar`: `params.structured_outputs` compiled already (`compile_grammar`, e.g. in another thread);
        compiled here when not given. `tenant`: who it is served for (`--scheduling-policy fair`); None is "".
        """
        params = params or SamplingParams()
        if grammar is None and params.structured_outputs is not None:
            grammar = self.compile_grammar(params.structured_outputs)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        capacity = None if self.config.max_queue_len is None else self.config.max_queue_len + self.config.max_num_seqs
        if capacity is not None and len(self.table) >= capacity:
            raise _core.QueueFullError(f"{len(self.table)} requests are running or waiting: the capacity is "
                                       f"max_num_seqs ({self.config.max_num_seqs}) + max_queue_len "
                                       f"({self.config.max_queue_len})")
        text, token_ids = encode_prompt(self.tokenizer, prompt, self.model_config.vocab_size)
        max_tokens = params.max_tokens
        if max_tokens is None:  # up to max_model_len; a prompt already that long is the core's to reject
            max_tokens = max(1, self.max_model_len - len(token_ids))
        arrival = _core.monotonic() if arrival_time is None else arrival_time
        slots = self.scheduler.add_request(
            request_id, token_ids, max_tokens, min_tokens=params.min_tokens, n=params.n,
            priority=priority, eos_token_ids=list(self.model_config.eos_token_ids),
            stop_token_ids=list(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos, deadline=deadline,
            queue_timeout=queue_timeout if queue_timeout is not None else self.config.queue_timeout,
            namespace=cache_salt, arrival_time=arrival, grammar=grammar, tenant=tenant,
        )
        request = EngineRequest(request_id, text, token_ids, params, RequestMetrics(arrival_time=arrival))
        self.table.add(request, slots, self.scheduler.stop_token_ids(slots[0]))
        self.prompt_tokens_total += len(token_ids)
        return request_id

    def compile_grammar(self, params: StructuredOutputsParams) -> _core.CompiledGrammar:
        """Thread-safe (the GIL is released while compiling); GrammarError naming the offending field."""
        return self.grammars.compile_params(params)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            request = self.table.pop(rid)
            if request is None:
                continue
            self.scheduler.abort(rid)
            self.table.release(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return len(self.table) > 0

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **kwargs)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        timer = self.timer
        timer.start()
        plan = self.scheduler.schedule()
        timer.lap("schedule")
        touched: dict[str, EngineRequest] = {}
        for _, slot, reason, _ in plan.finished:  # timed out while waiting
            self._finish_seq(slot, reason, None, touched)
        if plan.is_empty:
            return self._collect(touched)
        now = _core.monotonic()
        for rid, cached in zip(plan.new_request_ids, plan.new_request_cached_tokens.tolist()):
            request = self.table.requests.get(rid)
            if request is not None and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.num_cached_tokens = cached
        try:
            if self.faults is not None:
                self.faults.check("forward")
            logits = self.runner.execute(plan, timer)
            with torch.inference_mode():  # the sampler edits the (inference-mode) logits in place
                # The masks were computed on the core's worker while the forward ran: this join is ~free.
                bitmask = self.scheduler.take_bitmask() if len(plan.mask_rows) else None
                sampled = self.sampler.sample(logits, plan.sample_slots, plan.sample_output_lens,
                                              plan.sample_ban_stop, token_bitmask=bitmask)
            timer.lap("sample")
        except TensorParallelError:  # a rank of the sharded model is gone: no later step can run either
            raise
        except Exception as exc:  # a failed step fails its requests, never the engine
            logger.exception("step failed; failing the %d sequences in it", plan.num_seqs)
            return self._fail_step(plan, exc, touched)
        # The core's stop decision: slot -> (reason, matched stop_token_ids entry or None).
        finished = {slot: (reason, tok) for _, slot, reason, tok in self.scheduler.update(sampled.token_ids)}
        timer.lap("update")
        self._postprocess(plan, sampled, finished, touched)
        timer.lap("detokenize")
        outputs = self._collect(touched)
        timer.lap("output")
        self.num_steps += 1
        return outputs

    def _postprocess(self, plan: _core.SchedulerPlan, sampled: SamplerOutput,
                     finished: dict[int, tuple[str, int | None]], touched: dict[str, EngineRequest]) -> None:
        now = _core.monotonic()
        tokens = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        self.generation_tokens_total += len(tokens)
        failed: set[str] = set()
        for row, slot in enumerate(plan.sample_slots.tolist()):
            seq = self.table.seq(slot)
            if seq is None or seq.request.request_id in failed:
                continue
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            top = None if top_ids is None or top_lps is None else (top_ids[row], top_lps[row])
            # A stop token never reaches the text; the last token of a completed grammar (also "stop") does.
            reason, tok = finished.get(slot, (None, None))
            stop_token = reason == "stop" and (tok is not None or tokens[row] in self._eos_ids)
            try:
                stop = seq.append(tokens[row], logprobs[row], top, self.tokenizer, stop_token)
            except Exception as exc:  # its detokenizer, stop strings or logprobs: that request fails, not the step
                logger.exception("output processing failed; failing request %s only", request.request_id)
                self._fail_request(request, exc, touched)
                failed.add(request.request_id)
                continue
            touched[request.request_id] = request
            if stop is not None:  # a stop string: the detokenizer's to match, the core's to release
                seq.stop_reason = stop
                if slot not in finished:
                    self.scheduler.finish(slot)
                    finished[slot] = ("stop", None)
        for slot, (reason, tok) in finished.items():
            self._finish_seq(slot, reason, tok, touched)

    def _finish_seq(self, slot: int, reason: str, stop_token: int | None, touched: dict[str, EngineRequest]) -> None:
        seq = self.table.seq(slot)
        try:
            request = self.table.finish(slot, reason, stop_token)
        except Exception as exc:  # flushing its detokenizer: that request fails, not the step
            if seq is None:
                raise
            logger.exception("finishing failed; failing request %s only", seq.request.request_id)
            self._fail_request(seq.request, exc, touched)
            return
        if request is not None:
            touched[request.request_id] = request

    def _collect(self, touched: dict[str, EngineRequest]) -> list[RequestOutput]:
        outputs = []
        now = _core.monotonic()
        for rid, request in touched.items():
            if request.finished and request.metrics.finished_time is None:
                request.metrics.finished_time = now
                self.table.pop(rid)
            outputs.append(request.output())
        return outputs

    def _fail_step(self, plan: _core.SchedulerPlan, exc: Exception,
                   touched: dict[str, EngineRequest]) -> list[RequestOutput]:
        for request in self.table.requests_in(plan.seq_slots.tolist()):
            self._fail_request(request, exc, touched)
        return self._collect(touched)

    def _fail_request(self, request: EngineRequest, exc: Exception, touched: dict[str, EngineRequest]) -> None:
        """End `request` with finish reason "error": the core frees its sequences (a no-op for those it already
        finished this step), the sampler its slots."""
        self.scheduler.abort(request.request_id)
        request.error = f"{type(exc).__name__}: {exc}"
        try:
            self.table.release(request, "error")
        except Exception:  # noqa: BLE001 - flushing a detokenizer that already failed: close without them
            for seq in request.seqs:
                seq.detok = None
            self.table.release(request, "error")
        touched[request.request_id] = request

    # ---- observability -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
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
            "model_weight_bytes": self.runner.weight_bytes,
        }

    def step_breakdown(self) -> dict[str, float]:
        """Seconds spent per phase of `step` so far (schedule, prepare, forward, sample, ...)."""
        return dict(self.timer.totals)
