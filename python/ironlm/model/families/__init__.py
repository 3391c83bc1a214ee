"""One module per model family; importing this package registers them all (see ironlm.model.registry for how a
family is added)."""

from __future__ import annotations

import importlib

FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "smollm3", "granite",
                  "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek", "gpt_oss")

for _name in FAMILY_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
