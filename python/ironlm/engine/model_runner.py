"""ModelRunner: the model and its paged KV pool; a scheduler plan's arrays in, logits out.

This is the only engine file that touches the device. It loads the model, sizes the KV pool (on a
GPU by profiling a forward over the full token budget), allocates it, and per step moves the plan's
numpy arrays to the device, runs the KV tier copies (demote, promote), the copy-on-write block copies and the
forward. It owns this rank's KV tier (engine/kv/tier.py), if the config asks for one: under tensor parallelism
every rank keeps its own shard's blocks in its own tier, at the same slots.

On a GPU (one rank, Triton attention) the decode step is captured as CUDA graphs at startup, one per batch size,
unless `enforce_eager` (engine/cuda_graphs.py); every other step, and every step on CPU, runs eager.

With `tensor_parallel_size > 1` rank 0's runner starts the other ranks (ironlm.distributed.executor), each of
which builds a runner over its own shard and KV pool; every step rank 0 broadcasts the plan's arrays, all ranks
run the forward, and only rank 0 gets the logits.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ironlm.attention import AttentionMetadata, get_backend
from ironlm.config import EngineConfig
from ironlm.distributed.plan_codec import StepArrays
from ironlm.engine.kv_cache import (
    KVCaches,
    allocate_kv_caches,
    copy_blocks,
    num_kv_blocks,
    quantized_auto,
    resolve_kv_dtype,
)
from ironlm.exceptions import InvalidArgumentError
from ironlm.model import load_model, resolve_device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm import _core
    from ironlm.distributed.executor import TPExecutor
    from ironlm.distributed.group import TPGroup
    from ironlm.engine.cuda_graphs import DecodeGraphs
    from ironlm.engine.kv.tier import KVTier
    from ironlm.engine.timing import StepTimer
    from ironlm.model.config import ModelConfig


logger = logging.getLogger("ironlm.engine")


class CausalLM(Protocol):
    """The model as the runner calls it (ironlm.model.DecoderLM): one forward over a flat token batch."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                 meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] int64 -> float32 logits [len(logits_indices), vocab]."""
        ...

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                      meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """The same forward up to the final norm: float32 [len(rows), hidden] (pooling models)."""
        ...


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, extra_block_bytes: int = 0) -> None:
        """`tp`: this process is a tensor-parallel worker rank of that group (see ironlm.distributed.worker).
        `extra_block_bytes`: memory each KV block costs on top of this model's (a draft model's pool)."""
        self.config = config
        self._ready = False  # from here on rank 0 announces its forwards to the workers
        t0 = time.perf_counter()
        self.executor: TPExecutor | None = None
        if tp is None and config.tensor_parallel_size > 1:
            from ironlm.distributed.executor import TPExecutor

            self.executor = TPExecutor.start(config, type(self))
            tp = self.executor.group
        self.tp = tp
        self.device = resolve_device(config.device) if tp is None else tp.device
        torch.manual_seed(config.seed)
        try:
            loaded = load_model(config.model, dtype=config.dtype, device=self.device,
                                attn_backend=get_backend(config.attention_backend, self.device),
                                quantization=config.quantization,
                                quantization_group_size=config.quantization_group_size, tp=tp)
        except BaseException:
            self.shutdown()
            raise
        loaded.model.batch_invariant = config.batch_invariant  # read by its forward (ironlm.invariant)
        self.dtype = loaded.model.dtype  # auto resolves with the weights' storage (see load_model)
        try:
            self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device, quantized_auto(
                config.dtype, loaded.model))
        except BaseException:
            self.shutdown()
            raise
        self.model: CausalLM = loaded.model
        self.model_config: ModelConfig = loaded.config
        self.shard_config: ModelConfig = loaded.model.config  # = model_config unless tensor parallel
        if tp is not None:  # loading times differ between ranks; the forwards' collectives have a timeout
            tp.barrier()
        self.tokenizer: PreTrainedTokenizerBase = loaded.tokenizer
        self.model_name = config.served_model_name or loaded.name
        self.model_path = loaded.path
        self.startup_timings: dict[str, float] = {"load_model": time.perf_counter() - t0}
        self.weight_bytes = loaded.model.weight_bytes()

        t0 = time.perf_counter()
        self.token_budget = config.resolve_max_num_batched_tokens(self.device.type)
        self.kv_caches: KVCaches | None = None  # profiling on a GPU runs before the pool exists
        self.num_blocks = num_kv_blocks(config, self.shard_config, self.kv_dtype, self.device,
                                        lambda: self.profile(self.token_budget), extra_block_bytes)
        if self.tp is not None:  # one scheduler for all ranks: every rank's pool has the same number of blocks
            self.num_blocks = self.tp.min_int(self.num_blocks)
        self.kv_caches = allocate_kv_caches(self.shard_config, self.num_blocks, config.block_size, self.kv_dtype,
                                            self.device)
        self.max_model_len = self._max_model_len(self.num_blocks * config.block_size)
        # what one token costs in this rank's pool, and what it would with per-head K/V (differs for latent attention)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        self.kv_bytes_per_token = self.shard_config.kv_bytes_per_token(elem)
        self.kv_bytes_per_token_mha = self.shard_config.mha_kv_bytes_per_token(elem)
        self.startup_timings["kv_cache"] = time.perf_counter() - t0
        self.tier: KVTier | None = None
        if config.kv_tier_kind() is not None:
            t0 = time.perf_counter()
            self.tier = self._build_tier()
            self.startup_timings["kv_tier"] = time.perf_counter() - t0
        if config.warmup:
            t0 = time.perf_counter()
            self.profile(min(self.token_budget, 64))
            self.startup_timings["warmup"] = time.perf_counter() - t0
        self.graphs: DecodeGraphs | None = None
        if self.cuda_graphs_apply():
            t0 = time.perf_counter()
            try:
                self.graphs = self._capture_graphs()
            except Exception:  # a capture that fails leaves a working eager engine, said loudly
                logger.exception("capturing the decode CUDA graphs failed: running eager (--enforce-eager "
                                 "silences this)")
                torch.cuda.synchronize(self.device)
            else:
                self.startup_timings["cuda_graphs"] = time.perf_counter() - t0
        self._ready = True

    def cuda_graphs_apply(self) -> bool:
        """Whether this runner captures its decode step: CUDA, one rank, the Triton backend, not enforce_eager."""
        backend = getattr(self.model, "attn_backend", None)
        return (not self.config.enforce_eager and self.device.type == "cuda" and self.tp is None
                and getattr(backend, "name", None) == "triton" and self.config.runner != "pooling")

    def _capture_graphs(self) -> DecodeGraphs:
        from ironlm.engine.cuda_graphs import DecodeGraphs, capture_sizes

        assert self.kv_caches is not None
        graphs = DecodeGraphs(self.model, self.kv_caches, sizes=capture_sizes(self.config.max_num_seqs),
                              max_model_len=self.max_model_len, block_size=self.config.block_size,
                              device=self.device)
        graphs.capture_all()
        return graphs

    def disable_cuda_graphs(self) -> None:
        """Run every step eager from now on (for wrappers of the model's forward, which a replay bypasses)."""
        self.graphs = None

    def _build_tier(self) -> KVTier:
        """This rank's tier: as many slots as the configured bytes hold (the fewest any rank holds, as the core
        sees one slot count). Disk tier files are keyed by a fingerprint of the model, its shard and the KV
        layout, so a restart of another model (or rank) never reads them."""
        from ironlm.engine.kv.tier import KVTier, TierGeometry, fingerprint

        config, shard = self.config, self.shard_config
        geometry = TierGeometry(num_layers=shard.num_layers, block_size=config.block_size,
                                num_kv_heads=shard.num_kv_heads, head_dim=shard.head_dim, dtype=self.kv_dtype,
                                planes=shard.kv_planes)
        slots = config.resolve_kv_tier_bytes() // geometry.bytes_per_block
        if self.tp is not None:
            slots = self.tp.min_int(slots)
        param = "kv_offload_dir" if config.kv_tier_kind() == "disk" else (
            "kv_offload_memory" if config.kv_offload_memory is not None else "swap_space")
        if slots < 1:
            raise InvalidArgumentError(f"{param}: the KV tier holds no block ({geometry.bytes_per_block} bytes "
                                       "each)", param)
        if config.kv_offload_dir is None:
            return KVTier.memory(geometry, slots, self.device)
        rank, world = (0, 1) if self.tp is None else (self.tp.rank, self.tp.world)
        key = fingerprint(self.model_path, self.tokenizer, geometry, quantization=config.quantization,
                          quantization_group_size=config.quantization_group_size, tp_rank=rank, tp_size=world)
        return KVTier.disk(geometry, slots, config.kv_offload_dir, key)

    def measure_tier_copy(self, blocks: int = 8, rounds: int = 3) -> float:
        """Seconds to copy one block back from the tier (what a promotion costs), best of `rounds`.

        Slots are read into free device blocks and written back unchanged, so a disk tier's restored content
        stays intact (the device blocks are free at startup and written before they are read)."""
        assert self.tier is not None and self.kv_caches is not None
        n = max(1, min(blocks, self.tier.num_slots, self.num_blocks))
        back = np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.int64)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.tier.load(self.kv_caches, back)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
            self.tier.store(self.kv_caches, back)
        return best / n

    def close_tier(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def execute(self, plan: _core.SchedulerPlan, timer: StepTimer | None = None,
                extra_rows: np.ndarray | None = None) -> torch.Tensor:
        """Logits [plan.num_samples, vocab] (float32) for the plan's `logits_indices` rows, then one row per
        `extra_rows` entry (token rows of the batch: prompt logprobs), in that order.

        The result is an inference-mode tensor: modify it in place only under `torch.inference_mode()`.
        Under tensor parallelism the time spent in collectives (plan broadcast, all-reduces, logits gather) is
        taken out of the prepare / forward phases into its own `tp_comm` phase.
        """
        arrays = StepArrays.of(plan)
        if extra_rows is not None and len(extra_rows):  # every rank runs the longer index list (a CUDA graph none)
            arrays.logits_indices = np.concatenate([arrays.logits_indices, extra_rows]).astype(np.int64)
        tp = self.tp
        c0 = c1 = 0.0 if tp is None else tp.comm_s
        if self.executor is not None:
            self.executor.step(arrays)
            c1 = self.executor.group.comm_s
        logits = self.run(arrays, timer)
        if timer is not None and tp is not None:
            sent, forward = c1 - c0, tp.comm_s - c1
            timer.totals["prepare"] -= sent
            timer.totals["forward"] -= forward
            timer.totals["tp_comm"] += sent + forward
        return logits

    def run(self, plan: StepArrays, timer: StepTimer | None = None, hidden: bool = False) -> torch.Tensor:
        """The forward over one plan's arrays (every rank runs it; rank 0's result is the logits). `hidden`: the
        final-norm hidden states of the `logits_indices` rows instead (pooling models: one rank, eager)."""
        assert self.kv_caches is not None
        device = self.device
        if len(plan.kv_demote) or len(plan.kv_promote):
            if timer is not None:
                timer.lap("prepare")
            self.tier_copies(plan.kv_demote, plan.kv_promote)
            if timer is not None:
                timer.lap("kv_copy", sync=device)
        if len(plan.cow_pairs):
            copy_blocks(self.kv_caches, plan.cow_pairs)
        size = None if self.graphs is None or hidden else self.graphs.size_for(plan)
        if size is not None:
            assert self.graphs is not None
            self.graphs.stage(plan, size)
            if timer is not None:
                timer.lap("prepare")
            logits = self.graphs.replay(size, len(plan.seq_lens))
            if timer is not None:
                timer.lap("forward", sync=device)
            return logits
        input_ids = torch.from_numpy(plan.input_ids).to(device, non_blocking=True)
        positions = torch.from_numpy(plan.positions).to(device, non_blocking=True)
        logits_indices = torch.from_numpy(plan.logits_indices).to(device, non_blocking=True)
        meta = AttentionMetadata.from_numpy(
            slot_mapping=plan.slot_mapping, query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens,
            context_lens=plan.context_lens, block_tables=plan.block_tables,
            max_query_len=plan.max_query_len, max_seq_len=plan.max_seq_len, device=device)
        if timer is not None:
            timer.lap("prepare")
        forward = self.model.hidden_states if hidden else self.model
        with torch.inference_mode():
            logits = forward(input_ids, positions, self.kv_caches, meta, logits_indices)
        if timer is not None:
            timer.lap("forward", sync=device)
        return logits

    def tier_copies(self, demote: np.ndarray, promote: np.ndarray) -> None:
        """This rank's copies (device block, slot) down, then (slot, device block) up: a block demoted in a step
        may be the device block a promotion of the same step fills."""
        assert self.kv_caches is not None
        if self.tier is None:
            raise RuntimeError("the scheduler planned KV tier copies but this runner has no tier")
        if len(demote):
            self.tier.store(self.kv_caches, demote)
        if len(promote):
            self.tier.load(self.kv_caches, promote)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op without tensor parallelism)."""
        if self.executor is not None:
            self.executor.shutdown()

    def profile(self, num_tokens: int) -> None:
        """A forward over `num_tokens` fresh tokens: compiles kernels / warms allocators / measures peak memory.

        It writes KV rows into the first blocks of the cache; those blocks are free, and a block's
        rows are always written before they are read, so nothing leaks into real requests.
        """
        bs = self.config.block_size
        caches = self.kv_caches
        n = max(1, num_tokens if caches is None else min(num_tokens, self.num_blocks * bs))
        nblocks = -(-n // bs)
        if caches is None:
            caches = allocate_kv_caches(self.model_config, nblocks, bs, self.kv_dtype, self.device)
        meta = AttentionMetadata.from_numpy(
            slot_mapping=np.arange(n, dtype=np.int64), query_start_loc=np.array([0, n], dtype=np.int64),
            seq_lens=np.array([n], dtype=np.int64), context_lens=np.zeros(1, dtype=np.int64),
            block_tables=np.arange(nblocks, dtype=np.int32)[None, :], max_query_len=n, max_seq_len=n,
            device=self.device)
        if self.executor is not None and self._ready:  # the workers run the same forward on their shards
            self.executor.profile(num_tokens)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        with torch.inference_mode():
            self.model(ids, pos, caches, meta, torch.tensor([n - 1], device=self.device))

    def _max_model_len(self, pool_tokens: int) -> int:
        """The configured context length, which the pool must hold; else the model's own, capped to the pool."""
        length = self.config.resolve_max_model_len(self.model_config.max_model_len, self.device.type)
        if None not in self.model_config.layer_windows:
            return length  # every layer slides: a sequence holds only its window's blocks (the core checks each)
        if self.config.max_model_len is None:
            return min(length, pool_tokens)
        if length > pool_tokens:
            raise InvalidArgumentError(
                f"max_model_len ({length}) is larger than the KV cache ({pool_tokens} tokens): raise "
                "kv_cache_memory/num_kv_blocks or lower max_model_len", param="max_model_len")
        return length
