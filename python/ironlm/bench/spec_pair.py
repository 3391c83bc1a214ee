"""A random-weight target / draft pair for the draft-model benchmark, built with transformers, sharing the default
model's tokenizer (so the shipped prompts tokenize the same for both).

- `random`: the target has SmolLM2-360M's shape (960 wide, 32 layers, 15 / 5 heads), the draft SmolLM2-135M's
  (576 wide, 30 layers, 9 / 3 heads), independent weights: what acceptance two unrelated models reach.
- `truncated`: the draft is the target's embeddings, first `draft_layers` layers, final norm and head (a smaller
  model whose predictions are correlated with the target's, as a trained draft's are).

Embeddings are untied: with tied random embeddings every random model's argmax is the token it was just given
(logits = E·h with h close to E[token]), so any two of them would agree on everything.

`tiny` shrinks both (seconds to build and run: for checking the benchmark itself, never for figures).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_SHAPES: dict[str, dict[str, int]] = {
    "target": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
               "num_key_value_heads": 5},
    "draft": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3},
    "tiny_target": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2},
    "tiny_draft": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1},
}


def _config(shape: dict[str, int], vocab_size: int, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    kw: dict[str, Any] = {"vocab_size": vocab_size, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
                          "tie_word_embeddings": False, "initializer_range": 0.02,
                          "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **shape}
    return LlamaConfig(**kw)


def _save(model: Any, tokenizer: Any, out: Path) -> Path:
    model.to(torch.bfloat16).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def build_pair(root: Path, kind: str = "truncated", tiny: bool = False, draft_layers: int = 4,
               seed: int = 0) -> tuple[Path, Path]:
    """(target folder, draft folder) under `root`, built once per (kind, size, draft_layers, seed)."""
    from transformers import LlamaForCausalLM

    from ironlm.model import load_model

    tag = f"{kind}-{'tiny' if tiny else 'full'}-{draft_layers}-{seed}"
    target_dir, draft_dir = root / f"target-{tag}", root / f"draft-{tag}"
    if (target_dir / "config.json").exists() and (draft_dir / "config.json").exists():
        return target_dir, draft_dir
    default = load_model(None, device="cpu")
    tokenizer, vocab = default.tokenizer, default.config.vocab_size
    torch.manual_seed(seed)
    target = LlamaForCausalLM(_config(_SHAPES["tiny_target" if tiny else "target"], vocab, tokenizer)).eval()
    if kind == "random":
        draft = LlamaForCausalLM(_config(_SHAPES["tiny_draft" if tiny else "draft"], vocab, tokenizer)).eval()
    elif kind == "truncated":
        shape = dict(_SHAPES["tiny_target" if tiny else "target"], num_hidden_layers=draft_layers)
        draft = LlamaForCausalLM(_config(shape, vocab, tokenizer)).eval()
        own = target.state_dict()
        draft.load_state_dict({k: v for k, v in own.items() if k in draft.state_dict()})
    else:
        raise ValueError(f"pair kind must be 'random' or 'truncated', got {kind!r}")
    return _save(target, tokenizer, target_dir), _save(draft, tokenizer, draft_dir)
