"""Structured outputs (JSON schema, regex, choice, Lark grammar) and tool calling."""

from ironlm.structured.params import StructuredOutputsParams

__all__ = [
    "StructuredOutputsParams",
]
