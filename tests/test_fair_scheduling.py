"""Fair-share scheduling (`--scheduling-policy fair`, tenant weights) and `--scheduler-delay-factor`.

The core's own invariants are tested in Rust (rust/src/sched/fair_tests.rs, sched/scheduler/fair_tests.rs); here: the settings
and their errors, the Python binding driven step by step without a model, the tenant's way from HTTP (X-Tenant
header or the OpenAI `user` field) to the engine, and the real tiny engine charging each tenant.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from core_utils import make_scheduler
from fake_engine import FakeEngine
from ironlm import EngineConfig, LLMEngine, _core
from ironlm.cli_args import add_engine_args
from ironlm.engine import AsyncLLMEngine
from ironlm.exceptions import InvalidArgumentError
from ironlm.sampling_params import SamplingParams
from ironlm.server.api import build_app
from ironlm.server.serving_common import MAX_TENANT_CHARS
from server_utils import TINY_ENGINE_KW, LiveServer, tiny_model_path, wait_for


def scheduler(policy: str = "fair", max_num_seqs: int = 8, **kw) -> _core.Scheduler:
    return make_scheduler(4096, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                          max_model_len=256, policy=policy, enable_prefix_caching=False, **kw)


def run_step(s: _core.Scheduler, now: float) -> list[str]:
    """One step at `now` with token 7 sampled everywhere; the ids of requests that got their first token."""
    plan = s.schedule(now)
    firsts = [s.request_id(int(slot)) for slot in plan.sample_slots if len(s.output_token_ids(int(slot))) == 0]
    s.update([7] * plan.num_samples)
    return [r for r in firsts if r is not None]


# ---- settings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "param"), [
    ({"tenant_weights": "a"}, "tenant_weights"),
    ({"tenant_weights": "a=0"}, "tenant_weights"),
    ({"tenant_weights": "a=x"}, "tenant_weights"),
    ({"tenant_weights": "a=1,a=2"}, "tenant_weights"),
    ({"fair_input_token_weight": 0.0}, "fair_input_token_weight"),
    ({"fair_output_token_weight": float("inf")}, "fair_output_token_weight"),
    ({"scheduler_delay_factor": -0.5}, "scheduler_delay_factor"),
    ({"scheduling_policy": "vtc"}, "scheduling_policy"),
])
def test_bad_settings_name_their_parameter(kw, param):
    with pytest.raises(InvalidArgumentError) as err:
        EngineConfig(**kw)
    assert err.value.param == param


def test_settings_parse_and_are_flags():
    import argparse

    config = EngineConfig(scheduling_policy="fair", tenant_weights=" a=2, b=0.5 ", scheduler_delay_factor=0.5)
    assert config.tenant_weight_map() == {"a": 2.0, "b": 0.5}
    assert EngineConfig().tenant_weight_map() is None and EngineConfig().scheduler_delay_factor == 0
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--scheduling-policy", "fair", "--tenant-weights", "a=2,b=1",
                              "--scheduler-delay-factor", "1.5"])
    assert (args.scheduling_policy, args.tenant_weights, args.scheduler_delay_factor) == ("fair", "a=2,b=1", 1.5)
    with pytest.raises(ValueError, match="tenant_weights"):
        scheduler(tenant_weights={"a": -1.0})
    with pytest.raises(ValueError, match="scheduler_delay_factor"):
        scheduler(scheduler_delay_factor=float("nan"))


# ---- the core through its binding -------------------------------------------------------------------------
def test_weighted_shares_within_ten_percent():
    s = scheduler(tenant_weights={"a": 2.0, "b": 1.0})
    n = 0
    for step in range(1500):
        for tenant in ("a", "b"):
            live = s.tenant_stats().get(tenant, {"live": 0})["live"]
            for _ in range(int(live), 12):
                s.add_request(f"{tenant}{n}", [100 + n % 50] * 10, 4 + n % 9, tenant=tenant, arrival_time=step)
                n += 1
        run_step(s, float(step))
    stats = s.tenant_stats()
    served = {t: stats[t]["input_tokens"] + stats[t]["output_tokens"] for t in ("a", "b")}
    assert abs(served["a"] / served["b"] - 2.0) <= 0.2, served
    assert stats["a"]["weight"] == 2.0 and stats["b"]["weight"] == 1.0


def light_first_token_steps(policy: str) -> list[int]:
    s = scheduler(policy)
    for i in range(48):
        s.add_request(f"h{i}", [1000 + i] * 16, 8 + i * 7 % 25, tenant="heavy", arrival_time=0.0)
    for step in range(3):
        run_step(s, float(step))
    for i in range(4):
        s.add_request(f"l{i}", [2000 + i] * 16, 8, tenant="light", arrival_time=3.0)
    waits: dict[str, int] = {}
    for step in range(3, 2000):
        for rid in run_step(s, float(step)):
            if rid.startswith("l"):
                waits[rid] = step - 3 + 1
        if len(waits) == 4:
            return sorted(waits.values())
    raise AssertionError(f"light requests never served under {policy}: {waits}")


def test_heavy_tenant_cannot_delay_light_tenant_beyond_bound():
    # Bound (derived in rust/src/sched/scheduler/fair_tests.rs): the light tenant is lifted to the heavy one's counter, so
    # it waits only for seats (<= 32 steps, the longest heavy request) plus the time its prompt lead (<= 4 x 16
    # tokens) takes the heavy tenant to make up (>= 2 tokens/step): 65 steps. fcfs makes it wait for all 48.
    fair, fcfs = light_first_token_steps("fair"), light_first_token_steps("fcfs")
    assert max(fair) <= 65, fair
    assert max(fcfs) > 65, fcfs


def test_delay_factor_holds_admissions_while_running():
    def admissions(factor: float) -> list[int]:
        s = scheduler("fcfs", max_num_seqs=16, scheduler_delay_factor=factor)
        assert s.scheduler_delay_factor == factor
        s.add_request("long", [5] * 8, 100, arrival_time=0.0)
        out = []
        for k in range(1, 11):
            s.add_request(f"r{k}", [6 + k] * 8, 50, arrival_time=float(k))
            plan = s.schedule(float(k))
            out.append(len(plan.new_request_ids))
            s.update([7] * plan.num_samples)
        return out

    assert admissions(0.0) == [2] + [1] * 9
    held = admissions(3.0)  # 1 s steps: an admission every 3 s, in batches
    assert held[0] == 2 and held[1:3] == [0, 0] and held[3] == 3, held
    assert sum(held) <= 11


# ---- from HTTP to the engine ------------------------------------------------------------------------------
def test_tenant_comes_from_x_tenant_header_else_user_field():
    fake = FakeEngine()
    tenants: dict[str, str | None] = {}
    add = fake.add_request

    def recording_add(request_id, prompt, params=None, **kw):
        tenants[request_id] = kw.get("tenant")
        return add(request_id, prompt, params, **kw)

    fake.add_request = recording_add
    engine = AsyncLLMEngine(fake)
    server = LiveServer(build_app(engine, served_model_name="fake-model"), engine)
    body = {"model": "fake-model", "prompt": "ab", "max_tokens": 2}
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            sent = [
                http.post("/v1/completions", json={**body, "request_id": "h"}, headers={"X-Tenant": "team-a"}),
                http.post("/v1/completions", json={**body, "request_id": "u", "user": "alice"}),
                http.post("/v1/completions", json={**body, "request_id": "both", "user": "alice"},
                          headers={"X-Tenant": "team-b"}),
                http.post("/v1/completions", json={**body, "request_id": "none"}),
                http.post("/v1/completions", json={**body, "request_id": "long", "user": "x" * 5000}),
                http.post("/v1/chat/completions", json={**chat, "request_id": "c"}, headers={"X-Tenant": "team-c"}),
            ]
        assert [r.status_code for r in sent] == [200] * len(sent), [r.text for r in sent]
        assert tenants["h"] == "team-a" and tenants["u"] == "alice" and tenants["both"] == "team-b"
        assert tenants["none"] is None and tenants["long"] == "x" * MAX_TENANT_CHARS
        assert tenants["c"] == "team-c"
    finally:
        server.stop()
        asyncio.run(engine.shutdown(drain_timeout=1))


@pytest.fixture(scope="module")
def fair_engine(tmp_path_factory):
    config = EngineConfig(model=str(tiny_model_path(tmp_path_factory)), device="cpu", scheduling_policy="fair",
                          tenant_weights="a=2,b=1", **TINY_ENGINE_KW)
    return LLMEngine(config)


def test_real_engine_charges_each_tenant(fair_engine):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    fair_engine.add_request("x", "one two three", params, tenant="a")
    fair_engine.add_request("y", "four five", params, tenant="b")
    fair_engine.add_request("z", "six", params)
    assert wait_for(lambda: not fair_engine.step() and not fair_engine.has_unfinished_requests(), timeout=60)
    stats = fair_engine.scheduler.tenant_stats()
    assert stats["a"]["output_tokens"] == stats["b"]["output_tokens"] == stats[""]["output_tokens"] == 5
    assert stats["a"]["weight"] == 2.0 and stats["a"]["live"] == 0
    # Counters are weighted (output tokens count double by default) and divided by the share.
    assert stats["a"]["counter"] == pytest.approx((stats["a"]["input_tokens"] + 2 * 5) / 2)
