"""The Triton fused-MoE kernel (kernels/fused_moe.py) against MoeBlock's per-expert path, in the Triton interpreter
on this CPU (the real kernel on a CUDA machine): the align step, dense fp32 / fp16 / bf16 experts, every activation
it fuses, expert biases, expert parallelism, int8 / int4 experts, and tiny Mixtral / Qwen2-MoE / gpt-oss models
with every MoE block forced onto the kernel.

The interpreter is switched on as tests/test_kernels.py does (its docstring says why): before triton is imported,
else the tests run in a subprocess that sets it.
"""

from __future__ import annotations

from triton_mode import DEVICE, IN_PROCESS, ON_GPU, subprocess_test  # first: it sets TRITON_INTERPRET

# isort: split

import pytest
import torch

from ironlm.model.moe import fused
from ironlm.model.moe.experts import MoeBlock
from ironlm.model.moe.spec import MoeConfig, RouteSpec

E, TOP_K, HIDDEN, INTER = 8, 2, 32, 64
# max |fused - loop| / max |loop|: fp32 is exact products summed in another order; 16-bit rounds the intermediate
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def fm():
    import ironlm.kernels.fused_moe as fm

    assert ON_GPU or fm.interpreted(), "the kernel was built without TRITON_INTERPRET=1"
    return fm


def skewed_ids(t: int, seed: int, lo: int = 0, hi: int = E) -> torch.Tensor:
    """[t, TOP_K] distinct experts per token: expert lo gets every token (first choice), expert hi - 1 none."""
    g = torch.Generator().manual_seed(seed)
    second = torch.randint(lo + 1, hi - 1, (t, 1), generator=g)
    return torch.cat([torch.full((t, 1), lo), second], dim=1)


def make_block(dtype: torch.dtype, seed: int = 0, clamp: tuple[float, float] | None = None,
               activation: str = "silu", local: tuple[int, int] | None = None, bias: bool = False) -> MoeBlock:
    cfg = MoeConfig(RouteSpec(E, TOP_K), INTER, (True,), expert_bias=bias, local_experts=local)
    block = MoeBlock(HIDDEN, cfg, dtype, torch.device(DEVICE), activation=activation, clamp=clamp)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.3).to(dtype))
    block.finish_loading()
    return block


