"""LLMEngine: one scheduler call, one forward, one sampler call per step.

The Rust scheduler plans the step and hands back ready-made numpy arrays; the model runner turns them
into logits, the sampler into tokens, and the sequence table turns sampled tokens into outputs.
The only per-request Python work is detokenization of the tokens a step produced.

With a KV tier (kv_offload_memory / kv_offload_dir / swap_space) the core plans block copies between the device
pool and the tier; the runner performs them before the forward. What the tier needs outside the step (restore at
start, the promotion cost model, pinned prefixes, save at `shutdown()`, also run at exit) is kv/lifecycle.py's.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ironlm import _core
from ironlm.config import EngineConfig
from ironlm.engine import faults
from ironlm.engine.kv.lifecycle import TierLifecycle
from ironlm.engine.model_runner import ModelRunner
from ironlm.engine.outputs import RequestMetrics, RequestOutput
from ironlm.engine.pooling import check_request, make_pooler
from ironlm.engine.prompt_logprobs import PromptLogprobs
from ironlm.engine.prompt_logprobs import namespace as prompt_logprobs_namespace
from ironlm.engine.prompts import PromptType, apply_chat_template, encode_prompt
from ironlm.engine.sequence_table import EngineRequest, SequenceTable
from ironlm.engine.spec.cost import SpecBudget
from ironlm.engine.spec.draft import DraftModel
from ironlm.engine.spec.verify import may_speculate
from ironlm.engine.timing import StepTimer
from ironlm.exceptions import EngineDeadError, TensorParallelError
from ironlm.sampler import Sampler, SamplerOutput
from ironlm.sampler.rejection import Drafts
from ironlm.sampling_params import SamplingParams
from ironlm.structured.compiler import GrammarCache

if TYPE_CHECKING:
    from ironlm.structured.params import StructuredOutputsParams

logger = logging.getLogger("ironlm.engine")

# How long the at-exit shutdown waits for a step another thread is running before it gives up saving.
_EXIT_WAIT_S = 30.0


def _shutdown_at_exit(ref: weakref.ref[LLMEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown(wait_s=_EXIT_WAIT_S)


class LLMEngine:
    """Drives one model. Not thread-safe: exactly one thread calls its methods."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        spec = config.speculation()
        # A draft model loads first: the target's KV pool is sized for both pools (engine/spec/draft.py).
        self.drafter = DraftModel(config, spec) if spec is not None and spec.model is not None else None
        self.runner = runner = ModelRunner(config, extra_block_bytes=0 if self.drafter is None
                                           else self.drafter.block_bytes)
        if self.drafter is not None:
            self.drafter.attach(runner.tokenizer, runner.model_config.vocab_size, runner.num_blocks)
        # What the runner loaded, fixed for the engine's life (read by the CLI, the server and the benchmarks).
        self.tokenizer, self.model_config, self.model_name = runner.tokenizer, runner.model_config, runner.model_name
        self.model_path, self.max_model_len, self.num_blocks = runner.model_path, runner.max_model_len, runner.num_blocks
        self.device, self.dtype, self.startup_timings = runner.device, runner.dtype, runner.startup_timings
        self.faults = faults.from_env()  # None unless a test sets IRONLM_FAULT
        self._closed = False
        # Held by each step and by shutdown: the at-exit shutdown waits for a step another thread is running.
        self._lock = threading.Lock()
        self.kv = TierLifecycle(config, runner)
        # What failed the last step's forward (its requests failed with it); None when the last step did not
        # fail. AsyncLLMEngine counts such steps toward its restart policy like steps that raise.
        self.last_step_error: Exception | None = None
        self.timer = StepTimer()
        # Each step's proposal budget from measured step costs (engine/spec/cost.py); kept across reset(): it
        # describes the machine and the model, not the requests.
        self.spec_budget = (SpecBudget(spec.num_speculative_tokens, spec.max_batch_tokens, spec.step_costs,
                                       token_budget=runner.token_budget)
                            if spec is not None and spec.cost_model and config.runner != "pooling" else None)
        self._prefill_rows = 0  # the next step's, as far as the last one tells
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
        # Only a tier that persists has anything to do at exit (a weak reference: the hook keeps no engine alive).
        self._atexit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        try:
            self.pooler = make_pooler(config, runner)  # None unless runner="pooling" (engine/pooling.py)
            self._new_state()
            if self.kv.persist:
                atexit.register(self._atexit)
            self.kv.start()
            self.kv.pin_prefixes(self._prefill)
        except BaseException:
            # Release the tier (its file lock) and the ranks now; a restored index is written back.
            self.shutdown()
            raise
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d (%s), max_model_len %d", self.model_name,
                    self.device, self.dtype, self.num_blocks, config.block_size, runner.kv_dtype, self.max_model_len)
        if runner.tier is not None:
            logger.info("KV tier: %s, %d blocks%s", runner.tier.kind, runner.tier.num_slots,
                        ", swap on" if config.swap_space > 0 else "")

    def _new_state(self) -> None:
        """A fresh scheduler (empty queue, every KV block free, empty prefix cache, every tier slot free), sampler
        and sequence table."""
        config, runner = self.config, self.runner
        # A block is released only once it is outside every layer's window: all must slide, the widest decides.
        windows = runner.model_config.layer_windows
        self.scheduler = _core.Scheduler(config.scheduler_config(
            num_blocks=runner.num_blocks, max_num_batched_tokens=runner.token_budget,
            max_model_len=runner.max_model_len, tier_blocks=0 if runner.tier is None else runner.tier.num_slots,
            sliding_window=None if None in windows else max(w for w in windows if w is not None)))
        self.kv.attach(self.scheduler)
        if self.drafter is not None:
            self.drafter.valid[:] = 0  # a fresh pool: no slot's draft KV is known
        spec = config.speculation()
        if spec is not None and config.runner != "pooling":  # n-gram proposals: the core's (engine/spec)
            self.scheduler.set_speculation(spec.num_speculative_tokens, spec.prompt_lookup_max,
                                           spec.prompt_lookup_min, spec.max_batch_tokens,
                                           external=self.drafter is not None)
        self.sampler = Sampler(runner.model_config.vocab_size, runner.device, max_slots=config.max_num_seqs,
                               seed=config.seed)
        self.table = SequenceTable(self.sampler, runner.tokenizer)
        self.prompt_lps = PromptLogprobs()

    def reset(self) -> list[str]:
        """Drop every request and rebuild the request state; returns the dropped request ids.

        What AsyncLLMEngine's loop restart calls after repeated step failures: the old scheduler and tables may be
        inconsistent, so nothing is aborted through them, they are replaced. The model and its KV tensors stay
        (a fresh block pool with an empty prefix cache never reads what the old blocks hold).

        The KV tier restarts empty too: the old scheduler's record of what each slot holds is as suspect as the
        rest of it, and the new one reads a slot only after a demotion it planned wrote it. Nothing on disk
        vouches for the old slots either (the tier deletes its index when it loads it at startup); the next
        shutdown saves the new scheduler's entries. Pinned prefixes are prefilled and pinned again.
        """
        dropped = list(self.table.requests)
        self._new_state()
        self.kv.pin_prefixes(self._prefill)
        return dropped

    def _prefill(self, request_id: str, text: str) -> list[int]:
        """Run `text` as a one-token greedy request to its end (a pinned prefix); its prompt token ids."""
        self.add_request(request_id, text, SamplingParams(temperature=0, max_tokens=1))
        ids = self.table.requests[request_id].prompt_token_ids
        while self.has_unfinished_requests():
            self.step()
        return ids

    def shutdown(self, wait_s: float | None = None) -> None:
        """End the engine: a disk tier first takes every cached block and its index (so the next engine on the
        folder hits them), then the tier closes and tensor-parallel ranks stop. Idempotent; also runs at exit.
        It waits for a step another thread is running (at most `wait_s`, then it returns without saving); the
        engine takes no step afterwards."""
        if not self._lock.acquire(timeout=-1 if wait_s is None else wait_s):
            logger.error("shutdown: a step is still running after %.0f s; the KV tier is not saved", wait_s)
            return
        try:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self._atexit)
            try:
                if self.kv.restored:
                    self.abort_request(list(self.table.requests))  # live requests hold their blocks
                    self.kv.save()
            except Exception:  # a failed save loses the cache, never the shutdown
                logger.exception("KV tier: saving the index failed; the next start begins with an empty tier")
            finally:
                self.runner.close_tier()
                self.runner.shutdown()
        finally:
            self._lock.release()

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
        check_request(self.pooler, params)
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
        if params.prompt_logprobs is not None:  # no prefix-cache hit: every prompt row is computed (see module)
            cache_salt = prompt_logprobs_namespace()
        slots = self.scheduler.add_request(
            request_id, token_ids, max_tokens, min_tokens=params.min_tokens, n=params.n,
            priority=priority, eos_token_ids=list(self.model_config.eos_token_ids),
            stop_token_ids=list(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos, deadline=deadline,
            queue_timeout=queue_timeout if queue_timeout is not None else self.config.queue_timeout,
            namespace=cache_salt, arrival_time=arrival, grammar=grammar, tenant=tenant,
            speculate=may_speculate(params),
        )
        if self.drafter is not None:
            self.drafter.forget(slots)
        request = EngineRequest(request_id, text, token_ids, params, RequestMetrics(arrival_time=arrival))
        self.table.add(request, slots, self.scheduler.stop_token_ids(slots[0]))
        if params.prompt_logprobs is not None:
            self.prompt_lps.add(request, slots)
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
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine was shut down")
            return self._step()

    def _step(self) -> list[RequestOutput]:
        self.last_step_error = None
        timer = self.timer
        timer.start()
        began = time.perf_counter()
        if self.spec_budget is not None:
            running = self.scheduler.num_running
            self.scheduler.set_spec_budget(self.spec_budget.choose(running, running + self._prefill_rows))
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
        if self.pooler is not None:  # a pooling model: the forward pools instead of sampling
            return self.pooler.engine_step(self, plan, touched)
        forward_s = timer.totals["forward"]
        try:
            if self.faults is not None:
                self.faults.check("forward")
            drafts = self._draft(plan, timer)
            prompt_rows = self.prompt_lps.rows(plan, self.table)
            logits = self.runner.execute(plan, timer, None if prompt_rows is None else prompt_rows.rows)
            if prompt_rows is not None:  # the rows after the sampled ones
                self.prompt_lps.record(prompt_rows, logits[plan.num_samples:], self.tokenizer)
                logits = logits[:plan.num_samples]
            self.kv.track_prefill(plan, timer.totals["forward"] - forward_s)
            with torch.inference_mode():  # the sampler edits the (inference-mode) logits in place
                # The masks were computed on the core's worker while the forward ran: this join is ~free.
                bitmask = self.scheduler.take_bitmask() if len(plan.mask_rows) else None
                sampled = self.sampler.sample(logits, plan.sample_slots, plan.sample_output_lens,
                                              plan.sample_ban_stop, token_bitmask=bitmask, drafts=drafts)
            timer.lap("sample")
        except TensorParallelError:  # a rank of the sharded model is gone: no later step can run either
            raise
        except Exception as exc:  # a failed step fails its requests, never the engine
            logger.exception("step failed; failing the %d sequences in it", plan.num_seqs)
            return self._fail_step(plan, exc, touched)
        # The core's stop decision: slot -> (reason, matched stop_token_ids entry or None).
        finished = {slot: (reason, tok) for _, slot, reason, tok in self.scheduler.update(sampled.token_ids)}
        if self.drafter is not None:
            self.drafter.settle(self.scheduler.emitted())
        timer.lap("update")
        self._postprocess(plan, sampled, finished, touched)
        timer.lap("detokenize")
        outputs = self._collect(touched)
        timer.lap("output")
        self.num_steps += 1
        if self.spec_budget is not None:
            self._measure(plan, time.perf_counter() - began)
        return outputs

    def _measure(self, plan: _core.SchedulerPlan, seconds: float) -> None:
        """Feed the cost model this step's rows, proposals, accepted proposals and wall time."""
        assert self.spec_budget is not None
        proposed = int(np.count_nonzero(plan.sample_draft >= 0))
        accepted = 0
        if proposed:  # the core's accepted run per sequence: emitted rows past each one's first
            emitted = self.scheduler.emitted()
            seqs = np.unique(plan.sample_slots[emitted]).size
            accepted = max(0, int(np.count_nonzero(emitted)) - seqs)
        # The next step prefills again if a prompt is part way (a sequence without a sampled row) or waiting.
        sampled_seqs = np.unique(np.searchsorted(plan.query_start_loc, plan.logits_indices, side="right")).size
        more = plan.num_prefill_tokens and (sampled_seqs < plan.num_seqs or self.scheduler.num_waiting > 0)
        self._prefill_rows = plan.num_prefill_tokens if more else 0
        if self.drafter is not None:
            seconds -= self.drafter.catchup_seconds
        self.spec_budget.observe(plan.num_tokens, proposed, accepted, seconds, plan.num_prefill_tokens > 0)

    def _draft(self, plan: _core.SchedulerPlan, timer: StepTimer) -> Drafts | None:
        """A draft model's proposals into the plan's reserved rows (None without a draft model)."""
        if self.drafter is None:
            return None
        for rid in plan.preempted_request_ids:  # their blocks may hold other KV when they come back
            request = self.table.requests.get(rid)
            if request is not None:
                self.drafter.forget([seq.slot for seq in request.seqs])
        drafts = self.drafter.propose(plan, self.scheduler, self.sampler)
        timer.lap("draft")
        return drafts

    def _postprocess(self, plan: _core.SchedulerPlan, sampled: SamplerOutput,
                     finished: dict[int, tuple[str, int | None]], touched: dict[str, EngineRequest]) -> None:
        now = _core.monotonic()
        tokens = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        slots = plan.sample_slots.tolist()
        # Speculation: a sequence has several rows; the core appended the accepted run only (`emitted`).
        emitted = self.scheduler.emitted().tolist()
        last_row = {slot: row for row, slot in enumerate(slots) if emitted[row]}
        self.generation_tokens_total += sum(emitted)
        failed: set[str] = set()
        for row, slot in enumerate(slots):
            seq = self.table.seq(slot)
            if not emitted[row] or seq is None or seq.request.request_id in failed or seq.stop_reason is not None:
                continue
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            top = None if top_ids is None or top_lps is None else (top_ids[row], top_lps[row])
            # A stop token never reaches the text; the last token of a completed grammar (also "stop") does.
            reason, tok = finished.get(slot, (None, None)) if row == last_row[slot] else (None, None)
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
        self.last_step_error = exc
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
        allocated = s["kv_slots_allocated"]
        tier_kind = None if self.runner.tier is None else self.runner.tier.kind
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
            "kv_bytes_per_token": self.runner.kv_bytes_per_token,  # this rank's pool, all layers
            "kv_bytes_per_token_mha": self.runner.kv_bytes_per_token_mha,  # the same with per-head K/V (MLA: more)
            # The KV hierarchy (core counters; blocks unless named tokens).
            "kv_tier": tier_kind,  # "memory" | "disk" | None
            "tier_blocks_total": s["tier_blocks_total"],
            "tier_blocks_used": s["tier_blocks_used"],
            "kv_promotions": s["kv_promotions"],
            "kv_demotions": s["kv_demotions"],
            "prefix_hits_tier": s["prefix_hits_tier"],  # tokens, also counted in prefix_cache_hits
            "swap_out_blocks": s["swap_out_blocks"],
            "swap_in_blocks": s["swap_in_blocks"],
            "kv_slots_allocated": allocated,
            "kv_slots_used": s["kv_slots_used"],
            # Internal fragmentation of the running sequences' blocks: token slots held but not filled.
            "kv_waste_perc": 1.0 - s["kv_slots_used"] / allocated if allocated else 0.0,
            "blocks_pinned": s["blocks_pinned"],
            "window_freed_blocks": s["window_freed_blocks"],
            **self._spec_stats(),
        }

    def _spec_stats(self) -> dict[str, Any]:
        """Speculative decoding (vLLM's spec_decode_* figures): drafts verified, proposed and accepted tokens,
        acceptance per proposal position and the mean accepted length (tokens per verification step, bonus
        token included)."""
        s = self.scheduler.spec_stats()
        drafts, proposed, accepted = s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": proposed,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "spec_decode_accepted_per_pos": list(s["accepted_per_pos"]),
            "spec_decode_acceptance_per_pos": [a / drafts for a in s["accepted_per_pos"]] if drafts else [],
            "spec_decode_grammar_cut_tokens": s["grammar_cut_tokens"],
            # The cost model's: steps it paused speculation in, and its last budget (-1: no cost model).
            "spec_decode_paused_steps": 0 if self.spec_budget is None else self.spec_budget.paused_steps,
            "spec_decode_budget": -1 if self.spec_budget is None or self.spec_budget.budget is None
            else self.spec_budget.budget,
        }

    def step_breakdown(self) -> dict[str, float]:
        """Seconds spent per phase of `step` so far (schedule, prepare, forward, sample, ...)."""
        return dict(self.timer.totals)
