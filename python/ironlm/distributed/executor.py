"""Rank 0's side of tensor parallelism: start (or join) the other ranks, hand them each step, watch them, stop them.

`mp` (default) starts ranks 1..N-1 on this node as `python -m ironlm.distributed.worker` processes (fresh
interpreters that never import the user's `__main__`, as torchrun's are) with a loopback TCP rendezvous. A worker
that dies before it joins is reported at once (its ready pipe closes), not after the store's timeout; every step
first polls the workers, so one that died later is reported at the next step without waiting for a collective
to time out. `torchrun` joins the group torchrun set up through its environment; there only the
collectives (closed sockets, `distributed_timeout`) reveal a dead rank. On a torchrun rank other than 0, building
the engine runs the worker loop instead and exits the process when rank 0 stops.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import wait

import numpy as np
import torch

from ironlm.config import EngineConfig
from ironlm.distributed.group import TPGroup
from ironlm.distributed.plan_codec import OP_PROFILE, OP_STEP, OP_STOP, PlanChannel, StepArrays, pack
from ironlm.distributed.worker import WorkerRunner, rank_device, run_worker
from ironlm.exceptions import InvalidArgumentError, TensorParallelError

logger = logging.getLogger("ironlm.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_threads(world: int, device: torch.device) -> int | None:
    """torch threads per rank: on CPU the ranks share the cores evenly."""
    return max(1, torch.get_num_threads() // world) if device.type == "cpu" else None


def _launch(spec: tuple[object, ...]) -> tuple[subprocess.Popen[bytes], int]:
    """Start worker `rank` (`spec`: what worker.main unpickles); returns it and the read end of its ready pipe."""
    ready_r, ready_w = os.pipe()
    env = dict(os.environ)
    # The parent's import path, as multiprocessing's spawn passes it: whatever rank 0 imported ironlm and the
    # runner class from, the worker finds too.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ironlm.distributed.worker", "--ready-fd", str(ready_w)],
                                stdin=subprocess.PIPE, pass_fds=(ready_w,), env=env)
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    assert proc.stdin is not None
    try:
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.flush()  # stdin stays open: the worker ends when it closes (rank 0 gone)
    except BrokenPipeError:
        pass  # it died at once; its ready pipe's end-of-file reports that
    return proc, ready_r


def _await_ready(procs: list[subprocess.Popen[bytes]], fds: list[int], timeout_s: float) -> None:
    """Wait until every worker has imported and is joining the group; raise at once if one died first."""
    pending = dict(zip(fds, range(1, len(fds) + 1)))
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        ready = wait(list(pending), timeout=max(0.0, left)) if left > 0 else []
        if not ready:
            ranks = ", ".join(str(r) for r in pending.values())
            raise TensorParallelError(f"tensor-parallel worker rank {ranks} did not start within {timeout_s:g} s "
                                      "(distributed_timeout)")
        for fd in ready:
            assert isinstance(fd, int)
            rank = pending.pop(fd)
            if not os.read(fd, 1):  # end-of-file before the ready byte: the process exited
                proc = procs[rank - 1]
                code = proc.wait(timeout=10)
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code} before joining "
                    "the group; its error is printed above")


class TPExecutor:
    def __init__(self, group: TPGroup, procs: list[subprocess.Popen[bytes]]) -> None:
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
        procs: list[subprocess.Popen[bytes]] = []
        fds: list[int] = []
        try:
            for rank in range(1, world):
                proc, fd = _launch((config, rank, world, init, threads, runner_cls))
                procs.append(proc)
                fds.append(fd)
            _await_ready(procs, fds, config.distributed_timeout)
        except BaseException:
            _stop(procs)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            group = TPGroup.connect(0, world, device, config.distributed_timeout, init,
                                    config.enable_expert_parallel)
        except Exception:
            _stop(procs)
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
        return cls(TPGroup.connect(0, world, device, config.distributed_timeout, None,
                                   config.enable_expert_parallel), [])

    # ---- per step --------------------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Raise TensorParallelError if a spawned worker has exited."""
        if self.group.broken is not None:
            raise TensorParallelError(self.group.broken)
        dead = [p for p in self.procs if p.poll() is not None]
        if not dead:
            return
        what = ", ".join(f"rank {self.procs.index(p) + 1} (pid {p.pid}, exit code {p.returncode})" for p in dead)
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
        _stop(self.procs, grace_s=10)
        self.group.close()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 0.0) -> None:
    """Wait up to `grace_s` for each worker to end, kill any that lingers, close its stdin."""
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
        if p.stdin is not None:
            p.stdin.close()
