"""`route` and `MoeBlock` against transformers' own routers and sparse MoE blocks, module by module: every family's
routing (softmax / sigmoid / top-k-then-softmax, renormalisation, grouped top-k, router and correction biases,
scaling) picks the same experts with the same weights, and the block's output (only routed experts run, shared
expert with its sigmoid gate, gpt-oss's clamped SwiGLU through the activation hook) equals the HF block's."""

from __future__ import annotations

import pytest
import torch

from ironlm.exceptions import UnsupportedModelError
from ironlm.model.moe.experts import MoeBlock
from ironlm.model.moe.route import route
from ironlm.model.moe.spec import MoeConfig, RouteSpec, sparse_layers

H, T = 32, 40


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) in expert-id order per token: some HF routers return top-k unsorted."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _check(hf_router: torch.nn.Module, spec: RouteSpec, **biases: torch.Tensor | None) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.5)
        x = torch.randn(T, H)
        _, hw, hi = hf_router(x)
        w, i = route(x @ hf_router.weight.t().float(), spec, **biases)
    hw, hi = _sorted(hw.float(), hi)
    w, i = _sorted(w, i)
    assert torch.equal(i, hi)
    torch.testing.assert_close(w, hw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_like_qwen_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    _check(Qwen3MoeTopKRouter(cfg), RouteSpec(8, 3, renormalize=norm))


def test_mixtral_renormalises():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2)
    _check(MixtralTopKRouter(cfg), RouteSpec(8, 2, renormalize=True))


def test_olmoe():
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

    cfg = OlmoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)
    _check(OlmoeTopKRouter(cfg), RouteSpec(16, 4))


def test_gpt_oss_router_bias_then_softmax_over_topk():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=4)
    router = GptOssTopKRouter(cfg)
    with torch.no_grad():
        router.bias.normal_(0, 1.0)
    _check(router, RouteSpec(8, 4, scoring="topk_softmax"), logit_bias=router.bias)


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_grouped_sigmoid_with_correction(norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        # large enough to change which experts win: selection must use it, the weights must not
        router.e_score_correction_bias.normal_(0, 0.3)
    spec = RouteSpec(16, 4, scoring="sigmoid", renormalize=norm, renorm_eps=1e-20, n_group=4, topk_group=2,
                     group_score="top2_sum", scaling=2.5)
    _check(router, spec, correction=router.e_score_correction_bias)
    x = torch.randn(T, H)
    with torch.no_grad():
        logits = x @ router.weight.t()
    steered = route(logits, spec, correction=router.e_score_correction_bias)[1].sort(dim=-1)[0]
    assert not torch.equal(steered, route(logits, spec)[1].sort(dim=-1)[0])  # the bias changed some choice


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                           topk_method=method, routed_scaling_factor=1.5)
    grouped = method == "group_limited_greedy"
    spec = RouteSpec(16, 3, n_group=4 if grouped else 1, topk_group=2 if grouped else 1, scaling=1.5)
    _check(DeepseekV2TopkRouter(cfg), spec)


