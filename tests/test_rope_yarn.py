"""ironlm's own YaRN frequencies (model/layers.py) against transformers' rope init, for the parameter sets the
families use: gpt-oss (truncate False, factor 32 over 4096), Qwen-style (truncate default True), DeepSeek's
mscale / mscale_all_dim ratio, an explicit attention_factor, factor <= 1, and factor left to the context ratio."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ironlm.model.config import ModelConfig
from ironlm.model.layers import rope_inv_freq

CASES = {
    "gpt-oss": {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096},
    "truncated": {"factor": 4.0, "original_max_position_embeddings": 32768},
    "mscale": {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
               "original_max_position_embeddings": 4096},
    "attention-factor": {"factor": 8.0, "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0,
                         "original_max_position_embeddings": 2048},
    "no-scaling": {"factor": 1.0, "original_max_position_embeddings": 4096},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("head_dim,theta", [(64, 150000.0), (128, 10000.0)])
def test_yarn_matches_transformers(name: str, head_dim: int, theta: float) -> None:
    rope = {"rope_type": "yarn", "rope_theta": theta, **CASES[name]}
    cls = GptOssConfig if name == "gpt-oss" else LlamaConfig
    hf = cls(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
             num_hidden_layers=2, intermediate_size=64, vocab_size=64, max_position_embeddings=131072,
             rope_parameters=rope)
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    cfg = ModelConfig.from_hf(hf)
    cfg.hf_config = None  # ironlm's own computation: nothing may come from transformers (as for a GGUF file)
    got, scale = rope_inv_freq(cfg)
    assert torch.equal(got, want.float()), (got - want).abs().max()
    assert scale == pytest.approx(want_scale, rel=1e-12)
    if name != "no-scaling":  # and the scaling does change the frequencies
        assert not torch.allclose(got, 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def test_yarn_factor_from_the_context_ratio() -> None:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 4096}
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                     vocab_size=64, max_position_embeddings=16384, rope_parameters=rope)
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    got, scale = rope_inv_freq(ModelConfig.from_hf(hf))
    assert torch.equal(got, want.float()) and scale == pytest.approx(want_scale)
