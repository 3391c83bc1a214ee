"""Input-grounded prompts for the speculative-decoding benchmark: "repeat / fix / rewrite this code or text"
tasks whose answers copy much of their 300-1,000-token input (where prompt lookup proposes well).

The texts are a frozen snapshot of a few of this repository's own files (spec_prompts.json), so the benchmark
never depends on the network or on files that change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_FILE = Path(__file__).with_name("spec_prompts.json")


def load_prompts() -> list[str]:
    """The user messages, in a fixed order."""
    return [p["text"] for p in json.loads(_FILE.read_text())]


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """`text` as the user turn of the model's chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
