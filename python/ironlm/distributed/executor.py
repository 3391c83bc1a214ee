"""Rank 0's side of tensor parallelism: start (or join) the other ranks, hand them each step, watch them, stop them.

`mp` (default) spawns ranks 1..N-1 on this node with torch.multiprocessing and a loopback TCP rendezvous; every
step first polls their process sentinels, so a worker that died is reported at the next step without waiting for
a collective to time out. `torchrun` joins the group torchrun set up through its environment; there only the
collectives (closed sockets, `distributed_timeout`) reveal a dead rank. On a torchrun rank other than 0, building
the engine runs the worker loop instead and exits the process when rank 0 stops.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import numpy as np
import torch

from ironlm.config import EngineConfig
from ironlm.distributed.group import TPGroup
from ironlm.distributed.plan_codec import OP_PROFILE, OP_STEP, OP_STOP, PlanChannel, StepArrays, pack
from ironlm.distributed.worker import WorkerRunner, rank_device, run_worker, spawned_main
from ironlm.exceptions import InvalidArgumentError, TensorParallelError

logger = logging.getLogger("ironlm.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_threads(world: int, device: torch.device) -> int | None:
    """torch threads per rank: on CPU the ranks share the cores evenly."""
    return max(1, torch.get_num_threads() // world) if device.type == "cpu" else None


class TPExecutor:
    def __init__(self, group: TPGroup, procs: list[BaseProcess]) -> None:
        self.group = group
        self.procs = procs
        self.channel = PlanChannel(group.broadcast_plan)
        self.stopped = False
        self.threads_before: int | None = None  # rank 0's torch threads before it took its share of the cores
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, config: EngineConfig, runner_cls: type[WorkerRunner]) -> TPExecutor:
        """Start (mp) or join (torchrun) the other ranks; each builds a `runner_cls` on its shard."""
        world = config.tensor_parallel_size
        if torch.distributed.is_initialized():
            raise InvalidArgumentError(
                "tensor_parallel_size: this process already belongs to a torch.distributed group (another "
                "tensor-parallel engine?); shut it down first (engine.runner.shutdown())", "tensor_parallel_size")
        if config.distributed_executor_backend == "torchrun":
            return cls._join_torchrun(config, world, runner_cls)
        device = rank_device(config, 0)
        threads = rank_threads(world, device)
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        procs: list[BaseProcess] = []
        for rank in range(1, world):
            p = ctx.Process(target=spawned_main, args=(config, rank, world, init, threads, runner_cls), daemon=True,
                            name=f"ironlm-tp-rank{rank}")
            p.start()
            procs.append(p)
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            group = TPGroup.connect(0, world, device, config.distributed_timeout, init)
        except Exception:
            for proc in procs:
                proc.kill()
            torch.set_num_threads(before)
            raise
        logger.info("tensor parallel: %d ranks, workers %s", world, [proc.pid for proc in procs])
        executor = cls(group, procs)
        executor.threads_before = before
        return executor

    @classmethod
    def _join_torchrun(cls, config: EngineConfig, world: int, runner_cls: type[WorkerRunner]) -> TPExecutor:
        env_world = int(os.environ.get("WORLD_SIZE", "0"))
        if env_world != world:
            raise InvalidArgumentError(
                f"tensor_parallel_size: {world} but torchrun started WORLD_SIZE={env_world or 'unset'} processes",
                "tensor_parallel_size")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        device = rank_device(config, local_rank)
        threads = rank_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)), device)
        if rank != 0:  # not the serving rank: be a worker, then end the process (nothing else must run here)
            sys.exit(run_worker(config, rank, world, None, threads, local_rank, runner_cls))
        if threads:
            torch.set_num_threads(threads)
        return cls(TPGroup.connect(0, world, device, config.distributed_timeout, None), [])

    # ---- per step --------------------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Raise TensorParallelError if a spawned worker has exited."""
        if self.group.broken is not None:
            raise TensorParallelError(self.group.broken)
        if not self.procs or not wait([p.sentinel for p in self.procs], timeout=0):
            return
        dead = [p for p in self.procs if not p.is_alive()]
        what = ", ".join(f"rank {self.procs.index(p) + 1} (pid {p.pid}, exit code {p.exitcode})" for p in dead)
        self.group.broken = f"tensor-parallel worker {what} exited; the sharded model cannot run"
        logger.error("%s", self.group.broken)
        raise TensorParallelError(self.group.broken)

    def _send(self, packed: np.ndarray) -> None:
        self.check_workers()
        self.channel.send(packed)

    def step(self, arrays: StepArrays) -> None:
        self._send(pack(OP_STEP, arrays))

    def profile(self, num_tokens: int) -> None:
        self._send(pack(OP_PROFILE, arg=num_tokens))

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then a kill for any that lingers) and leave the group."""
        if self.stopped:
            return
        self.stopped = True
        atexit.unregister(self.shutdown)
        if self.group.broken is None:
            try:
                self._send(pack(OP_STOP))
            except TensorParallelError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.group.close()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
