"""Prompts in, token ids out: the three prompt forms the engine accepts, and chat templates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ironlm.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A string, token ids, or {"prompt": str} / {"prompt_token_ids": [...], "prompt": optional text}, as in vLLM.
PromptType = str | Sequence[int] | dict[str, Any]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: PromptType,
                  vocab_size: int) -> tuple[str | None, list[int]]:
    """(prompt text if known, token ids), with the ids checked against the vocabulary."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), check_token_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" not in prompt:
            raise InvalidArgumentError("prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("prompt must not be empty", param="prompt")
        return prompt, check_token_ids(tokenizer.encode(prompt), vocab_size)
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return None, check_token_ids(prompt, vocab_size)
    raise InvalidArgumentError(
        f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}",
        param="prompt")


def check_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    checked = [int(t) for t in ids]
    if not checked:
        raise InvalidArgumentError("prompt must contain at least one token", param="prompt")
    if min(checked) < 0 or max(checked) >= vocab_size:
        raise InvalidArgumentError(
            f"prompt token ids must be in [0, {vocab_size}), got {min(checked)}..{max(checked)}",
            param="prompt")
    return checked


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
    """Token ids of `messages` rendered by the model's chat template; a bad message is an InvalidArgumentError
    (param "messages")."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list", param="messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
            raise InvalidArgumentError("each message needs a 'role' and a string 'content'", param="messages")
    try:
        # Any: what comes back depends on the tokenizer's version (ids, or a BatchEncoding holding them)
        ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, **kwargs)
    except Exception as exc:
        raise InvalidArgumentError(f"messages: chat template failed: {exc}", param="messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
