"""The HF transformers baseline, tuned the way a careful user would run it.

- `torch.inference_mode`, the KV cache on (`use_cache=True`), the same dtype and device as ironlm.
- Greedy decoding on both sides (ironlm runs with temperature 0).
- EOS ignored by generating with `eos_token_id=None`: no sequence stops early, and the logits are not
  touched (min_new_tokens would mask EOS and change what greedy picks).
- One at a time: each request alone, with its own `max_new_tokens`.
- Static batches of B requests in arrival order, LEFT padded with an attention mask; a batch runs to
  its longest request's output length, and only each request's own `output_len` tokens are counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ironlm.bench.datasets import BenchRequest


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# A transformers causal LM (PreTrainedModel + GenerationMixin). Not spelled out: transformers' own annotations
# do not type-check under mypy (`.to` is a functools.wraps object that mypy cannot bind to the instance).
HFModel = Any


def load_hf_model(model_path: str | Path, dtype: torch.dtype, device: torch.device) -> HFModel:
    """`from_pretrained` for a HF folder or a .gguf file (dequantized to `dtype`, like ironlm does)."""
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    model: HFModel
    if path.suffix != ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        except ValueError as exc:  # transformers insists on `accelerate` for GGUF; load the same tensors without it
            if "accelerate" not in str(exc):
                raise
            model = _load_gguf_without_accelerate(path, dtype)
    # EOS is ignored, as in ironlm's runs: a None in generate()'s config would fall back to these defaults.
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model.to(device).eval()


def _load_gguf_without_accelerate(path: Path, dtype: torch.dtype) -> HFModel:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF weights do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(dtype)


@dataclass
class BaselineRun:
    label: str
    batch_size: int  # 1 = one at a time
    elapsed_s: float
    output_tokens: int  # counted: each request's own output_len
    generated_tokens: int  # produced, padding rows to the batch max included
    prompt_tokens: int
    num_requests: int
    first_tokens: list[int]


class TransformersBaseline:
    def __init__(self, model_path: str | Path, dtype: torch.dtype, device: torch.device,
                 pad_token_id: int = 0) -> None:
        self.device = device
        self.dtype = dtype
        self.pad_token_id = pad_token_id
        self.model = load_hf_model(model_path, dtype, device)

    def _generate(self, reqs: Sequence[BenchRequest]) -> tuple[torch.Tensor, int]:
        """Left-padded greedy generation to the batch's longest output; returns (new tokens [B, T], T)."""
        from transformers import GenerationConfig

        width = max(r.prompt_len for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, width - r.prompt_len:] = 1
        max_new = max(r.output_len for r in reqs)
        config = GenerationConfig(max_new_tokens=max_new, do_sample=False, use_cache=True,
                                  eos_token_id=None, pad_token_id=self.pad_token_id)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config)
        new = out[:, width:]
        if new.shape[1] != max_new:  # would mean EOS stopped it: the counts below would be wrong
            raise RuntimeError(f"transformers generated {new.shape[1]} tokens, expected {max_new}")
        return new, max_new

    def run(self, reqs: Sequence[BenchRequest], batch_size: int,
            progress: Callable[[int], None] | None = None) -> BaselineRun:
        """Static batches of `batch_size` (1 = one at a time) in arrival order, timed end to end."""
        counted = generated = 0
        first: list[int] = []
        sync(self.device)
        t0 = time.perf_counter()
        for start in range(0, len(reqs), batch_size):
            batch = reqs[start:start + batch_size]
            new, width = self._generate(batch)
            counted += sum(min(r.output_len, width) for r in batch)
            generated += width * len(batch)
            first.extend(new[:, 0].tolist())
            if progress is not None:
                progress(len(batch))
        sync(self.device)
        elapsed = time.perf_counter() - t0
        label = "transformers 1-at-a-time" if batch_size == 1 else f"transformers static bs={batch_size}"
        return BaselineRun(label, batch_size, elapsed, counted, generated, sum(r.prompt_len for r in reqs),
                           len(reqs), first)
