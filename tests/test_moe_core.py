"""The core's MoE kernel (`_core.MoeExperts`) behind a quantized MoeBlock on CPU, held to the per-expert loop it
replaces (the block with `core = None`): bit for bit where both run the same kernels in the same order (f32 blocks,
SiLU / GELU-tanh, int8 and int4, shared expert, expert-parallel ranges); within a measured bound where the loop
rounds differently (gpt-oss's SwiGLU: torch's sigmoid against the core's exp; bf16 blocks: the loop rounds every
intermediate to bf16). Also: which steps it takes, the bytes it reports streamed, and its argument errors."""

from __future__ import annotations

import pytest
import torch

from ironlm import _core
from ironlm.exceptions import InvalidArgumentError
from ironlm.model.linear import DENSE_MIN_ROWS, QuantLinear
from ironlm.model.moe.experts import MoeBlock
from ironlm.model.moe.spec import MoeConfig, RouteSpec
from ironlm.model.quantize import QuantSpec, from_float

H, I = 128, 64


def _block(cfg: MoeConfig, bits: int = 8, group: int = 0, dtype: torch.dtype = torch.float32,
           seed: int = 0, **kw) -> MoeBlock:
    block = MoeBlock(H, cfg, dtype, torch.device("cpu"), **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    spec = QuantSpec(bits=bits, group_size=group)
    block.quantize_(lambda pieces, bias: QuantLinear(
        _core.QuantMatrix.concat([from_float(w.float(), spec) for _, w in pieces]), bias))
    # The core's experts and the per-expert loop compared under one routing, route.py's: with the core's experts
    # the block would route on the core (MoeBlock.routes_on_core), whose choice has its own test (test_lean_stack).
    block.routes_on_core = lambda *_: False  # type: ignore[method-assign]
    return block


def _both(block: MoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(through the core's kernel, through the per-expert loop)."""
    assert block.core is not None
    with torch.no_grad():
        got = block(x)
        core, block.core = block.core, None
        try:
            want = block(x)
        finally:
            block.core = core
    return got, want


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


CASES = {
    "int8-silu-shared": (MoeConfig(RouteSpec(8, 2, renormalize=True), I, (True,), shared_intermediate_size=32,
                                   shared_gate=True), 8, 0, "silu"),
    "int4g32-silu": (MoeConfig(RouteSpec(16, 4), I, (True,)), 4, 32, "silu"),
    "int8g32-gelu": (MoeConfig(RouteSpec(6, 3, renormalize=True), I, (True,)), 8, 32, "gelu_tanh"),
    "int4-ep-rank": (MoeConfig(RouteSpec(8, 2), I, (True,), local_experts=(3, 6)), 4, 32, "silu"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens", [1, 2, 9, 40])
def test_core_kernel_is_the_per_expert_loop_bit_for_bit(case, tokens):
    cfg, bits, group, activation = CASES[case]
    block = _block(cfg, bits, group, activation=activation)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    before = block.streamed
    got, want = _both(block, x)
    assert torch.equal(got, want), f"max diff {(got - want).abs().max().item():.3g}"
    # the bytes it read: exactly the experts of this rank some token chose
    _, ids = _route(block, x)
    chosen = {int(e) - block.first for e in ids.flatten() if int(e) in block.cfg.expert_range}
    assert block.experts is not None
    expect = sum(block.experts[e].gate_up.nbytes + block.experts[e].down.nbytes for e in chosen)
    assert block.streamed - before == expect
    if tokens == 1 and cfg.local_experts is None:
        assert expect == sum(block.experts[0].gate_up.nbytes + block.experts[0].down.nbytes
                             for _ in range(cfg.route.top_k))  # one token streams its top_k experts


def _route(block: MoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ironlm.model.moe.route import route

    return route(torch.mm(x, block.router_weight), block.spec, block.router_bias, block.correction)


# Relative L2 error, core vs loop, worst of 6 seeds: clamped SwiGLU 0 here (torch's sigmoid and the core's
# 1 / (1 + exp(-z)) agree on this CPU; a ulp apart elsewhere, one moved int8 step of down's input is ~1e-5);
# bf16 7.4e-3 (the loop rounds gate_up's output, the activation and each expert's output to bf16, the core keeps
# f32 through the layer). A wrong expert or weight is ~100%.
CLAMP_BOUND, BF16_BOUND = 2e-5, 2e-2


def test_gpt_oss_clamped_swiglu_and_expert_biases_stay_with_the_loop():
    cfg = MoeConfig(RouteSpec(8, 3, scoring="topk_softmax"), I, (True,), router_bias=True, expert_bias=True)
    block = _block(cfg, 8, 32, clamp=(1.702, 0.5))  # a limit small enough that the clamp bites
    assert block.core is not None and "Clamped" in repr(block.core)
    x = torch.randn(33, H, generator=torch.Generator().manual_seed(1)) * 3
    got, want = _both(block, x)
    assert _rel(got, want) < CLAMP_BOUND


def test_bf16_block_through_the_core_stays_with_the_loop():
    cfg, bits, group, _ = CASES["int8-silu-shared"]
    block = _block(cfg, bits, group, dtype=torch.bfloat16)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got, want = _both(block, x)
    assert got.dtype == torch.bfloat16
    assert _rel(got, want) < BF16_BOUND


def test_a_step_with_dense_sized_experts_takes_the_core_with_the_int8_loops_bits():
    """An expert of DENSE_MIN_ROWS rows (a prefill chunk) runs on the core too, not on the loop's dense bf16 GEMM:
    the bits the loop gives on the int8 kernels alone (batch-invariant mode keeps QuantLinear there)."""
    from ironlm import invariant

    cfg, bits, group, _ = CASES["int4g32-silu"]  # no shared expert: it is a QuantLinear of its own, not the core's
    block = _block(cfg, bits, group)
    x = torch.randn(DENSE_MIN_ROWS + 5, H, generator=torch.Generator().manual_seed(3)) + 0.5
    block.router_weight.data[:, 0] += 0.5  # x's positive mean makes expert 0 every token's: DENSE_MIN_ROWS+ rows
    _, ids = _route(block, x)
    assert int((ids == 0).sum()) >= DENSE_MIN_ROWS
    calls = []
    run = block.core.run
    block.core = type("Spy", (), {"run": lambda self, *a: calls.append(1) or run(*a)})()
    with torch.no_grad():
        got = block(x)
    assert calls == [1]
    block.core = None
    with torch.no_grad(), invariant.scope(True):
        want = block(x)
    assert torch.equal(got, want), f"max diff {(got - want).abs().max().item():.3g}"


def test_dense_experts_and_custom_activations_keep_the_loop():
    cfg = CASES["int4g32-silu"][0]
    dense = MoeBlock(H, cfg, torch.float32, torch.device("cpu"))
    dense.finish_loading()
    assert dense.core is None
    custom = _block(cfg, act=lambda gu: gu[:, :I] * gu[:, I:])
    assert custom.core is None


def test_bad_arguments_name_the_parameter():
    block = _block(CASES["int8-silu-shared"][0])
    core = block.core
    assert core is not None and core.num_local == 8 and core.hidden == H and core.intermediate == I
    x, out = torch.randn(2, H), torch.zeros(2, H)
    ids, w = torch.tensor([[0, 1], [2, 8]]), torch.ones(2, 2)
    with pytest.raises(InvalidArgumentError) as e:
        core.run(x.numpy(), ids.numpy(), w.numpy(), out.numpy())
    assert e.value.param == "ids"
    ids[1, 1] = 3
    with pytest.raises(InvalidArgumentError) as e:
        core.run(torch.randn(2, H + 32).numpy(), ids.numpy(), w.numpy(), out.numpy())
    assert e.value.param == "x"
    with pytest.raises(InvalidArgumentError) as e:
        core.run(x.numpy(), ids.numpy(), torch.ones(2, 3).numpy(), out.numpy())
    assert e.value.param == "ids"
    with pytest.raises(InvalidArgumentError) as e:
        core.run(x.numpy(), ids.int().numpy(), w.numpy(), out.numpy())
    assert e.value.param == "ids"
    assert block.experts is not None
    gu = [m.gate_up.matrix for m in block.experts]
    with pytest.raises(InvalidArgumentError) as e:
        _core.MoeExperts(gu, gu)
    assert e.value.param == "down"
    with pytest.raises(InvalidArgumentError) as e:
        _core.MoeExperts(gu, [m.down.matrix for m in block.experts], activation="relu")
    assert e.value.param == "activation"
