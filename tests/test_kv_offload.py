"""The KV hierarchy, engine side: a host-memory or disk tier under the prefix cache, swap, pinned prefixes, metrics.

Every case compares greedy outputs with a tier against the same engine without one: the tier may only change
where KV comes from, never what is computed. Pools are tiny (block 4) so that eviction and preemption happen
within a few requests; prompts are token ids so shared prefixes have exact lengths.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ironlm import LLM, SamplingParams
from ironlm.config import EngineConfig
from ironlm.distributed.plan_codec import OP_STEP, StepArrays, pack, unpack
from ironlm.exceptions import EngineDeadError, InvalidArgumentError
from server_utils import tiny_model_path

BLOCK = 4
BASE = {"block_size": BLOCK, "dtype": "float32", "device": "cpu", "max_model_len": 128, "seed": 0}
# 48 blocks = 192 tokens: two 50-token prompts with their outputs fit, six shared prefixes do not.
SMALL_POOL = {**BASE, "num_kv_blocks": 48, "max_num_seqs": 2}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_model_path(tmp_path_factory))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(n)]


def _texts(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


# ---- settings -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    ({"kv_offload_memory": "lots"}, "kv_offload_memory"),
    ({"kv_offload_memory": 0}, "kv_offload_memory"),
    ({"kv_offload_dir": "/tmp/x", "kv_offload_size": "-1"}, "kv_offload_size"),
    ({"kv_offload_dir": ""}, "kv_offload_dir"),
    ({"kv_offload_dir": "/tmp/x", "kv_offload_memory": "1GiB"}, "kv_offload_dir"),
    ({"swap_space": -1.0}, "swap_space"),
    ({"swap_space": float("nan")}, "swap_space"),
    ({"kv_pin_prefix": "a system prompt"}, "kv_pin_prefix"),
    ({"kv_pin_prefix": [""]}, "kv_pin_prefix"),
    ({"kv_offload_memory": "1GiB", "enable_prefix_caching": False}, "kv_offload_memory"),
    ({"swap_space": 1.0, "enable_prefix_caching": False}, "swap_space"),
    ({"kv_pin_prefix": ["x"], "enable_prefix_caching": False}, "kv_pin_prefix"),
])
def test_bad_tier_settings_name_the_field(kwargs, param):
    with pytest.raises(InvalidArgumentError) as exc:
        EngineConfig(**kwargs)
    assert exc.value.param == param


def test_tier_size_from_settings():
    assert EngineConfig().kv_tier_kind() is None and EngineConfig().resolve_kv_tier_bytes() == 0
    assert EngineConfig(kv_offload_memory="2MiB").resolve_kv_tier_bytes() == 2 << 20
    assert EngineConfig(swap_space=0.5).kv_tier_kind() == "memory"
    assert EngineConfig(swap_space=0.5).resolve_kv_tier_bytes() == 1 << 29
    disk = EngineConfig(kv_offload_dir="/tmp/x", swap_space=0.5)  # swap goes to the disk tier then
    assert disk.kv_tier_kind() == "disk" and disk.resolve_kv_tier_bytes() == 4 << 30


def test_plan_codec_carries_tier_copies():
    empty = np.zeros(0, dtype=np.int64)
    demote, promote = np.array([[3, 0], [4, 1]]), np.array([[7, 3]])
    arrays = StepArrays(empty, empty, empty, empty, np.zeros(1, dtype=np.int64), empty, empty,
                        np.zeros((0, 0), dtype=np.int32), np.array([[1, 2]]), 0, 0, demote, promote)
    op, got, _ = unpack(pack(OP_STEP, arrays))
    assert op == OP_STEP and got is not None
    assert got.kv_demote.tolist() == demote.tolist() and got.kv_promote.tolist() == promote.tolist()
    assert got.cow_pairs.tolist() == [[1, 2]]


def test_runner_copies_blocks_through_its_tier(model):
    """A copies-only plan moves a block device -> tier -> another device block (demote before promote), and
    measuring the copy cost leaves the tier's content as it was."""
    import torch

    from ironlm.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=model, num_kv_blocks=16, kv_offload_memory="256KiB", warmup=False,
                                      **{k: v for k, v in BASE.items() if k != "max_model_len"}))
    assert runner.tier is not None and runner.tier.num_slots == 32  # 256 KiB of 8 KiB blocks
    kv = runner.kv_caches
    assert kv is not None
    for k, v in kv:
        k[3].normal_()
        v[3].normal_()
    before = [(k[3].clone(), v[3].clone()) for k, v in kv]
    empty = np.zeros(0, dtype=np.int64)

    def copies(demote: list[list[int]], promote: list[list[int]]) -> StepArrays:
        return StepArrays(empty, empty, empty, empty, np.zeros(1, dtype=np.int64), empty, empty,
                          np.zeros((0, 0), dtype=np.int32), np.zeros((0, 2), dtype=np.int64), 0, 0,
                          np.array(demote, dtype=np.int64).reshape(-1, 2),
                          np.array(promote, dtype=np.int64).reshape(-1, 2))

    runner.run(copies([[3, 5]], []))
    # Block 7's old content goes down before slot 5 comes back into it (and into block 3).
    runner.run(copies([[7, 6]], [[5, 7], [5, 3]]))
    for (k, v), (k0, v0) in zip(kv, before):
        assert torch.equal(k[7], k0) and torch.equal(v[7], v0) and torch.equal(k[3], k0)
    runner.measure_tier_copy()  # reads slots 0-7 into blocks 0-7 and writes them back
    runner.run(copies([], [[5, 9]]))
    assert all(torch.equal(k[9], k0) for (k, _), (k0, _) in zip(kv, before))
    runner.close_tier()


