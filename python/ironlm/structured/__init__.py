"""Structured outputs (JSON schema, regex, choice, Lark grammar) and tool calling."""

from ironlm.structured.compiler import GrammarCache
from ironlm.structured.params import StructuredOutputsParams
from ironlm.structured.vocab import TokenVocab, token_vocab

__all__ = [
    "GrammarCache",
    "StructuredOutputsParams",
    "TokenVocab",
    "token_vocab",
]
