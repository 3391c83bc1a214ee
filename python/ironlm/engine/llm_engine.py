"""LLMEngine: one scheduler call, one forward, one sampler call per step.

The Rust scheduler plans the step and hands back ready-made numpy arrays; the model runner turns them
into logits, the sampler into tokens, and the sequence table turns sampled tokens into outputs.
The only per-request Python work is detokenization of the tokens a step produced.

With a KV tier (kv_offload_memory / kv_offload_dir / swap_space) the core plans block copies between the device
pool and the tier; the runner performs them before the forward. A disk tier outlives the process: `shutdown()`
(also run at exit) writes every cached block to it with an index, and the next engine on the same folder and
model restores that index before serving.
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

import torch

from ironlm import _core
from ironlm.config import EngineConfig
from ironlm.engine import faults
from ironlm.engine.model_runner import ModelRunner
from ironlm.engine.outputs import RequestMetrics, RequestOutput
from ironlm.engine.prompts import PromptType, apply_chat_template, encode_prompt
from ironlm.engine.sequence_table import EngineRequest, SequenceTable
from ironlm.engine.timing import StepTimer
from ironlm.exceptions import EngineDeadError, InvalidArgumentError, TensorParallelError
from ironlm.sampler import Sampler, SamplerOutput
from ironlm.sampling_params import SamplingParams
from ironlm.structured.compiler import GrammarCache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm.engine.kv_tier import KVTier
    from ironlm.model.config import ModelConfig
    from ironlm.structured.params import StructuredOutputsParams

logger = logging.getLogger("ironlm.engine")

# The promotion cost model's prefill estimate follows steps whose forward is at least this many prefill tokens
# (and mostly prefill), as an exponential average; the core gets a new figure once it moves by _COST_DRIFT.
_COST_MIN_PREFILL = 64
_COST_EMA = 0.2
_COST_DRIFT = 0.25
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
        self.runner = ModelRunner(config)
        self.faults = faults.from_env()  # None unless a test sets IRONLM_FAULT
        self._closed = False
        # Held by each step and by shutdown: the at-exit shutdown waits for a step another thread is running.
        self._lock = threading.Lock()
        # Only a disk tier of a single-rank engine persists: other ranks' tiers would need their own index.
        self._persist = self.tier is not None and self.tier.persistent and config.tensor_parallel_size == 1
        if self.tier is not None and self.tier.persistent and not self._persist:
            logger.warning("kv_offload_dir: with tensor parallelism the disk KV tier starts empty and is not "
                           "saved at shutdown")
        self._promote_cost: tuple[float, float] | None = None  # (copy s/block, prefill s/token) as the core has it
        self._prefill_s_per_token: float | None = None  # None until a real prefill-heavy step was timed
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
        # Only a tier that persists has anything to do at exit (a weak reference: the hook keeps no engine alive).
        self._atexit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        restored = False
        try:
            self._new_state()
            if self._persist:
                self._restore_tier()
                restored = True
                atexit.register(self._atexit)
            if self.tier is not None:
                self._measure_costs()
            self._pin_prefixes()
        except BaseException:
            # Release the tier (its file lock) and the ranks now; a restored index is written back.
            self._persist = restored
            self.shutdown()
            raise
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d, max_model_len %d", self.model_name,
                    self.device, self.dtype, self.num_blocks, config.block_size, self.max_model_len)
        if self.tier is not None:
            logger.info("KV tier: %s, %d blocks%s", self.tier.kind, self.tier.num_slots,
                        ", swap on" if config.swap_space > 0 else "")

    def _new_state(self) -> None:
        """A fresh scheduler (empty queue, every KV block free, empty prefix cache, every tier slot free), sampler
        and sequence table."""
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
            tier_blocks=0 if self.tier is None else self.tier.num_slots, swap=config.swap_space > 0,
            # A block is released only once it is outside every layer's window: all must slide, the widest decides.
            sliding_window=None if None in (lw := runner.model_config.layer_windows) else max(
                w for w in lw if w is not None),
        )
        if self._promote_cost is not None:
            self.scheduler.set_promote_cost(*self._promote_cost)
        self.sampler = Sampler(runner.model_config.vocab_size, runner.device, max_slots=config.max_num_seqs,
                               seed=config.seed)
        self.table = SequenceTable(self.sampler, runner.tokenizer)

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
        self._pin_prefixes()
        return dropped

    # ---- the KV tier: restore at start, save at shutdown, pinned prefixes, cost model ----------------
    @property
    def tier(self) -> KVTier | None:
        return self.runner.tier

    def _restore_tier(self) -> None:
        """Rebuild the prefix cache's tier nodes from the disk tier's index (validated by the tier: a foreign or
        corrupt file yields nothing, with a warning)."""
        assert self.tier is not None
        t0 = time.perf_counter()
        entries = self.tier.load_index()
        restored = self.scheduler.tier_restore(entries) if entries else 0
        self.runner.startup_timings["kv_tier_restore"] = time.perf_counter() - t0
        logger.info("KV tier: restored %d of %d indexed blocks from %s", restored, len(entries),
                    self.config.kv_offload_dir)

    def _measure_costs(self) -> None:
        """The core promotes tier blocks on a hit only when copying them back beats recomputing them: measure
        both sides here (a timed prefill forward; blocks read back from the tier). The startup forward is short,
        so it overstates the per-token cost of a long prefill (2-3x on CPU): the first real prefill-heavy step
        replaces it, later ones refine it (`_track_prefill_cost`)."""
        runner, bs = self.runner, self.config.block_size
        tokens = max(1, min(runner.token_budget, 128, runner.num_blocks * bs))
        if not self.config.warmup:
            runner.profile(tokens)  # once untimed: the first forward compiles / allocates
        t0 = time.perf_counter()
        runner.profile(tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prefill_s = (time.perf_counter() - t0) / tokens
        copy_s = runner.measure_tier_copy()
        self._set_promote_cost(copy_s, prefill_s)
        logger.info("KV tier cost model: copy %.3g ms/block, prefill %.3g ms/token (%.3g ms per %d-token block)",
                    copy_s * 1e3, prefill_s * 1e3, prefill_s * bs * 1e3, bs)

    def _set_promote_cost(self, copy_s_per_block: float, prefill_s_per_token: float) -> None:
        self._promote_cost = (copy_s_per_block, prefill_s_per_token)
        self.scheduler.set_promote_cost(copy_s_per_block, prefill_s_per_token)

    def _track_prefill_cost(self, plan: _core.SchedulerPlan, forward_s: float) -> None:
        prefill = plan.num_prefill_tokens
        if self._promote_cost is None or prefill < _COST_MIN_PREFILL or plan.num_decode_tokens * 8 > prefill:
            return
        per_token = forward_s / prefill
        ema = self._prefill_s_per_token
        ema = per_token if ema is None else (1 - _COST_EMA) * ema + _COST_EMA * per_token
        self._prefill_s_per_token = ema
        copy_s, told = self._promote_cost
        if abs(ema - told) > _COST_DRIFT * told:
            self._set_promote_cost(copy_s, ema)
            logger.info("KV tier cost model: prefill now %.3g ms/token (from %d-token steps)", ema * 1e3, prefill)

    def _pin_prefixes(self) -> None:
        """Prefill each `kv_pin_prefix` text as a one-token request, then pin its full blocks on the device."""
        for i, text in enumerate(self.config.kv_pin_prefix):
            rid = f"pin-{i}"
            try:
                self.add_request(rid, text, SamplingParams(temperature=0, max_tokens=1))
            except ValueError as exc:
                raise InvalidArgumentError(f"kv_pin_prefix: entry {i} cannot be prefilled: {exc}",
                                           "kv_pin_prefix") from exc
            ids = self.table.requests[rid].prompt_token_ids
            while self.has_unfinished_requests():
                self.step()
            pinned = self.scheduler.pin_prefix(ids)
            logger.info("kv_pin_prefix %d: %d of %d tokens pinned on the device (whole blocks)", i, pinned, len(ids))
            if pinned == 0:
                logger.warning("kv_pin_prefix %d (%d tokens) pinned nothing: shorter than one KV block of %d tokens",
                               i, len(ids), self.config.block_size)

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
                if self._persist:
                    self._save_tier()
            except Exception:  # a failed save loses the cache, never the shutdown
                logger.exception("KV tier: saving the index failed; the next start begins with an empty tier")
            finally:
                self.runner.close_tier()
                self.runner.shutdown()
        finally:
            self._lock.release()

    def _save_tier(self) -> None:
        tier, kv = self.tier, self.runner.kv_caches
        assert tier is not None and kv is not None
        t0 = time.perf_counter()
        # Requests still live hold their blocks; the core's flush ends its last step itself (a plan never
        # `update`d is rolled back, the last step's promotions become evictable) and returns every copy still
        # queued with its own demotions.
        self.abort_request(list(self.table.requests))
        pairs = self.scheduler.tier_flush()
        if len(pairs):
            tier.store(kv, pairs)
        entries = self.scheduler.tier_entries()
        tier.save_index(entries)
        logger.info("KV tier: saved %d blocks (%d demoted at shutdown) to %s in %.2f s", len(entries), len(pairs),
                    self.config.kv_offload_dir, time.perf_counter() - t0)

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
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine was shut down")
            return self._step()

    def _step(self) -> list[RequestOutput]:
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
        forward_s = timer.totals["forward"]
        try:
            if self.faults is not None:
                self.faults.check("forward")
            logits = self.runner.execute(plan, timer)
            self._track_prefill_cost(plan, timer.totals["forward"] - forward_s)
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
        allocated = s["kv_slots_allocated"]
        tier_kind = None if self.tier is None else self.tier.kind
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
        }

    def step_breakdown(self) -> dict[str, float]:
        """Seconds spent per phase of `step` so far (schedule, prepare, forward, sample, ...)."""
        return dict(self.timer.totals)
