"""Expert parallelism on CPU (gloo, 2 ranks, `enable_expert_parallel`): each rank holds and runs half the routed
experts of every MoE layer (the router replicated, a shared expert split like the dense MLP, attention tensor
parallel); greedy tokens equal EP=1's and transformers' on tiny Mixtral, Qwen3-MoE and DeepSeek-V3 (latent
attention, a shared expert, a dense first layer) through prefix hits, chunked prefill and preemption.

One EP=2 engine (one worker process) per model; the loading checks build both ranks' shards in this process.
"""

from __future__ import annotations

import pytest
import torch

from family_parity import MAX_NEW, hf_greedy, shared_prefix_prompts
from ironlm import LLM, SamplingParams
from ironlm.distributed.group import TPGroup
from ironlm.distributed.sharding import ShardSpec
from ironlm.exceptions import InvalidArgumentError, UnsupportedModelError
from ironlm.model import load_model
from ironlm.model.llama import DecoderLM
from tiny_deepseek import DEEPSEEK_VARIANTS, make_deepseek_model
from tiny_models import tiny_vocab
from tiny_moe import make_moe_model

ENGINE = {"dtype": "float32", "device": "cpu", "seed": 0, "block_size": 4, "num_kv_blocks": 24,
          "max_num_batched_tokens": 16, "max_num_seqs": 4}
MODELS = ("mixtral", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ep")
    fam, over = DEEPSEEK_VARIANTS["deepseek_v3"]
    return {"mixtral": str(make_moe_model(root, "mixtral")), "qwen3_moe": str(make_moe_model(root, "qwen3_moe")),
            "deepseek_v3": str(make_deepseek_model(root, fam, **over))}


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


@pytest.mark.parametrize("name", MODELS)
def test_ep2_greedy_equals_ep1_and_transformers(name, models):
    path = models[name]
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))
    expected = [t for t, _ in hf_greedy(path, prompts, max_new=MAX_NEW)]
    assert _greedy(LLM(path, **ENGINE), prompts) == expected
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, distributed_timeout=60, **ENGINE)
    try:
        got = _greedy(llm, prompts)
        stats = llm.engine.stats()
        comm = llm.engine.step_breakdown()["tp_comm"]
        layers = [layer for layer in llm.engine.runner.model.layers if layer.moe is not None]
    finally:
        llm.shutdown()
    assert got == expected
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert comm > 0
    assert layers and all(len(layer.moe.experts) == 4 and layer.moe.first == 0 for layer in layers)  # rank 0's


def _rank(rank: int, world: int) -> TPGroup:
    """A TPGroup that only shards (loading reads `bind` / `shard`; no collective runs)."""
    group = TPGroup.__new__(TPGroup)
    group.rank, group.world, group._shard, group.device = rank, world, None, torch.device("cpu")
    group.expert_parallel = True
    return group


def _expert_bytes(model: DecoderLM) -> int:
    return sum(t.numel() * t.element_size() for layer in model.layers if layer.moe is not None
               for t in (layer.moe.gate_up_weight, layer.moe.down_weight))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_each_rank_loads_only_its_experts(name, models, monkeypatch):
    """Each rank's resident routed-expert bytes are half of EP=1's, its experts are the full model's [4r, 4r+4),
    and the loader never hands it another rank's expert tensor (Mixtral's renamed block_sparse_moe names too)."""
    path = models[name]
    full = load_model(path, dtype="float32", quantization="none").model
    seen: list[str] = []
    original = DecoderLM.load_weight

    def spy(self, n, tensor, shape=None):  # records what reaches the model; loading itself is the real one
        seen.append(n)
        return original(self, n, tensor, shape)

    monkeypatch.setattr(DecoderLM, "load_weight", spy)
    for r in (0, 1):
        seen.clear()
        shard = load_model(path, dtype="float32", quantization="none", tp=_rank(r, 2)).model
        assert _expert_bytes(shard) * 2 == _expert_bytes(full)
        assert shard.weight_bytes() < full.weight_bytes() * 0.75
        experts = [n for n in seen if ".experts." in n]
        assert experts and all(int(n.split(".experts.")[1].split(".")[0]) // 4 == r for n in experts), experts
        for f, s in zip(full.layers, shard.layers):
            if f.moe is None:
                continue
            assert torch.equal(s.moe.gate_up_weight, f.moe.gate_up_weight[4 * r:4 * r + 4])
            assert torch.equal(s.moe.down_weight, f.moe.down_weight[4 * r:4 * r + 4])
            torch.testing.assert_close(s.moe.router_weight, f.moe.router_weight, rtol=0, atol=0)
            if f.moe.shared_gate_up_weight is not None:  # split like the dense MLP: half the columns each
                inter = f.moe.cfg.shared_intermediate_size // 2
                g, u = f.moe.shared_gate_up_weight.split(2 * inter, dim=1)
                want = torch.cat([g[:, r * inter:(r + 1) * inter], u[:, r * inter:(r + 1) * inter]], dim=1)
                assert torch.equal(s.moe.shared_gate_up_weight, want)


def test_moe_under_tensor_parallel_needs_the_flag(models):
    cfg = load_model(models["mixtral"], dtype="float32").config
    with pytest.raises(UnsupportedModelError, match="--enable-expert-parallel"):
        ShardSpec(0, 2, cfg)
    with pytest.raises(InvalidArgumentError, match="routed experts") as exc:  # 8 experts over 3 ranks
        ShardSpec(0, 3, cfg, expert_parallel=True)
    assert exc.value.param == "tensor_parallel_size"
    assert ShardSpec(1, 2, cfg, expert_parallel=True).local_config().moe.local_experts == (4, 8)


def test_gguf_rank_keeps_only_its_experts_blocks(models, tmp_path):
    """A llama.cpp-converted Q8_0 Mixtral: each rank keeps its experts' Q8_0 blocks (half of EP=1's bytes), equal
    to the full model's experts [4r, 4r+4); the other experts' blocks are never read."""
    from gguf_convert import convert

    path = str(convert(models["mixtral"], tmp_path, "q8_0"))
    full = load_model(path, dtype="float32", quantization="auto").model
    for r in (0, 1):
        shard = load_model(path, dtype="float32", quantization="auto", tp=_rank(r, 2)).model
        for f, s in zip(full.layers, shard.layers):
            assert sum(lin.nbytes for lin in s.moe.linears()) * 2 == sum(lin.nbytes for lin in f.moe.linears())
            for i, mlp in enumerate(s.moe.experts):
                for mine, theirs in ((mlp.gate_up, f.moe.experts[4 * r + i].gate_up),
                                     (mlp.down, f.moe.experts[4 * r + i].down)):
                    assert type(mine).__name__ == "QuantLinear"
                    assert (mine.matrix.dequantize() == theirs.matrix.dequantize()).all()