def test_group_limit_really_limits():
    """With one group allowed, every chosen expert of a token lies in one group."""
    spec = RouteSpec(16, 3, scoring="sigmoid", n_group=4, topk_group=1, group_score="top2_sum")
    _, ids = route(torch.randn(64, 16), spec)
    assert (ids // 4 == ids[:, :1] // 4).all()


def test_bad_specs_are_refused():
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        RouteSpec(4, 5)
    with pytest.raises(UnsupportedModelError, match="n_group"):
        RouteSpec(10, 2, n_group=4)
    with pytest.raises(UnsupportedModelError, match="topk_group"):
        RouteSpec(16, 6, n_group=4, topk_group=1)
    with pytest.raises(UnsupportedModelError, match="scoring"):
        RouteSpec(8, 2, scoring="relu")


def test_sparse_layers():
    assert sparse_layers(4) == (True,) * 4
    assert sparse_layers(4, step=2) == (False, True, False, True)
    assert sparse_layers(4, dense=[0, 3]) == (False, True, True, False)
    assert sparse_layers(4, first_dense=1) == (False, True, True, True)


# ---- the block ----------------------------------------------------------------------------------------------
def _load_stacked(block: MoeBlock, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """HF's stacked [E, out, in] expert tensors into the block's [E, in, out] ones."""
    block.router_weight.copy_(router_w.t())
    block.gate_up_weight.copy_(gate_up.transpose(1, 2))
    block.down_weight.copy_(down.transpose(1, 2))


def _randomise(module: torch.nn.Module) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)


def test_block_equals_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    hf = MixtralSparseMoeBlock(cfg).eval()
    _randomise(hf)
    block = MoeBlock(H, MoeConfig(RouteSpec(8, 2, renormalize=True), 48, (True,)), torch.float32,
                     torch.device("cpu"))
    with torch.no_grad():
        _load_stacked(block, hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj)
    block.finish_loading()
    x = torch.randn(T, H)
    with torch.no_grad():
        want = hf(x[None])[0]
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_only_runs_routed_experts():
    """Experts no token chose are never called: their weights may be garbage (NaN) without touching the output."""
    cfg = MoeConfig(RouteSpec(8, 2, renormalize=True), 16, (True,))
    block = MoeBlock(H, cfg, torch.float32, torch.device("cpu"))
    _randomise(block)
    with torch.no_grad():
        block.router_weight.zero_()
        block.router_weight[:, 3] = 1.0  # with x > 0 every token picks expert 3 first, then the lowest id 0
        block.router_weight[:, 5] = 0.5
        block.gate_up_weight[[0, 1, 2, 4, 6, 7]] = float("nan")
    block.finish_loading()
    out = block(torch.rand(5, H) + 0.1)
    assert torch.isfinite(out).all()


def test_block_equals_qwen2_moe_block_with_gated_shared_expert():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
                         num_experts_per_tok=2, norm_topk_prob=False)
    hf = Qwen2MoeSparseMoeBlock(cfg).eval()
    _randomise(hf)
    mc = MoeConfig(RouteSpec(6, 2), 24, (True,), shared_intermediate_size=40, shared_gate=True)
    block = MoeBlock(H, mc, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        _load_stacked(block, hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj)
        se = hf.shared_expert
        assert block.shared_gate_up_weight is not None and block.shared_down_weight is not None
        assert block.shared_gate_weight is not None
        block.shared_gate_up_weight.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]).t())
        block.shared_down_weight.copy_(se.down_proj.weight.t())
        block.shared_gate_weight.copy_(hf.shared_expert_gate.weight.t())
    block.finish_loading()
    x = torch.randn(T, H)
    with torch.no_grad():
        want = hf(x[None])[0]
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_equals_gpt_oss_mlp_through_the_activation_hook():
    """Router bias, expert biases, and the clamped SwiGLU over interleaved gate/up columns as the `act` hook."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=H, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3)
    hf = GptOssMLP(cfg).eval()
    _randomise(hf)
    alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def clamped_swiglu(gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu[:, ::2].clamp(max=limit), gu[:, 1::2].clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    mc = MoeConfig(RouteSpec(8, 3, scoring="topk_softmax"), 24, (True,), router_bias=True, expert_bias=True)
    block = MoeBlock(H, mc, torch.float32, torch.device("cpu"), act=clamped_swiglu)
    ex = hf.experts
    with torch.no_grad():
        block.router_weight.copy_(hf.router.weight.t())
        assert block.router_bias is not None and block.gate_up_bias is not None and block.down_bias is not None
        block.router_bias.copy_(hf.router.bias)
        block.gate_up_weight.copy_(ex.gate_up_proj)  # gpt-oss stores [E, in, out] already
        block.down_weight.copy_(ex.down_proj)
        block.gate_up_bias.copy_(ex.gate_up_proj_bias)
        block.down_bias.copy_(ex.down_proj_bias)
    block.finish_loading()
    x = torch.randn(T, H) * 3  # large enough that the clamp bites
    with torch.no_grad():
        want = hf(x[None])[0][0]
        got = block(x)
    # Outputs reach ~70 here, so fp32 rounding of the two sides' different sum orders is absolute, not relative: the
    # largest difference measured was 8.5e-7 of the largest output (an AVX2-only AMD EPYC; under 1e-5 on AVX-512).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-6 * want.abs().max().item())
