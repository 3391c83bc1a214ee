"""`preemption` (the config file's `scheduler.preemption`): aggressive admits what fits now and preempts when KV
blocks run out; conservative admits only what it can run to max_tokens, so the same workload sees no preemption.
Greedy outputs are the same either way (a preempted request is recomputed, never resampled)."""

from __future__ import annotations

import pytest

from ironlm.llm import LLM
from ironlm.sampling_params import SamplingParams

# 8 blocks of 4 tokens; three prompts of 4 tokens that generate 12 each need 4 blocks apiece at the end (12 in all).
ENGINE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 8, "block_size": 4, "max_model_len": 32,
          "max_num_seqs": 8, "enable_prefix_caching": False}
PROMPTS = [[10 + 10 * i + j for j in range(4)] for i in range(3)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("preempt"), arch="llama"))


def _run(model: str, mode: str) -> tuple[list[list[int]], int]:
    llm = LLM(model, preemption=mode, **ENGINE)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm.engine.stats()["num_preemptions"]


def test_conservative_admission_avoids_the_preemptions_aggressive_takes(tiny_model):
    aggressive, preempted = _run(tiny_model, "aggressive")
    conservative, none = _run(tiny_model, "conservative")
    assert preempted > 0 and none == 0
    assert all(len(t) == 12 for t in aggressive) and conservative == aggressive


def test_an_unknown_mode_is_refused_naming_it():
    from ironlm.config import EngineConfig
    from ironlm.exceptions import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="preemption: must be one of aggressive, conservative"):
        EngineConfig(preemption="sometimes")
