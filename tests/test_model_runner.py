"""ModelRunner: KV pool sizing and its limits, copy-on-write block copies, and plan arrays -> logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from core_utils import make_scheduler
from ironlm.config import EngineConfig
from ironlm.engine.kv_cache import bytes_per_block, copy_blocks
from ironlm.engine.model_runner import ModelRunner
from ironlm.exceptions import InvalidArgumentError
from tiny_models import load_hf_reference, make_tiny_model

BASE = {"device": "cpu", "dtype": "float32", "block_size": 4, "warmup": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("runner"), arch="llama")


def runner(path: Path, **kw: object) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), **{**BASE, **kw}))  # type: ignore[arg-type]


def test_pool_is_sized_from_kv_cache_memory(tiny: Path) -> None:
    probe = runner(tiny, num_kv_blocks=8)
    mc = probe.model_config
    per_block = bytes_per_block(mc, 4, torch.float32)
    assert per_block == 2 * mc.num_layers * 4 * mc.num_kv_heads * mc.head_dim * 4
    r = runner(tiny, kv_cache_memory=per_block * 37 + per_block // 2)  # a partial block is not allocated
    assert r.num_blocks == 37
    assert len(r.kv_caches or []) == mc.num_layers
    for k, v in r.kv_caches or []:
        assert k.shape == v.shape == (37, 4, mc.num_kv_heads, mc.head_dim) and k.dtype == torch.float32
    # No max_model_len given: the model's own, but never more than the pool holds.
    assert r.max_model_len == min(mc.max_model_len, 37 * 4)


def test_pool_limits_are_invalid_arguments(tiny: Path) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        runner(tiny, num_kv_blocks=8, max_model_len=33)  # the pool holds 32 tokens
    assert err.value.param == "max_model_len"
    assert runner(tiny, num_kv_blocks=8, max_model_len=32).max_model_len == 32
    with pytest.raises(InvalidArgumentError) as err:
        runner(tiny, kv_cache_memory=64)
    assert err.value.param == "kv_cache_memory"


def test_copy_blocks_copies_each_pair_in_every_layer() -> None:
    caches = [(torch.randn(6, 2, 1, 3), torch.randn(6, 2, 1, 3)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, np.array([[1, 4], [2, 5]], dtype=np.int64))
    for (k, v), (k0, v0) in zip(caches, before):
        for t, t0 in ((k, k0), (v, v0)):
            assert torch.equal(t[4], t0[1]) and torch.equal(t[5], t0[2])
            assert torch.equal(t[:4], t0[:4])  # sources and untouched blocks stay as they were


def test_execute_turns_a_scheduler_plan_into_the_reference_logits(tiny: Path) -> None:
    r = runner(tiny, num_kv_blocks=32)
    sched = make_scheduler(32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                           max_model_len=r.max_model_len)
    prompts = [[5, 9, 13, 2, 7, 11], [3, 8, 1]]
    slots = [sched.add_request(f"r{i}", ids, 4)[0] for i, ids in enumerate(prompts)]
    ref = load_hf_reference(tiny)

    def reference_logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return ref(torch.tensor([ids])).logits[0, -1].float()

    plan = sched.schedule()
    assert plan.num_samples == 2 and plan.num_tokens == 9  # both prompts, one flat batch
    logits = r.execute(plan)
    assert logits.shape == (2, r.model_config.vocab_size) and logits.dtype == torch.float32
    rows = [plan.sample_slots.tolist().index(slot) for slot in slots]
    for row, ids in zip(rows, prompts):
        torch.testing.assert_close(logits[row], reference_logits(ids), atol=1e-4, rtol=1e-4)
    # The next step decodes from the paged cache the first one wrote.
    sampled = logits.argmax(-1)
    sched.update(sampled.numpy().astype(np.int64))
    decode = sched.schedule()
    assert decode.num_tokens == 2
    step2 = r.execute(decode)
    rows2 = [decode.sample_slots.tolist().index(slot) for slot in slots]
    for row, row2, ids in zip(rows, rows2, prompts):
        full = [*ids, int(sampled[row])]
        torch.testing.assert_close(step2[row2], reference_logits(full), atol=1e-4, rtol=1e-4)
