"""Routed experts stacked in one tensor per projection, as transformers 5 holds them (``mlp.experts.gate_up_proj``
[E, 2I, hidden], ``down_proj`` [E, hidden, I]) and writes them with ``save_pretrained(save_original_format=False)``,
in every MoE family: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2 / V3.

The default save (the Hub's per-expert tensors, Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3``) runs against
transformers in test_family_moe and test_family_deepseek. Here the same tiny models saved stacked by transformers
load to exactly the per-expert folder's parameters and give transformers' own greedy tokens on the stacked folder;
under expert parallelism each rank takes its experts' rows of the stacked tensors; a stacked tensor of the wrong
shape fails with the tensor's name.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from family_parity import MAX_NEW, hf_greedy, shared_prefix_prompts
from ironlm import LLM, SamplingParams
from ironlm.model import load_model
from test_expert_parallel import _rank
from tiny_deepseek import DEEPSEEK_VARIANTS, make_deepseek_model
from tiny_models import tiny_vocab
from tiny_moe import MOE_VARIANTS, make_moe_model

FAMILIES = sorted(MOE_VARIANTS) + sorted(DEEPSEEK_VARIANTS)


def _stacked_copy(src, dst):
    """transformers' own stacked save of the folder `src` (its tokenizer files copied alongside)."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).save_pretrained(
        str(dst), save_original_format=False)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module", params=FAMILIES)
def folders(request, tmp_path_factory):
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    if family in DEEPSEEK_VARIANTS:
        fam, over = DEEPSEEK_VARIANTS[family]
        per_expert = make_deepseek_model(root, fam, **over)
    else:
        per_expert = make_moe_model(root, family)
    stacked = _stacked_copy(per_expert, root / "stacked")
    with safe_open(str(stacked / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)  # the layout under test, not per expert
    assert not any(re.search(r"\.experts\.\d+\.", n) for n in names)
    return family, per_expert, stacked


def test_stacked_loads_the_per_expert_parameters(folders):
    _, per_expert, stacked = folders
    a = load_model(per_expert, dtype=torch.float32, device="cpu").model
    b = load_model(stacked, dtype=torch.float32, device="cpu").model
    moe = [(x.moe, y.moe) for x, y in zip(a.layers, b.layers) if x.moe is not None]
    assert moe
    for x, y in moe:
        assert torch.equal(x.gate_up_weight, y.gate_up_weight) and torch.equal(x.down_weight, y.down_weight)
        assert torch.equal(x.router_weight, y.router_weight)


def test_stacked_greedy_matches_transformers(folders):
    _, _, stacked = folders
    prompts = shared_prefix_prompts(len(tiny_vocab()[0]))[:3]
    expected = [t for t, _ in hf_greedy(stacked, prompts, max_new=MAX_NEW)]
    llm = LLM(str(stacked), dtype="float32", device="cpu", seed=0, warmup=False)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [list(o.outputs[0].token_ids)
           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    assert got == expected


def test_each_rank_takes_its_experts_rows(folders):
    """Expert parallelism over 2 ranks: rank r's routed experts are the stacked tensors' rows [4r, 4r + 4)."""
    _, _, stacked = folders
    full = load_model(stacked, dtype="float32", quantization="none").model
    for r in (0, 1):
        part = load_model(stacked, dtype="float32", quantization="none", tp=_rank(r, 2)).model
        for f, s in zip(full.layers, part.layers):
            if f.moe is not None:
                assert torch.equal(s.moe.gate_up_weight, f.moe.gate_up_weight[4 * r:4 * r + 4])
                assert torch.equal(s.moe.down_weight, f.moe.down_weight[4 * r:4 * r + 4])


@pytest.mark.parametrize(("proj", "cut"), [("gate_up_proj", (slice(None), slice(0, -2))),  # 2I - 2 rows
                                           ("down_proj", (slice(0, -1),))])  # one expert short
def test_wrong_stacked_shape_names_the_tensor(folders, tmp_path, proj, cut):
    _, _, stacked = folders
    bad = shutil.copytree(stacked, tmp_path / "bad")
    sd = load_file(str(bad / "model.safetensors"))
    name = max(n for n in sd if n.endswith(f"mlp.experts.{proj}"))  # the last layer: sparse in every family here
    sd[name] = sd[name][cut].contiguous()
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    shape = tuple(sd[name].shape)
    with pytest.raises(ValueError, match=re.escape(f"weight {name}: checkpoint shape {shape} != expected")):
        load_model(bad, dtype=torch.float32, device="cpu")
