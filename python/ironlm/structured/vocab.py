"""Token id -> bytes for the grammar engine, from a Hugging Face tokenizer.

The core's token trie needs each token's exact bytes, which `decode` cannot give one token at a time (byte-level
BPE tokens can be partial UTF-8; sentencepiece drops a leading space). Two vocabulary conventions cover the models
ironlm runs: byte-level BPE (GPT-2 style: each byte written as a printable character; Llama 3, Qwen, SmolLM2) and
sentencepiece (`▁` for a space, `<0xNN>` byte-fallback tokens; Llama 2, Mistral). Added tokens are plain text
in either; special ones are flagged so that only a grammar naming them can produce them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"  # ▁


@dataclass(frozen=True)
class TokenVocab:
    token_bytes: list[bytes | None]  # by id; None: an id with no text
    special_token_ids: list[int]
    byte_level: bool  # which convention the regular tokens follow


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in table.items()}


def _decoder_types(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(backend.to_str()).get("decoder"))
    return found


def is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    return "ByteLevel" in _decoder_types(tokenizer)


def byte_level_bytes(token: str) -> bytes | None:
    decoder = _byte_decoder()
    try:
        return bytes(decoder[c] for c in token)
    except KeyError:  # not written in the byte alphabet: not a byte-level token
        return None


def sentencepiece_bytes(token: str) -> bytes:
    m = _BYTE_TOKEN.fullmatch(token)
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace(_SPIECE_SPACE, " ").encode("utf-8")


def token_vocab(tokenizer: PreTrainedTokenizerBase) -> TokenVocab:
    """Every id's bytes (list length: the largest id + 1) and the special ids."""
    byte_level = is_byte_level(tokenizer)
    vocab: dict[str, int] = tokenizer.get_vocab()
    added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    size = max([*vocab.values(), *added.keys(), -1]) + 1
    out: list[bytes | None] = [None] * size
    for text, tid in vocab.items():
        if tid in added:
            continue
        out[tid] = byte_level_bytes(text) if byte_level else sentencepiece_bytes(text)
    special = {int(t) for t in getattr(tokenizer, "all_special_ids", [])}
    for tid, tok in added.items():
        content = str(getattr(tok, "content", tok))
        out[tid] = content.encode("utf-8")
        if getattr(tok, "special", True):
            special.add(tid)
    return TokenVocab(out, sorted(t for t in special if 0 <= t < size), byte_level)
