"""The built-in default model (SmolLM2-135M-Instruct, GGUF from PyPI) against transformers."""

from __future__ import annotations

import pytest
import torch

from ironlm import LLM, SamplingParams
from ironlm.model.default import default_model_path
from tiny_models import load_hf_gguf_reference

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three colors."}],
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32 like the transformers reference, on whichever device "auto" picks; the Q4_1 blocks dequantized
    # (quantization="none") so the weights are transformers' own (the quantized path: test_quant_model.py).
    return LLM(kv_cache_memory="256MiB", max_model_len=2048, dtype="float32", quantization="none")


def test_default_model_greedy_matches_transformers(llm: LLM):
    path = default_model_path()
    ref = load_hf_gguf_reference(path).eval()
    prompts = [llm.engine.apply_chat_template(m) for m in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            expected = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == expected


def test_default_model_chat_speaks_english(llm: LLM):
    before = llm.get_metrics()
    out = llm.chat(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop" or len(completion.token_ids) == 32
    metrics = llm.get_metrics()
    assert metrics["num_requests"] == before["num_requests"] + 1
    assert metrics["output_tokens"] == before["output_tokens"] + len(completion.token_ids)
    assert metrics["elapsed_s"] > before["elapsed_s"]
    assert metrics["output_tokens_per_s"] == pytest.approx(metrics["output_tokens"] / metrics["elapsed_s"])
