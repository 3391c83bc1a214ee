"""The loop every tensor-parallel rank but 0 runs: receive a step plan, run the forward on its shard, repeat.

Workers never see requests, the scheduler or the sampler: rank 0 owns them and broadcasts only the arrays the
forward reads. A worker ends on rank 0's stop message, or when a collective fails (rank 0 gone, timeout).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pickle
import sys
import threading
from typing import Protocol

import torch

from ironlm.config import EngineConfig
from ironlm.distributed.group import TPGroup
from ironlm.distributed.plan_codec import OP_PROFILE, OP_STEP, OP_STOP, PlanChannel, StepArrays, unpack
from ironlm.exceptions import TensorParallelError

logger = logging.getLogger("ironlm.distributed")


class WorkerRunner(Protocol):
    """What a worker rank needs of the model runner: built on the rank's group, it runs the plans it is sent."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None: ...

    def run(self, plan: StepArrays) -> object: ...

    def profile(self, num_tokens: int) -> object: ...


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """CPU ranks share the CPU; GPU ranks take one device each (the node-local rank's)."""
    from ironlm.model import resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def run_worker(config: EngineConfig, rank: int, world: int, init_method: str | None, threads: int | None,
               local_rank: int, runner_cls: type[WorkerRunner]) -> int:
    """Join the group as `rank`, load the shard and serve rank 0's steps until told to stop; the exit code.
    `runner_cls` is rank 0's runner class (ironlm.engine.model_runner.ModelRunner), handed down rather than
    imported: the engine layer builds on this package, not the other way round."""
    if threads:
        torch.set_num_threads(threads)
    device = rank_device(config, local_rank)
    group = TPGroup.connect(rank, world, device, config.distributed_timeout, init_method,
                            config.enable_expert_parallel)
    try:
        runner = runner_cls(dataclasses.replace(config, device=str(device)), tp=group)
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


def main() -> int:
    """`python -m ironlm.distributed.worker --ready-fd N`: a worker process ironlm started (executor backend `mp`).

    A fresh interpreter, as torchrun's workers are: it never imports the user's `__main__`, so a script that
    builds a tensor-parallel engine at its top level (no `if __name__ == "__main__":` guard) still works.
    Rank 0 writes the pickled launch spec (config, rank, world, rendezvous, threads, runner class; the class
    pickles by name) to stdin and keeps stdin open: its end-of-file means rank 0 is gone, and this process ends
    too rather than outlive it. One byte on `--ready-fd` tells rank 0 this process imported and is joining;
    an end-of-file there before it (this process died) lets rank 0 fail at once instead of in the store."""
    parser = argparse.ArgumentParser(prog="python -m ironlm.distributed.worker")
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args()
    config, rank, world, init_method, threads, runner_cls = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(rank,), daemon=True, name="ironlm-parent-watch").start()
    os.write(args.ready_fd, b"1")
    return run_worker(config, rank, world, init_method, threads, rank, runner_cls)


def _exit_with_parent(rank: int) -> None:
    sys.stdin.buffer.read()  # returns at end-of-file only: rank 0 closed the pipe or died
    logger.error("tensor-parallel rank %d stops: rank 0 is gone", rank)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