def both(block: MoeBlock, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(fused, per-expert loop) outputs in fp32."""
    block.fused = False
    want = block.run_experts(x, weights, ids)
    block.fused = True
    assert fused.takes(block, x)
    got = block.run_experts(x, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    return got.float(), want.float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def inputs(t: int, dtype: torch.dtype, seed: int, **ids_kw: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(t, HIDDEN, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(t, TOP_K, generator=g), -1)
    return x.to(DEVICE), weights.to(DEVICE), skewed_ids(t, seed, **ids_kw).to(DEVICE)


@pytest.mark.parametrize("t,block_m", [(1, 16), (5, 16), (13, 16), (13, 32)])
def test_align_sorts_pads_and_labels_blocks(fm, t: int, block_m: int) -> None:
    ids = skewed_ids(t, t)
    sorted_ids, expert_ids = fm.align(ids, E, block_m)
    pairs = t * TOP_K
    assert sorted_ids.numel() == fm.max_blocks(pairs, E, block_m) * block_m == expert_ids.numel() * block_m
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once, padding is `pairs`
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    used = int(((counts + block_m - 1) // block_m).sum())
    assert (expert_ids[:used] >= 0).all() and (expert_ids[used:] == -1).all()
    assert (sorted_ids[used * block_m:] == pairs).all()
    for b in range(used):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < pairs].long()
        assert len(rows) and (flat[rows] == expert_ids[b]).all()  # no block is all padding, one expert a block
    assert expert_ids[:used].tolist() == sorted(expert_ids[:used].tolist())  # by expert, so pairs in order
    assert (E - 1) not in expert_ids.tolist()


def test_align_keeps_only_the_local_experts(fm) -> None:
    ids = torch.tensor([[0, 3], [5, 2], [7, 4], [2, 3]])
    sorted_ids, expert_ids = fm.align(ids, 4, 16, first=2)  # this rank holds experts 2..5
    real = sorted_ids[sorted_ids < 8]
    assert sorted(real.tolist()) == [1, 2, 3, 5, 6, 7]  # the pairs routed to 2, 3, 4, 5
    assert sorted_ids[:2].tolist() == [3, 6] and sorted_ids[16] == 1 and sorted_ids[48] == 2
    assert expert_ids.tolist()[:4] == [0, 1, 2, 3] and set(expert_ids.tolist()[4:]) <= {-1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [5, 13])
def test_dense_experts_match_the_loop(fm, dtype: torch.dtype, t: int) -> None:
    block = make_block(dtype, seed=t)
    x, weights, ids = inputs(t, dtype, seed=t)
    got, want = both(block, x, weights, ids)
    assert rel_err(got, want) < REL_TOL[dtype]
    # no atomics: the top-k sum's order is fixed, so a rerun gives the same bits (meaningful on a GPU)
    assert torch.equal(block.run_experts(x, weights, ids).float(), got)


@pytest.mark.parametrize("variant", ["gelu_tanh", "clamped_swiglu_bias", "expert_parallel"])
def test_activations_biases_and_expert_parallel(fm, variant: str) -> None:
    """gelu_tanh; gpt-oss's clamped SwiGLU with expert biases (weights scaled so that the limit clips); the
    experts [2, 6) of an expert-parallel rank (pairs routed elsewhere add nothing)."""
    kw: dict = {"gelu_tanh": {"activation": "gelu_tanh"}, "clamped_swiglu_bias": {"clamp": (1.702, 0.5),
                                                                                  "bias": True},
                "expert_parallel": {"local": (2, 6)}}[variant]
    block = make_block(torch.float32, seed=3, **kw)
    x, weights, ids = inputs(9, torch.float32, seed=3)
    got, want = both(block, x, weights, ids)
    assert rel_err(got, want) < REL_TOL[torch.float32]
    if variant == "expert_parallel":
        foreign = ((ids < 2) | (ids >= 6)).all(dim=1)
        assert (got[foreign] == 0).all() and want.abs().max() > 0


@pytest.mark.parametrize("bits,group", [(8, 0), (4, 32)])
def test_quantized_experts_match_the_loop(fm, bits: int, group: int) -> None:
    """Experts quantized for the GPU as load-time quantization does it (backend "triton"): the fused kernel reads
    them stacked, the loop runs each expert's TritonQuantLinear (itself a Triton kernel) on the same bytes."""
    from ironlm.model.linear_gpu import TritonQuantLinear

    block = make_block(torch.float32, seed=5)
    block.quantize_(lambda pieces, bias: TritonQuantLinear.from_float(torch.cat([w for _, w in pieces]), bits, group,
                                                                      bias))
    x, weights, ids = inputs(11, torch.float32, seed=5)
    got, want = both(block, x, weights, ids)
    assert block.fused_weights is not None and block.fused_weights[0].bits == bits
    assert block.experts is not None and block.experts[1].gate_up.qweight.data_ptr() == \
        block.fused_weights[0].weight[1].data_ptr()  # held once: each expert's linear is a view of the stack
    assert rel_err(got, want) < REL_TOL[torch.float32]


def test_when_the_block_takes_the_kernel(fm) -> None:
    """Forced or on CUDA, never when switched off, nor with a custom activation (the kernel fuses only its own) or
    experts in a format it does not read (FP8)."""
    from ironlm.model.linear_gpu import Fp8Linear

    block = make_block(torch.float32)
    x = torch.zeros(2, HIDDEN, device=DEVICE)
    block.fused = None
    assert fused.takes(block, x) == ON_GPU
    block.fused = False
    assert not fused.takes(block, x)
    block.fused = True
    assert fused.takes(block, x)
    custom = MoeBlock(HIDDEN, block.cfg, torch.float32, torch.device(DEVICE), act=lambda gu: gu[:, :INTER])
    custom.finish_loading()
    custom.fused = True
    assert not fused.takes(custom, x)
    block.quantize_(lambda pieces, bias: Fp8Linear.from_float(torch.cat([w for _, w in pieces]), bias))
    assert not fused.takes(block, x)


def _moe_blocks(lm) -> list[MoeBlock]:
    return [layer.moe for layer in lm.model.layers if layer.moe is not None]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_tiny_model_blocks_on_the_kernel(fm, tmp_path, family: str) -> None:
    """Every MoE block of a tiny random model (router, shared expert, gpt-oss's clamp and biases as loaded) gives
    the same forward on the kernel as on the ordinary path."""
    from ironlm.model import load_model

    if family == "gpt_oss":
        from tiny_gptoss import make_gptoss_model

        path = make_gptoss_model(tmp_path)
    else:
        from tiny_moe import make_moe_model

        path = make_moe_model(tmp_path, family)
    lm = load_model(path, dtype=torch.float32, device=DEVICE)
    blocks = _moe_blocks(lm)
    assert blocks
    hidden = lm.config.hidden_size
    for i, block in enumerate(blocks):
        x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(i)).to(DEVICE)
        block.fused = False
        want = block(x)
        block.fused = True
        assert fused.takes(block, x)
        got = block(x)
        assert rel_err(got, want) < REL_TOL[torch.float32], f"{family} block {i}"


def test_tiny_mixtral_matches_transformers_on_the_kernel(fm, tmp_path) -> None:
    """A tiny Mixtral with its MoE blocks on the kernel through the paged three-step comparison (prefill, chunked
    extend, decode) against transformers' log-probabilities."""
    from ironlm.model import load_model
    from test_model_hf import _run_and_compare
    from tiny_models import load_hf_reference
    from tiny_moe import make_moe_model

    path = make_moe_model(tmp_path, "mixtral")
    lm = load_model(path, dtype=torch.float32, device=DEVICE)
    for block in _moe_blocks(lm):
        block.fused = True
    assert _run_and_compare(lm, load_hf_reference(path), 4) < 1e-4


if not IN_PROCESS:  # triton was imported in compiled mode before this module
    for _name in [n for n in globals() if n.startswith("test_")]:
        del globals()[_name]
    test_fused_moe_in_interpreter_subprocess = subprocess_test(__file__)
