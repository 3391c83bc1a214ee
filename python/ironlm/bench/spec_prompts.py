"""Input-grounded prompts for the speculative-decoding benchmark, two sets of 300-1,000-token inputs:

- "copy" (spec_copy_prompts.json, benches/make_spec_prompts.py): 16 passages of this repository's source and
  docs drawn at random, each to be copied word for word. The default model's answers copy about half their
  tokens from the input and paraphrase the rest; the passages were not chosen by how well it copies them.
- "tasks" (spec_prompts.json): 8 "repeat / fix / rewrite / rename in" tasks written by hand, whose answers should
  copy most of their input but, from the 135M default model, mostly describe it instead (about a sixth copied).

Both are frozen snapshots, so the benchmark never depends on the network or on files that change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SETS = {"copy": "spec_copy_prompts.json", "tasks": "spec_prompts.json"}


def load_prompts(name: str = "copy") -> list[str]:
    """The set's user messages, in a fixed order."""
    return [p["text"] for p in json.loads(Path(__file__).with_name(SETS[name]).read_text())]


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """`text` as the user turn of the model's chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
