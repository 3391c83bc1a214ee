"""The serving surface: OpenAI-compatible HTTP API, gRPC service, metrics and auth."""

from ironlm.server.api import build_app

__all__ = ["build_app"]
