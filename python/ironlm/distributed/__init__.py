"""Tensor parallelism on torch.distributed: Megatron sharding of the decoder across ranks (sharding.py), the
collectives it calls (group.py), the per-step plan broadcast (plan_codec.py), rank 0's executor (executor.py) and
the other ranks' loop (worker.py). ModelRunner wires them in when `tensor_parallel_size > 1`."""

from ironlm.distributed.sharding import ShardSpec

__all__ = ["ShardSpec"]
