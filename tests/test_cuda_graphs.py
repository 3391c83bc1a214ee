"""CUDA graphs for decode (engine/cuda_graphs.py): which steps replay, how a step is staged into the static
buffers (padding rows included), and that a CPU engine stays eager. The replay itself is compared with eager on
CUDA here (skipped on CPU) and, without capture, on the CPU through the Triton interpreter by the GPU check's dry
run (tests/test_gpu_check.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from ironlm import LLM, SamplingParams
from ironlm.cli_args import add_engine_args
from ironlm.config import EngineConfig
from ironlm.distributed.plan_codec import StepArrays
from ironlm.engine.cuda_graphs import DecodeGraphs, capture_sizes
from ironlm.engine.model_runner import ModelRunner
from tiny_models import make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("graphs"), arch="llama")


def decode_step(seq_lens: list[int], width: int, *, logits: list[int] | None = None,
                query_len: int = 1) -> StepArrays:
    """A decode plan: sequence i has seq_lens[i] tokens after this step, blocks 10*i + j in its table row."""
    n = len(seq_lens)
    sl = np.asarray(seq_lens, dtype=np.int32)
    bt = (10 * np.arange(n)[:, None] + np.arange(width)[None, :]).astype(np.int32)
    pos = (sl - 1).astype(np.int64)
    slots = bt[np.arange(n), pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
    return StepArrays(input_ids=np.arange(100, 100 + n, dtype=np.int64), positions=pos, slot_mapping=slots,
                      logits_indices=np.asarray(range(n) if logits is None else logits, dtype=np.int64),
                      query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=sl, context_lens=sl - 1,
                      block_tables=bt, cow_pairs=np.zeros((0, 2), dtype=np.int64), max_query_len=query_len,
                      max_seq_len=int(sl.max()))


def test_capture_sizes_cover_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    full = capture_sizes(256)
    assert full[:5] == [1, 2, 4, 8, 16] and full[-1] == 256 and len(full) == 35
    assert capture_sizes(1000)[-1] == 256  # larger decode batches run eager


def test_steps_that_fit_a_graph_and_the_ones_that_do_not(tiny: Path) -> None:
    r = ModelRunner(EngineConfig(model=str(tiny), device="cpu", dtype="float32", block_size=BLOCK,
                                 num_kv_blocks=64, max_model_len=64, warmup=False))
    g = DecodeGraphs(r.model, r.kv_caches, sizes=[1, 2, 4, 8], max_model_len=64, block_size=BLOCK,
                     device=r.device, capture=False)
    assert g.size_for(decode_step([5], 2)) == 1
    assert g.size_for(decode_step([5, 9, 3], 3)) == 4
    assert g.size_for(decode_step([5] * 8, 2)) == 8
    assert g.size_for(decode_step([5] * 9, 2)) is None  # more sequences than the largest graph
    assert g.size_for(decode_step([5, 6], 2, query_len=2)) is None  # a prefill chunk in the step
    assert g.size_for(decode_step([5, 6], 2, logits=[1, 0])) is None  # logits of other rows
    assert g.size_for(decode_step([65], 17)) is None  # beyond max_model_len / the table's 16 columns


def test_stage_fills_the_static_buffers_and_pads(tiny: Path) -> None:
    r = ModelRunner(EngineConfig(model=str(tiny), device="cpu", dtype="float32", block_size=BLOCK,
                                 num_kv_blocks=64, max_model_len=64, warmup=False))
    g = DecodeGraphs(r.model, r.kv_caches, sizes=[1, 2, 4], max_model_len=64, block_size=BLOCK, device=r.device,
                     capture=False)
    step = decode_step([6, 9, 3], 3)
    g.stage(step, 4)
    assert g.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert g.positions[:4].tolist() == [5, 8, 2, 0]
    assert g.slot_mapping[:4].tolist() == [*step.slot_mapping.tolist(), -1]  # the padding row writes nothing
    assert g.seq_lens[:4].tolist() == [6, 9, 3, 1] and g.context_lens[:4].tolist() == [5, 8, 2, 0]
    assert g.block_tables[:3, :3].tolist() == step.block_tables.tolist()
    assert g.block_tables[3].tolist() == [0] * g.width
    assert g.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    # A smaller step next: its own rows and padding rewritten, the meta of its size sees only them.
    small = decode_step([2], 1)
    g.stage(small, 2)
    assert g.seq_lens[:2].tolist() == [2, 1] and g.slot_mapping[:2].tolist() == [small.slot_mapping[0], -1]
    assert g.block_tables[1, :1].tolist() == [0]


def test_cpu_engine_is_eager_and_enforce_eager_is_accepted(tiny: Path) -> None:
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(str(tiny), device="cpu", dtype="float32", num_kv_blocks=64, block_size=BLOCK, enforce_eager=eager)
        runner = llm.engine.runner
        assert runner.graphs is None and not runner.cuda_graphs_apply()
        assert "cuda_graphs" not in runner.startup_timings
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(["hello there", "a b c"], sp, use_tqdm=False)]
        llm.shutdown()
    assert outs[False] == outs[True]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["m", "--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(["m"]).enforce_eager is False


@pytest.mark.cuda
def test_graph_replay_matches_eager_on_cuda(tiny: Path) -> None:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [f"prompt number {i}" for i in range(5)]  # 5 decodes replay the graph of 8
    base = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 256, "block_size": 16, "max_num_seqs": 8}
    eager = LLM(str(tiny), enforce_eager=True, **base)
    assert eager.engine.runner.graphs is None
    want = [[o.outputs[0].token_ids for o in eager.generate(prompts[:b], sp, use_tqdm=False)] for b in (1, 3, 5)]
    eager.shutdown()
    llm = LLM(str(tiny), **base)
    graphs = llm.engine.runner.graphs
    if llm.engine.runner.model.attn_backend.name != "triton":
        llm.shutdown()
        pytest.skip("no triton: the torch backend runs eager")
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    got = [[o.outputs[0].token_ids for o in llm.generate(prompts[:b], sp, use_tqdm=False)] for b in (1, 3, 5)]
    assert got == want
    assert graphs.replays >= 3 * (12 - 1)
    llm.shutdown()
    torch.cuda.empty_cache()
