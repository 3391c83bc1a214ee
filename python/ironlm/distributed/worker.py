"""The loop every tensor-parallel rank but 0 runs: receive a step plan, run the forward on its shard, repeat.

Workers never see requests, the scheduler or the sampler: rank 0 owns them and broadcasts only the arrays the
forward reads. A worker ends on rank 0's stop message, or when a collective fails (rank 0 gone, timeout).
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch

from ironlm.config import EngineConfig
from ironlm.distributed.group import TPGroup
from ironlm.distributed.plan_codec import OP_PROFILE, OP_STEP, OP_STOP, PlanChannel, unpack
from ironlm.exceptions import TensorParallelError

logger = logging.getLogger("ironlm.distributed")


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """CPU ranks share the CPU; GPU ranks take one device each (the node-local rank's)."""
    from ironlm.model import resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def run_worker(config: EngineConfig, rank: int, world: int, init_method: str | None, threads: int | None,
               local_rank: int) -> int:
    """Join the group as `rank`, load the shard and serve rank 0's steps until told to stop; the exit code."""
    from ironlm.engine.model_runner import ModelRunner

    if threads:
        torch.set_num_threads(threads)
    device = rank_device(config, local_rank)
    group = TPGroup.connect(rank, world, device, config.distributed_timeout, init_method)
    try:
        runner = ModelRunner(dataclasses.replace(config, device=str(device)), tp=group)
        channel = PlanChannel(group.broadcast_plan)
        while True:
            op, arrays, arg = unpack(channel.receive())
            if op == OP_STOP:
                return 0
            if op == OP_STEP:
                assert arrays is not None
                runner.run(arrays)
            elif op == OP_PROFILE:
                runner.profile(arg)
    except TensorParallelError as exc:
        logger.error("tensor-parallel rank %d stops: %s", rank, exc)
        return 1
    finally:
        group.close()


def spawned_main(config: EngineConfig, rank: int, world: int, init_method: str, threads: int | None) -> None:
    """Entry point of a worker process ironlm spawned (executor backend `mp`)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    sys.exit(run_worker(config, rank, world, init_method, threads, rank))
