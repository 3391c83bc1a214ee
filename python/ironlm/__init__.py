from ironlm import _core

__all__ = ["_core"]
