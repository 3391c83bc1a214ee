"""One rank's view of the tensor-parallel group: its shard, the collectives the decoder calls, and their clock.

Two process groups: the forward's (gloo on CPU, nccl on GPU) with the engine's `distributed_timeout`, and a gloo
group for the step plan that rank 0 broadcasts from host memory. A worker waits on the plan group for as long as
the server stays idle, so that group's timeout is long; a rank that dies closes its sockets, which ends the wait at
once anyway. Every collective error becomes a TensorParallelError: the sharded model cannot run another step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ironlm.distributed.sharding import ShardSpec
from ironlm.exceptions import TensorParallelError
from ironlm.model.config import ModelConfig

# How long an idle worker waits for the next plan: a server may sit idle for days.
_PLAN_WAIT = timedelta(days=365)


class TPGroup:
    expert_parallel = False  # MoE layers split their routed experts across the ranks (enable_expert_parallel)

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float,
                 expert_parallel: bool = False) -> None:
        self.rank, self.world = rank, world
        self.expert_parallel = expert_parallel
        self._shard: ShardSpec | None = None
        self.device = device
        self.timeout_s = timeout_s
        self.comm_s = 0.0  # seconds inside collectives so far (waiting for slower ranks included)
        self.broken: str | None = None
        self._plan_group = dist.new_group(backend="gloo", timeout=_PLAN_WAIT)

    @classmethod
    def connect(cls, rank: int, world: int, device: torch.device, timeout_s: float,
                init_method: str | None, expert_parallel: bool = False) -> TPGroup:
        """Join the group (`init_method` None: torchrun's environment)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        return cls(rank, world, device, timeout_s, expert_parallel)

    def bind(self, config: ModelConfig) -> ModelConfig:
        """Fix the model being sharded (once its config is read); returns this rank's share of it."""
        self._shard = ShardSpec(self.rank, self.world, config, self.expert_parallel)
        return self._shard.local_config()

    @property
    def shard(self) -> ShardSpec:
        if self._shard is None:
            raise RuntimeError("TPGroup.bind(config) must run before the model is built")
        return self._shard

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives ---------------------------------------------------------------------------------------
    def _run(self, what: str, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # gloo and nccl raise RuntimeError or DistBackendError
            self.broken = (f"tensor-parallel {what} failed on rank {self.rank} of {self.world} (a rank died or did "
                           f"not answer within {self.timeout_s:g} s): {exc}")
            raise TensorParallelError(self.broken) from exc
        finally:
            self.comm_s += time.perf_counter() - t0

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (the row-parallel layers' partial products)."""
        self._run("all-reduce", dist.all_reduce, t)

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """The vocab-parallel logits [rows, vocab/N] of every rank as [rows, vocab] on rank 0 (None elsewhere)."""
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        self._run("logits gather", dist.gather, local.contiguous(), parts, dst=0)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, : self.shard.config.vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (the KV pool size every rank can hold). On the plan group: the
        ranks reach this point after loading their shards, which may take one rank much longer than another."""
        t = torch.tensor([value], dtype=torch.int64)
        self._run("all-reduce", dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self._plan_group)
        return int(t.item())

    def barrier(self) -> None:
        """Wait (as long as it takes) until every rank is here: before the first timed collective of a forward."""
        self.min_int(0)

    def broadcast_plan(self, buf: torch.Tensor) -> None:
        """Rank 0's step plan (a CPU int64 buffer) to every rank."""
        self._run("plan broadcast", dist.broadcast, buf, 0, group=self._plan_group)
