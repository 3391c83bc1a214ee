"""ironlm on Ray Serve (optional extra `ironlm[ray]`): engine replicas behind one ingress, routed by prefix
affinity. `python -m ironlm.ray` runs it; `build_application` returns the Serve application for `serve.run`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ironlm.ray.config import RayConfig

if TYPE_CHECKING:
    from ironlm.ray.app import build_application

__all__ = ["RayConfig", "build_application"]


def __getattr__(name: str) -> Any:
    # Ray is imported on first use only: RayConfig (and the CLI's --help) work without the extra installed.
    if name == "build_application":
        from ironlm.ray.app import build_application

        return build_application
    raise AttributeError(name)
