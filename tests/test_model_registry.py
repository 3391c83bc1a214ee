"""The architecture registry (ironlm.model.registry): lookups, the listing `ironlm models` and the
unsupported-architecture error print, family weight renames, and the lean CPU decode step behind the backend's
declared capability (not its name)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ironlm.cli import main
from ironlm.exceptions import UnsupportedModelError
from ironlm.model import load_model, registry, weights
from ironlm.model.config import ModelConfig
from tiny_models import make_tiny_model, tiny_hf_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_family_resolves_by_model_type_and_gguf_arch():
    fams = registry.families()
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"} <= {f.name for f in fams}
    for f in fams:
        for t in f.model_types:
            assert registry.by_model_type(t) is f
        for a in f.gguf_archs:
            assert registry.by_gguf_arch(a) is f
    assert registry.supported_model_types()["gemma3_text"] == "Gemma3ForCausalLM"


def test_a_model_type_cannot_be_registered_twice():
    clash = registry.Family(name="not-llama", hf_classes=("X",), model_types=("llama",))
    with pytest.raises(ValueError, match="already registered by family 'llama'"):
        registry.register(clash)
    assert registry.by_model_type("llama").name == "llama"


def test_unsupported_architecture_lists_the_families_and_their_features(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(folder, device="cpu")
    msg = str(err.value)
    assert "GPT2LMHeadModel (model_type='gpt2')" in msg
    for needle in ("LlamaForCausalLM", "Gemma2ForCausalLM (gemma2, GGUF gemma2)", "attention logit soft-capping",
                   "Gemma3ForCausalLM (gemma3_text, GGUF gemma3)", "local RoPE base"):
        assert needle in msg


def test_an_activation_the_family_lacks_is_refused():
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu' for llama"):
        ModelConfig.from_hf(tiny_hf_config("llama", hidden_act="gelu"))


def test_ironlm_models_lists_every_family(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for f in registry.families():
        assert f"{'/'.join(f.hf_classes)}  (model_type {', '.join(f.model_types)}" in out
        for feature in f.features:
            assert feature in out


def test_gemma_weight_names_map_onto_ironlms():
    cfg = ModelConfig.from_hf(tiny_hf_config("gemma2"))
    p = "model.layers.1."
    assert weights.canonical(cfg, p + "post_attention_layernorm.weight") == p + "post_attn_norm.weight"
    assert weights.canonical(cfg, p + "pre_feedforward_layernorm.weight") == p + "post_attention_layernorm.weight"
    assert weights.canonical(cfg, p + "post_feedforward_layernorm.weight") == p + "post_mlp_norm.weight"
    llama = ModelConfig.from_hf(tiny_hf_config("llama"))
    assert weights.canonical(llama, p + "post_attention_layernorm.weight") == p + "post_attention_layernorm.weight"
    assert weights.gguf_to_hf("blk.1.post_ffw_norm.weight") == p + "post_mlp_norm.weight"
    assert weights.gguf_to_hf("blk.1.ffn_norm.weight") == p + "post_attention_layernorm.weight"


def test_gemma_norms_are_folded_exactly_at_load(tmp_path):
    """1 + w in fp32 (what Gemma's RMSNorm multiplies by) is what the parameters hold after an HF load."""
    from safetensors import safe_open

    path = make_tiny_model(tmp_path, arch="gemma2")
    lm = load_model(path, dtype=torch.float32, device="cpu").model
    with safe_open(str(path / "model.safetensors"), framework="pt") as sf:
        w = sf.get_tensor("model.layers.0.post_attention_layernorm.weight")
        final = sf.get_tensor("model.norm.weight")
    assert torch.equal(lm.layers[0].attn_out_norm, w + 1.0)
    assert torch.equal(lm.norm, final + 1.0)


class _NoCapability:
    """The CPU backend's attention without the fused-qkv capability: the lean step must not be taken."""

    def __init__(self) -> None:
        from ironlm.attention import CpuAttention

        self.inner = CpuAttention()
        self.name = "cpu"  # a name alone does not grant the lean step
        self.fused_decode_qkv = False

    def forward(self, *args, **kwargs):
        return self.inner.forward(*args, **kwargs)


def _decode_once(lm) -> torch.Tensor:
    from ironlm.attention import AttentionMetadata

    cfg, bs = lm.config, 4
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(8, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen),
               torch.randn(8, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)) for _ in range(cfg.num_layers)]
    ctx = np.array([5, 9])
    meta = AttentionMetadata.from_lengths(context_lens=ctx, query_lens=np.ones(2, np.int64),
                                          block_tables=np.arange(8, dtype=np.int32).reshape(2, 4), block_size=bs)
    return lm(torch.tensor([3, 17]), torch.from_numpy(ctx), caches, meta, torch.tensor([0, 1]))


@pytest.mark.parametrize("arch,lean", [("llama", True), ("gemma2", True), ("gemma3_text", True), ("olmo2", True),
                                       ("smollm3", True), ("granite", True), ("phi3", False)])
def test_lean_step_follows_the_backend_capability_and_the_block_shape(tmp_path, arch, lean):
    """Every family whose block the lean step implements takes it (post-norms, qk-norm per head or full width,
    GELU, NoPE layers, Granite's multipliers) and gets the ordinary forward's logits; Phi-3's partial rotary does
    not take it."""
    from ironlm.attention import CpuAttention
    from tiny_families import FAMILY_VARIANTS, make_family_model

    if arch in FAMILY_VARIANTS:
        family, overrides = FAMILY_VARIANTS[arch]
        path = make_family_model(tmp_path, family, **overrides)
    else:
        path = make_tiny_model(tmp_path, arch=arch)
    lm = load_model(path, dtype=torch.float32, device="cpu", attn_backend=CpuAttention()).model
    assert lm.config.lean_supported == lean
    want = _decode_once(lm)
    assert bool(lm._lean) == lean  # taken only by blocks it implements on a backend that declares the capability
    lm._lean.clear()
    lm.set_attention_backend(_NoCapability())
    torch.testing.assert_close(_decode_once(lm), want, atol=1e-4, rtol=1e-4)
    assert not lm._lean


def test_attention_never_imports_the_model_package():
    for path in (ROOT / "python" / "ironlm" / "attention").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("ironlm.model"), f"{path.name} imports {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("ironlm.model") for a in node.names), path.name