# ---- (a) a host-memory tier under a tiny pool ---------------------------------------------------------------
def _shared_prefix_rounds(seed: int = 0) -> list[list[list[int]]]:
    """Three rounds over six 40-token prefixes (60 blocks: more than the pool), a new 8-token suffix each round."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, 40) for _ in range(6)]
    return [[p + _tokens(rng, 8) for p in prefixes] for _ in range(3)]


@pytest.fixture(scope="module")
def baseline(model):
    llm = LLM(model, **SMALL_POOL)
    outs = [_texts(_generate(llm, prompts)) for prompts in _shared_prefix_rounds()]
    return llm, outs


@pytest.fixture(scope="module")
def tiered(model):
    llm = LLM(model, kv_offload_memory="1MiB", **SMALL_POOL)  # 128 blocks of 8 KiB
    outs = [_texts(_generate(llm, prompts)) for prompts in _shared_prefix_rounds()]
    return llm, outs


def test_memory_tier_serves_evicted_prefixes_with_identical_output(baseline, tiered):
    llm, outs = tiered
    assert outs == baseline[1]
    s = llm.engine.stats()
    assert s["kv_tier"] == "memory" and s["tier_blocks_total"] == 128
    assert s["kv_demotions"] > 0 and s["kv_promotions"] > 0
    assert s["prefix_hits_tier"] > 0
    # Without the tier the later rounds recompute what the tier hands back.
    assert s["prefix_cache_hits"] > baseline[0].engine.stats()["prefix_cache_hits"]
    assert llm.engine.step_breakdown()["kv_copy"] > 0
    assert llm.engine.kv.prefill_s_per_token is not None  # real prefill-heavy steps fed the cost model


def test_prefill_cost_follows_prefill_heavy_steps_and_tells_the_core_on_drift(model):
    """The cost model's prefill side: only prefill-heavy steps (>= 64 prefill tokens, decode under 1/8 of them)
    count, as an exponential average (weight 0.2); the core is told a new figure once the average has moved
    more than 25% from the one it has. The step timings are set here: the real ones are noise."""
    llm = LLM(model, kv_offload_memory="1MiB", **SMALL_POOL)
    kv = llm.engine.kv
    assert kv.promote_cost is not None and kv.prefill_s_per_token is None  # startup measured, no step yet
    copy_s, startup = kv.promote_cost
    told: list[float] = []
    tell = kv.set_promote_cost  # records what the core is told, then tells it

    def record(copy: float, prefill_s: float) -> None:
        told.append(prefill_s)
        tell(copy, prefill_s)

    kv.set_promote_cost = record  # type: ignore[method-assign]

    def step(prefill: int, decode: int, per_token: float) -> None:
        kv.track_prefill(Counts(prefill, decode), per_token * startup * prefill)

    step(63, 0, 9.0)  # too short
    step(80, 11, 9.0)  # decode-heavy: 11 * 8 > 80
    assert kv.prefill_s_per_token is None and told == []
    step(100, 12, 3.0)  # the first one replaces the startup figure (it drifted 200%)
    assert kv.prefill_s_per_token == pytest.approx(3.0 * startup) and told == [pytest.approx(3.0 * startup)]
    step(100, 0, 3.3)  # 0.8 * 3 + 0.2 * 3.3 = 3.06: 2% off the told 3.0, the core keeps it
    assert kv.prefill_s_per_token == pytest.approx(3.06 * startup) and len(told) == 1
    expected = 3.06
    for _ in range(3):  # 3.348, 3.578, 3.763: the third is past 3.75 (25% over 3.0)
        step(200, 0, 4.5)
        expected = 0.8 * expected + 0.2 * 4.5
    assert kv.prefill_s_per_token == pytest.approx(expected * startup)
    assert told == [pytest.approx(3.0 * startup), pytest.approx(expected * startup)]
    assert kv.promote_cost == (copy_s, pytest.approx(expected * startup))
    llm.shutdown()


@dataclass
class Counts:
    """The two counts of a scheduler plan the cost model reads."""

    num_prefill_tokens: int
    num_decode_tokens: int


def test_kv_waste_is_the_running_blocks_unfilled_share(model):
    """kv_waste_perc = 1 - filled / held token slots over the running sequences' blocks (of 4 slots)."""
    llm = LLM(model, **SMALL_POOL)
    engine, rng = llm.engine, random.Random(7)
    for i, n in enumerate((41, 50)):
        engine.add_request(f"w{i}", {"prompt_token_ids": _tokens(rng, n)},
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # both prompts prefilled: 41 and 50 slots filled of 11 and 13 blocks
    s = engine.stats()
    assert (s["kv_slots_used"], s["kv_slots_allocated"]) == (91, 96)
    assert s["kv_waste_perc"] == pytest.approx(5 / 96)
    engine.step()  # one decode token each: 42 of 44, 51 of 52
    s = engine.stats()
    assert (s["kv_slots_used"], s["kv_slots_allocated"]) == (93, 96)
    assert s["kv_waste_perc"] == pytest.approx(3 / 96)
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert (s["kv_slots_allocated"], s["kv_waste_perc"]) == (0, 0.0)  # nothing running, nothing wasted
    llm.shutdown()


def test_failed_steps_never_leave_unwritten_blocks_in_either_tier(model, baseline):
    """Every 5th forward fails before its tier copies and writes ran; the core rolls those plans back, so the
    rounds served afterwards (hitting whatever survived in both tiers) are still exact."""
    from ironlm.engine.faults import parse

    llm = LLM(model, kv_offload_memory="1MiB", **SMALL_POOL)
    llm.engine.faults = parse("forward:raise:every=5")
    errors = [o.error for prompts in _shared_prefix_rounds() for o in _generate(llm, prompts)]
    assert any(errors) and not all(errors)
    llm.engine.faults = None
    assert [_texts(_generate(llm, prompts)) for prompts in _shared_prefix_rounds()] == baseline[1]
    assert llm.engine.stats()["prefix_hits_tier"] > 0


def test_reset_starts_the_tier_empty_and_keeps_serving(model, baseline):
    llm = LLM(model, kv_offload_memory="1MiB", **SMALL_POOL)
    first = _shared_prefix_rounds()[0]
    assert _texts(_generate(llm, first)) == baseline[1][0]
    llm.engine.reset()
    assert llm.engine.stats()["tier_blocks_used"] == 0
    assert _texts(_generate(llm, first)) == baseline[1][0]
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(EngineDeadError):
        llm.engine.step()


# ---- (b) the disk tier across restarts --------------------------------------------------------------------
DISK = {**BASE, "num_kv_blocks": 64, "max_num_seqs": 4, "kv_offload_size": "1MiB"}


def _long_prompt() -> list[int]:
    return _tokens(random.Random(7), 90)


@pytest.fixture(scope="module")
def disk_reference(model):
    llm = LLM(model, **{k: v for k, v in DISK.items() if k != "kv_offload_size"})
    return _texts(_generate(llm, [_long_prompt()]))


def _serve_once(model: str, folder: Path) -> LLM:
    llm = LLM(model, kv_offload_dir=str(folder), **DISK)
    _generate(llm, [_long_prompt()])
    return llm


def test_disk_tier_survives_restarts(model, tmp_path, disk_reference):
    first = _serve_once(model, tmp_path)
    assert first.engine.stats()["prefix_hits_tier"] == 0
    first.shutdown()
    assert list(tmp_path.glob("*.idx")), "shutdown wrote no index"
    # The second run's only request ends in the step that promoted its prefix back: saved again all the same.
    second = LLM(model, kv_offload_dir=str(tmp_path), **DISK)
    assert second.engine.stats()["tier_blocks_used"] >= len(_long_prompt()) // BLOCK - 1
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = _generate(second, [_long_prompt()], one)
    assert _texts(out) == [disk_reference[0][:1]]
    assert out[0].num_cached_tokens > 0 and second.engine.stats()["prefix_hits_tier"] > 0
    second.shutdown()
    third = LLM(model, kv_offload_dir=str(tmp_path), **DISK)
    out = _generate(third, [_long_prompt()])
    assert _texts(out) == disk_reference
    assert out[0].num_cached_tokens > 0 and third.engine.stats()["prefix_hits_tier"] > 0
    third.shutdown()


def test_disk_tier_saved_by_async_engine_shutdown_and_at_exit(model, tmp_path):
    """AsyncLLMEngine.shutdown ends the engine on its thread (saving the tier); a process that never calls
    shutdown saves it at exit."""
    import asyncio

    from ironlm.engine import AsyncLLMEngine, LLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=model, kv_offload_dir=str(tmp_path / "async"), **DISK)))

    async def serve() -> None:
        async for _ in engine.generate({"prompt_token_ids": _long_prompt()}, GREEDY):
            pass
        await engine.shutdown(drain_timeout=5)

    asyncio.run(serve())
    assert list((tmp_path / "async").glob("*.idx"))
    code = (f"from ironlm import LLM, SamplingParams\n"
            f"llm = LLM({model!r}, kv_offload_dir={str(tmp_path / 'exit')!r}, **{DISK!r})\n"
            f"llm.generate([{{'prompt_token_ids': {_long_prompt()!r}}}], SamplingParams(max_tokens=2), "
            f"use_tqdm=False)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    llm = LLM(model, kv_offload_dir=str(tmp_path / "exit"), **DISK)
    assert llm.engine.stats()["tier_blocks_used"] > 0
    llm.shutdown()


def test_corrupt_disk_tier_is_ignored_with_a_warning(model, tmp_path, disk_reference, caplog):
    _serve_once(model, tmp_path).shutdown()
    data = next(tmp_path.glob("*.kv"))
    raw = bytearray(data.read_bytes())
    raw[::4096] = bytes(b ^ 0xFF for b in raw[::4096])  # a flipped byte in every page
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        llm = LLM(model, kv_offload_dir=str(tmp_path), **DISK)
    assert "checksum" in caplog.text
    out = _generate(llm, [_long_prompt()])
    assert _texts(out) == disk_reference
    assert out[0].num_cached_tokens == 0 and llm.engine.stats()["prefix_hits_tier"] == 0
    llm.shutdown()


def test_foreign_disk_tier_is_ignored_with_a_warning(model, tmp_path, disk_reference, caplog):
    """Another engine's files put under this engine's names: the index names another fingerprint."""
    _serve_once(model, tmp_path / "a").shutdown()
    other = LLM(model, kv_offload_dir=str(tmp_path / "b"), quantization="none", **DISK)  # another fingerprint
    other.shutdown()
    (own_kv,), (own_idx,) = (tmp_path / "b").glob("*.kv"), (tmp_path / "b").glob("*.idx")
    own_kv.write_bytes(next((tmp_path / "a").glob("*.kv")).read_bytes())
    own_idx.write_bytes(next((tmp_path / "a").glob("*.idx")).read_bytes())
    with caplog.at_level(logging.WARNING):
        llm = LLM(model, kv_offload_dir=str(tmp_path / "b"), quantization="none", **DISK)
    assert "foreign fingerprint" in caplog.text
    out = _generate(llm, [_long_prompt()])
    assert _texts(out) == disk_reference
    assert out[0].num_cached_tokens == 0
    llm.shutdown()


def test_odd_files_at_the_tier_names_start_cold_instead_of_failing(model, tmp_path, disk_reference, caplog):
    """A FIFO at `.idx` used to hang the start; a dangling symlink at `.kv` failed it (rc 2 from `ironlm serve`),
    a live one had its target overwritten. The engine starts cold instead, with a warning, and serves."""
    _serve_once(model, tmp_path).shutdown()
    (data,), (index,) = tmp_path.glob("*.kv"), tmp_path.glob("*.idx")
    index.unlink()
    os.mkfifo(index)
    with caplog.at_level(logging.WARNING):
        llm = LLM(model, kv_offload_dir=str(tmp_path), **DISK)
    assert "not a regular file" in caplog.text
    out = _generate(llm, [_long_prompt()])
    assert _texts(out) == disk_reference and out[0].num_cached_tokens == 0
    llm.shutdown()
    assert index.is_file()  # the save replaced the FIFO with a real index
    data.unlink()
    data.symlink_to(tmp_path / "nowhere")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        llm = LLM(model, kv_offload_dir=str(tmp_path), **DISK)
    assert "starts cold" in caplog.text
    s = llm.engine.stats()
    assert s["kv_tier"] == "disk" and s["tier_blocks_used"] == 0
    out = _generate(llm, [_long_prompt()])
    assert _texts(out) == disk_reference and out[0].num_cached_tokens == 0
    llm.shutdown()
    assert data.is_symlink() and not (tmp_path / "nowhere").exists()


# ---- (c) swap instead of recompute ------------------------------------------------------------------------
# 16 blocks = 64 tokens for four 20-token prompts growing by 24 tokens each: preemption is certain.
SWAP_POOL = {**BASE, "num_kv_blocks": 16, "max_num_seqs": 4, "max_model_len": 64}
SWAP_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_swap_keeps_greedy_output_and_copies_both_ways(model):
    rng = random.Random(3)
    prompts = [_tokens(rng, 20) for _ in range(4)]
    plain = LLM(model, **SWAP_POOL)
    expected = _texts(_generate(plain, prompts, SWAP_PARAMS))
    assert plain.engine.stats()["num_preemptions"] > 0
    swapped = LLM(model, swap_space=0.001, **SWAP_POOL)  # ~1 MiB: 128 blocks
    assert _texts(_generate(swapped, prompts, SWAP_PARAMS)) == expected
    s = swapped.engine.stats()
    assert s["num_preemptions"] > 0
    assert s["swap_out_blocks"] > 0 and s["swap_in_blocks"] > 0


def test_costly_copies_recompute_instead_with_identical_output(model, baseline):
    """When the cost model says copying back costs more than recomputing, tier hits are recomputed."""
    llm = LLM(model, kv_offload_memory="1MiB", **SMALL_POOL)
    llm.engine.kv.set_promote_cost(1.0, 1e-9)  # 1 s a block vs ~nothing a token: never worth copying
    assert [_texts(_generate(llm, prompts)) for prompts in _shared_prefix_rounds()] == baseline[1]
    s = llm.engine.stats()
    assert s["kv_demotions"] > 0 and s["kv_promotions"] == 0 and s["prefix_hits_tier"] == 0


# ---- (d) pinned prefixes ----------------------------------------------------------------------------------
def test_pinned_prefix_survives_a_flood(model):
    rng = random.Random(11)
    system = "You are a terse assistant."
    llm = LLM(model, kv_pin_prefix=[system], **SMALL_POOL)
    pinned = llm.engine.stats()["blocks_pinned"]
    assert pinned > 0
    system_ids = llm.get_tokenizer().encode(system)  # as the engine encodes a text prompt
    flood, question = [_tokens(rng, 40) for _ in range(12)], _tokens(rng, 6)  # 12 x 11 blocks, a 48-block pool
    _generate(llm, flood)
    out = _generate(llm, [system_ids + question])
    assert out[0].num_cached_tokens >= pinned * BLOCK
    assert llm.engine.stats()["blocks_pinned"] == pinned
    # The control: the same prefix served (not pinned) before the same flood is gone after it.
    control = LLM(model, **SMALL_POOL)
    _generate(control, [system_ids])
    _generate(control, flood)
    again = _generate(control, [system_ids + question])
    assert again[0].num_cached_tokens == 0
    assert _texts(again) == _texts(out)


# ---- (e) metrics ---------------------------------------------------------------------------------------
def test_metrics_export_the_kv_hierarchy(tiered):
    from ironlm.server.metrics import ServerMetrics

    llm, _ = tiered
    text = ServerMetrics(llm.engine.stats, lambda: True, "tiny").render().decode()
    s = llm.engine.stats()
    for series in ('ironlm:kv_offload_blocks{model_name="tiny",tier="device"}',
                   'ironlm:kv_offload_blocks{model_name="tiny",tier="host"}',
                   'ironlm:kv_offload_blocks{model_name="tiny",tier="disk"} 0.0',
                   'ironlm:prefix_cache_hits_by_tier_total{model_name="tiny",tier="host"}',
                   "ironlm:kv_promotions_total", "ironlm:kv_demotions_total", "ironlm:kv_swap_in_blocks_total",
                   "ironlm:kv_swap_out_blocks_total", "ironlm:kv_waste_perc", "ironlm:prefix_cache_hits_total"):
        assert series in text, series
    assert f'ironlm:kv_offload_blocks{{model_name="tiny",tier="host"}} {float(s["tier_blocks_used"])}' in text
    assert f'ironlm:kv_promotions_total{{model_name="tiny"}} {float(s["kv_promotions"])}' in text


# ---- tensor parallelism: each rank copies its own shard of every block ------------------------------------
def test_tp2_swap_matches_tp1(model):
    rng = random.Random(5)
    prompts = [_tokens(rng, 20) for _ in range(4)]
    expected = _texts(_generate(LLM(model, **SWAP_POOL), prompts, SWAP_PARAMS))
    tp = LLM(model, tensor_parallel_size=2, distributed_timeout=120, swap_space=0.001, **SWAP_POOL)
    try:
        assert tp.engine.runner.tier is not None and tp.engine.stats()["tier_blocks_total"] > 0
        assert _texts(_generate(tp, prompts, SWAP_PARAMS)) == expected
        s = tp.engine.stats()
        assert s["swap_out_blocks"] > 0 and s["swap_in_blocks"] > 0
    finally:
        tp.shutdown()
