"""Tensor parallelism on CPU (gloo, 2 ranks): greedy outputs equal TP=1, shards are the right slices, a dead worker
is reported at once.

Each TP=2 engine spawns a worker process (3 s to start on an idle 2-core machine, past 30 s on a busy CI one: two
runs there failed a 30 s `distributed_timeout`, so the TP tests give it 120 s), so there is one per model variant,
module-scoped: GQA (2 KV heads over 2 ranks) with an untied LM head, and MQA (1 KV head, replicated) with
tied embeddings and q/k/v biases (qwen2). The variant engines run prefix caching, chunked prefill (a 32-token
budget) and preemption (a pool far smaller than the batch needs) at once, and the TP=1 reference runs the same
config. The last test kills the MQA engine's worker.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from ironlm import LLM, SamplingParams, TensorParallelError
from ironlm.distributed.group import TPGroup
from ironlm.distributed.plan_codec import CAPACITY, OP_PROFILE, OP_STEP, PlanChannel, StepArrays, pack, unpack
from ironlm.distributed.sharding import ShardSpec
from ironlm.exceptions import InvalidArgumentError
from ironlm.model import load_model
from ironlm.model.config import ModelConfig
from tiny_models import make_tiny_gguf, make_tiny_model

# Small pool + budget: 6 prompts of 28-59 tokens plus 24 new tokens need ~90 blocks of 4; the pool has 24, so
# sequences get preempted and recomputed; prompts longer than 32 tokens are prefilled in chunks.
# float32: in bf16 the ranks' partial sums round differently from one GEMM, enough to flip near-tied argmaxes.
# device cpu: these are the gloo tests, on any machine (device auto on a one-GPU machine would ask rank 1 for cuda:1).
ENGINE = {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 96, "max_num_batched_tokens": 32,
          "max_num_seqs": 8, "enable_prefix_caching": True, "dtype": "float32", "device": "cpu"}
SHARED = "one two three four five six "  # 24 tokens: 6 full blocks every prompt shares
PROMPTS = [SHARED + tail for tail in ("alpha beta", "gamma delta epsilon", "zeta", "eta theta iota kappa",
                                      "lambda mu nu xi omicron pi rho sigma tau", "phi chi psi omega")]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

VARIANTS = {
    "gqa-untied": {"arch": "llama", "num_key_value_heads": 2},
    "mqa-tied-bias": {"arch": "qwen2", "num_key_value_heads": 1, "tie_word_embeddings": True},
}


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {name: str(make_tiny_model(root, name=name, **kw)) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def tp_engines(models):
    """The TP=2 engine of a variant; one at a time (a process holds one torch.distributed group)."""
    current: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in current:
            for llm in current.values():
                llm.engine.runner.shutdown()
            current.clear()
            current[name] = LLM(models[name], tensor_parallel_size=2, distributed_timeout=120, **ENGINE)
        return current[name]

    yield get
    for llm in current.values():
        llm.engine.runner.shutdown()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_greedy_equals_tp1(variant, models, tp_engines):
    ref = LLM(models[variant], **ENGINE)
    expected = _greedy(ref)
    tp = tp_engines(variant)
    assert _greedy(tp) == expected
    assert _greedy(tp) == expected  # again: now mostly prefix-cache hits
    stats = tp.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    # chunked prefill happened: the longest prompt is longer than a step's budget
    assert max(len(p) for p in tp.get_tokenizer()(PROMPTS)["input_ids"]) > ENGINE["max_num_batched_tokens"]
    shard_cfg = tp.engine.runner.shard_config
    assert shard_cfg.num_heads == 2 and shard_cfg.num_kv_heads == 1
    assert tp.engine.runner.kv_caches[0][0].shape[2] == 1  # each rank's pool holds its KV heads only
    assert tp.engine.step_breakdown()["tp_comm"] > 0


def test_killed_worker_is_reported_not_hung(tp_engines):
    from ironlm.engine.async_engine import AsyncLLMEngine

    llm = tp_engines("mqa-tied-bias")
    worker = llm.engine.runner.executor.procs[0]
    worker.kill()
    worker.wait(10)
    engine = AsyncLLMEngine(llm.engine)

    async def one() -> None:
        async for _ in engine.generate("hello", SamplingParams(max_tokens=4), request_id="r1"):
            pass

    t0 = time.monotonic()
    with pytest.raises(Exception) as exc:
        asyncio.run(asyncio.wait_for(one(), 30))
    assert time.monotonic() - t0 < 30
    assert "tensor-parallel worker rank 1" in str(exc.value)
    assert isinstance(engine.dead_error, TensorParallelError) and not engine.is_healthy
    with pytest.raises(TensorParallelError, match="exited"):  # the offline API raises, never hangs
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)


# ---- no processes: sharding arithmetic, the plan codec, shard loading -------------------------------------------
def _config(heads: int, kv: int, vocab: int = 10) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=heads * 8, intermediate_size=16,
                       num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=8, max_position_embeddings=64)


def test_shard_spec_kv_heads_split_or_replicated_and_vocab_padded():
    # 8 query heads, 2 KV heads over 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1 (their GQA group)
    specs = [ShardSpec(r, 4, _config(8, 2)) for r in range(4)]
    assert [s.kv_head_start for s in specs] == [0, 0, 1, 1] and specs[0].num_kv_heads == 1
    assert [s.cut("model.layers.0.self_attn.k_proj.weight").start for s in specs] == [0, 0, 8, 8]
    assert specs[3].cut("model.layers.0.self_attn.o_proj.weight").dim == 1
    assert specs[1].cut("model.layers.0.self_attn.o_proj.bias").zero and specs[0].cut(
        "model.layers.0.self_attn.o_proj.bias") is None
    # vocab 10 over 4 ranks: padded to 12, 3 rows each, the last rank's last 2 rows zero
    full = torch.arange(20.0).view(10, 2)
    part = specs[3].take("model.embed_tokens.weight", full, (10, 2))
    assert part.tolist() == [[18.0, 19.0], [0.0, 0.0], [0.0, 0.0]]
    # 4 KV heads over 2 ranks: split
    assert ShardSpec(1, 2, _config(4, 4)).kv_head_start == 2
    with pytest.raises(InvalidArgumentError) as exc:
        ShardSpec(0, 3, _config(4, 2))
    assert exc.value.param == "tensor_parallel_size"


def test_plan_codec_round_trip_one_broadcast_unless_large():
    rng = np.random.default_rng(0)

    def arrays(t: int, b: int, m: int) -> StepArrays:
        return StepArrays(rng.integers(0, 100, t), np.arange(t), np.arange(t) + 5, np.array([t - 1]),
                          np.linspace(0, t, b + 1).astype(np.int64), np.full(b, 7), np.full(b, 3),
                          rng.integers(0, 50, (b, m)).astype(np.int32), np.array([[1, 2]]), 4, 9)

    for t, b, m, broadcasts in ((8, 2, 3, 1), (CAPACITY, 4, 2, 2)):
        sent: list[torch.Tensor] = []
        PlanChannel(lambda buf, sent=sent: sent.append(buf.clone())).send(pack(OP_STEP, a := arrays(t, b, m)))
        assert len(sent) == broadcasts
        replay = iter(sent)
        op, got, _ = unpack(PlanChannel(lambda buf, replay=replay: buf.copy_(next(replay))).receive())
        assert op == OP_STEP and got is not None
        for field in ("input_ids", "positions", "slot_mapping", "logits_indices", "query_start_loc", "seq_lens",
                      "context_lens", "block_tables", "cow_pairs"):
            assert np.array_equal(getattr(got, field), getattr(a, field)), field
        assert got.block_tables.dtype == np.int32 and (got.max_query_len, got.max_seq_len) == (4, 9)
    assert unpack(pack(OP_PROFILE, arg=64))[::2] == (OP_PROFILE, 64)


def _rank(rank: int, world: int) -> TPGroup:
    """A TPGroup that only shards (loading reads `bind` / `shard`; no collective runs)."""
    group = TPGroup.__new__(TPGroup)
    group.rank, group.world, group._shard, group.device = rank, world, None, torch.device("cpu")
    return group


@pytest.mark.parametrize("source", ["safetensors", "gguf-f32", "gguf-q8_0"])
def test_each_rank_loads_its_slice(tmp_path, models, source):
    hf = models["gqa-untied"]  # llama, 4 heads of 64, 2 KV heads, MLP 384
    path = hf if source == "safetensors" else make_tiny_gguf(tmp_path, hf, source.split("-")[1].upper())
    full = load_model(str(path), dtype="float32", quantization="none").model
    ranks = [load_model(str(path), dtype="float32", quantization="auto", tp=_rank(r, 2)).model for r in (0, 1)]
    layer = [m.layers[0] for m in ranks]

    def dense(lin) -> torch.Tensor:  # [in, out] like DenseLinear's weight
        if hasattr(lin, "matrix"):
            return torch.from_numpy(lin.matrix.dequantize()).t()
        return lin.weight

    q, kv, inter = 128, 64, 192  # per rank: 2 of 4 query heads, 1 of 2 KV heads (head_dim 64), half the MLP
    f = full.layers[0]
    qkv = dense(f.qkv)
    atol = 0.02 if source == "gguf-q8_0" else 0.0
    for r in (0, 1):
        got = dense(layer[r].qkv)
        want = torch.cat([qkv[:, r * q:(r + 1) * q], qkv[:, 256 + r * kv:256 + (r + 1) * kv],
                          qkv[:, 384 + r * kv:384 + (r + 1) * kv]], dim=1)
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        torch.testing.assert_close(dense(layer[r].o), dense(f.o)[r * q:(r + 1) * q], atol=atol, rtol=0)
        torch.testing.assert_close(dense(layer[r].down), dense(f.down)[r * inter:(r + 1) * inter], atol=atol, rtol=0)
        assert ranks[r].config.vocab_size * 2 >= full.config.vocab_size


# ---- workers never re-import the user's __main__ --------------------------------------------------------------
# As every vLLM example is written: no `if __name__ == "__main__":` guard. A worker that re-ran this module would
# build another TP=2 engine (multiprocessing's spawn refuses that with a bootstrapping RuntimeError).
TOP_LEVEL_SCRIPT = """
import json, sys
from ironlm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_timeout=20, **json.loads(sys.argv[2]))
out = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in out]), flush=True)
"""


def test_top_level_script_without_main_guard(tmp_path, models):
    script = tmp_path / "tp_script.py"
    script.write_text(TOP_LEVEL_SCRIPT)
    model, prompts = models["gqa-untied"], PROMPTS[:2]
    expected = [list(o.outputs[0].token_ids) for o in LLM(model, **ENGINE).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    t0 = time.monotonic()
    # A worker that re-ran the script would fail, then rank 0 would wait out distributed_timeout (20 s) in the
    # store; the bound here is the ~30 s a TP=2 start takes on a busy 2-core machine plus a margin.
    proc = subprocess.run([sys.executable, str(script), model, json.dumps(ENGINE), json.dumps(prompts)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bootstrapping" not in proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert json.loads(line.removeprefix("TOKENS ")) == expected
    print(f"top-level TP=2 script: {time.monotonic() - t0:.1f} s")


# A worker that cannot start: the runner class lives in the script's `__main__`, which a worker never imports.
DEAD_WORKER_SCRIPT = """
import sys, time
from ironlm import EngineConfig, TensorParallelError
from ironlm.distributed.executor import TPExecutor
from ironlm.engine.model_runner import ModelRunner
class Runner(ModelRunner):
    pass
t0 = time.monotonic()
try:
    TPExecutor.start(EngineConfig(model=sys.argv[1], device="cpu", tensor_parallel_size=2, distributed_timeout=120),
                     Runner)
except TensorParallelError as exc:
    print(f"FAILED {time.monotonic() - t0:.1f} {exc}", flush=True)
"""


def test_worker_that_dies_before_joining_fails_at_once(tmp_path, models):
    script = tmp_path / "dead_worker.py"
    script.write_text(DEAD_WORKER_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), models["gqa-untied"]], capture_output=True, text=True,
                          timeout=100, cwd=tmp_path, check=False)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED ")]
    elapsed, message = line.split(" ", 2)[1:]
    assert "rank 1" in message and "before joining the group" in message, message
    assert float(elapsed) < 60, line  # not the store's 120 s distributed_timeout
    assert "Runner" in proc.stderr  # the worker's own error reached the user
