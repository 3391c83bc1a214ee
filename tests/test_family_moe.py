"""Mixture-of-experts families against transformers: Mixtral (top-2 of 8, renormalised), Qwen2-MoE (gated shared
expert, a dense layer from mlp_only_layers), Qwen3-MoE (renormalised top-k, a dense layer from
decoder_sparse_step), OLMoE (top-3, full-width qk-norm). Greedy tokens equal on the torch and cpu backends with
prefix caching, chunked prefill and preemption in the same run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from family_parity import MAX_NEW, check_engine_greedy, hf_greedy, shared_prefix_prompts
from ironlm.model import load_model
from lean_batch import assert_same_step, decode_batch
from tiny_models import tiny_vocab
from tiny_moe import MOE_VARIANTS, make_moe_model

FAMILIES = sorted(MOE_VARIANTS)


@pytest.fixture(scope="module", params=FAMILIES)
def moe(request, tmp_path_factory):
    path = make_moe_model(tmp_path_factory.mktemp(request.param), request.param)
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    return request.param, path, prompts, [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]


def test_config_and_layers(moe):
    family, path, _, _ = moe
    lm = load_model(path, dtype=torch.float32, device="cpu")
    cfg = lm.config
    assert cfg.moe is not None and cfg.moe.num_experts == 8 and cfg.lean_supported
    sparse = {"qwen2_moe": (True, False, True), "qwen3_moe": (False, True)}.get(family, (True,) * cfg.num_layers)
    assert cfg.moe.sparse_layers == sparse
    assert [layer.moe is not None for layer in lm.model.layers] == list(sparse)
    assert cfg.moe.route.renormalize == (family in ("mixtral", "qwen3_moe"))
    assert (cfg.moe.shared_intermediate_size > 0) == cfg.moe.shared_gate == (family == "qwen2_moe")
    hf_params = sum(p.numel() for p in _hf_model(path).parameters())
    assert cfg.num_parameters() == hf_params


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(moe, backend):
    _, path, prompts, expected = moe
    check_engine_greedy(path, prompts, expected, backend)


def test_routing_shows_in_the_tokens(moe, tmp_path):
    """The parity above is sensitive to routing: the same weights routed to one expert per token instead of the
    config's top-k give other greedy tokens in transformers itself."""
    _, path, prompts, expected = moe
    other = tmp_path / "other"
    shutil.copytree(path, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_experts_per_tok"] = 1
    (other / "config.json").write_text(json.dumps(cfg))
    assert [t for t, _ in hf_greedy(other, prompts, max_new=MAX_NEW)] != expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_step_equals_the_ordinary_forward(moe, dtype, monkeypatch):
    """A decode batch through the lean step (dense layers' matmuls, the MoE block's own call for sparse ones, the
    core's residual add) gives the ordinary forward's logits and cache rows bit for bit."""
    from ironlm.attention import CpuAttention
    from ironlm.model import lean

    _, path, _, _ = moe
    model = load_model(path, dtype=dtype, device="cpu", attn_backend=CpuAttention()).model
    cfg = model.config
    taken: list[int] = []
    real = lean._moe_branch

    def spy(*args, **kwargs):
        taken.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lean, "_moe_branch", spy)
    got = decode_batch(model, dtype, True, monkeypatch)
    assert 3 in model._lean and len(taken) == sum(cfg.moe.sparse_layers), "the lean step's MoE branch was not taken"
    want = decode_batch(model, dtype, False, monkeypatch)
    assert len(taken) == sum(cfg.moe.sparse_layers), "the ordinary forward took the lean step"
    assert_same_step(got, want)
