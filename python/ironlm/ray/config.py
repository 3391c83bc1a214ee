"""`RayConfig`: how ironlm runs as Ray Serve replicas (`python -m ironlm.ray`); one flag per field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ironlm.exceptions import InvalidArgumentError

ROUTINGS = ("prefix", "pow2")


def _opt(default: Any, help: str, **cli: Any) -> Any:
    return field(default=default, metadata={"help": help, **cli})


def _invalid(param: str, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{param}: {reason}", param=param)


@dataclass
class RayConfig:
    """Replica count or autoscaling bounds, per-replica resources, routing and retries."""

    ray_address: str | None = _opt(None, "Ray cluster to join (default: start a local one)")
    num_replicas: int = _opt(1, "engine replicas when not autoscaling")
    min_replicas: int | None = _opt(None, "autoscale on ongoing requests between this and --max-replicas")
    max_replicas: int | None = _opt(None, "upper bound of autoscaling (setting it turns autoscaling on)")
    target_ongoing_requests: float = _opt(
        8.0, "autoscaling: requests in flight per replica the autoscaler aims for", metavar="N")
    max_ongoing_requests: int = _opt(64, "requests one replica takes at once; more wait in the router")
    replica_cpus: float = _opt(1.0, "CPUs reserved per engine replica (Ray's logical num_cpus)")
    replica_gpus: float = _opt(0.0, "GPUs reserved per engine replica")
    routing: str = _opt("prefix", "prefix: prefix affinity, else power of two choices; pow2: power of two "
                        "choices only", choices=ROUTINGS)
    affinity_block: int = _opt(
        256, "leading prompt characters (token ids for a token prompt) whose hash is the affinity key; shorter "
        "prompts are routed by load alone", metavar="N")
    affinity_margin: int = _opt(
        4, "a prefix's replica is passed over when it has this many more requests in flight than the least "
        "loaded replica", metavar="N")
    max_retries: int = _opt(3, "retries of a request whose replica died before its first token")
    health_check_period: float = _opt(10.0, "seconds between Ray Serve's calls of the engine's health",
                                      metavar="S")
    health_check_timeout: float = _opt(30.0, "seconds a health check may take before the replica is replaced",
                                       metavar="S")

    def __post_init__(self) -> None:
        for name in ("num_replicas", "max_ongoing_requests", "affinity_block"):
            if not _positive_int(getattr(self, name)):
                raise _invalid(name, f"must be a positive integer, got {getattr(self, name)!r}")
        for name in ("affinity_margin", "max_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _invalid(name, f"must be an integer >= 0, got {value!r}")
        if self.min_replicas is not None and (not isinstance(self.min_replicas, int) or self.min_replicas < 0):
            raise _invalid("min_replicas", f"must be an integer >= 0, got {self.min_replicas!r}")
        if self.max_replicas is not None:
            if not _positive_int(self.max_replicas):
                raise _invalid("max_replicas", f"must be a positive integer, got {self.max_replicas!r}")
            if (self.min_replicas or 0) > self.max_replicas:
                raise _invalid("min_replicas", f"must be <= max_replicas ({self.max_replicas}), "
                               f"got {self.min_replicas}")
        elif self.min_replicas is not None:
            raise _invalid("max_replicas", "is required when min_replicas is set (it turns autoscaling on)")
        for name in ("target_ongoing_requests", "health_check_period", "health_check_timeout"):
            if not getattr(self, name) > 0:
                raise _invalid(name, f"must be > 0, got {getattr(self, name)!r}")
        for name in ("replica_cpus", "replica_gpus"):
            if not getattr(self, name) >= 0:
                raise _invalid(name, f"must be >= 0, got {getattr(self, name)!r}")
        if self.routing not in ROUTINGS:
            raise _invalid("routing", f"must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
