"""The speculation cost model (engine/spec/cost.py): the budget it picks against known cost curves, the online
step-cost learner on a noisy stream, and an engine whose model is given a fixed cost table through
speculative_config: a compute-bound batch makes no proposals while a single sequence still does, with outputs
unchanged and no block leaked; the pause counter and the budget reach /metrics.
"""

from __future__ import annotations

import itertools
import random

import pytest

from ironlm import LLM, SamplingParams
from ironlm.engine.spec.cost import SpecBudget, StepCosts
from ironlm.exceptions import InvalidArgumentError
from ironlm.server.metrics import ServerMetrics
from tiny_models import make_tiny_model


def _knee(n: float, flat: float = 0.010, knee: int = 16, per_row: float = 0.001) -> float:
    """A CPU step: one weight pass up to the knee, then every row its own compute."""
    return flat + per_row * max(0.0, n - knee)


def _table(curve, rows=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512)) -> list[tuple[int, float]]:
    return [(r, curve(r)) for r in rows]


def _budget(curve, acceptance: float, k: int = 5, cap: int | None = None) -> SpecBudget:
    b = SpecBudget(k, cap, table=_table(curve))
    for _ in range(200):  # a long history at this acceptance
        b.acceptance.record(100, round(100 * acceptance))
    return b


def test_a_single_sequence_speculates_when_acceptance_is_decent():
    b = _budget(_knee, 0.6)
    assert b.choose(1, 1) == 5
    assert b.gain(1, 5) == pytest.approx(1 + 0.6 * 5, rel=0.01)
    # The user's cap still binds.
    assert _budget(_knee, 0.6, cap=3).choose(1, 1) == 2


def test_poor_acceptance_pauses_even_where_rows_are_free():
    b = _budget(_knee, 0.0)
    assert b.choose(1, 1) == 0
    assert b.paused_steps == 1


def test_a_compute_bound_batch_pauses_and_the_budget_shrinks_as_the_batch_grows():
    per_seq = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        b = _budget(_knee, 0.6)
        per_seq.append(b.choose(batch, batch) / batch)
    assert per_seq[0] == 5
    assert all(a >= b for a, b in itertools.pairwise(per_seq)), per_seq
    assert per_seq[-1] == 0, per_seq  # 64 rows are past the knee: a rejected row costs a useful one's time
    assert 0 < per_seq[2] < 5, per_seq  # 4 sequences: part of the lookahead still fits before the knee
    # A prefill chunk in the step makes it compute-bound too.
    assert _budget(_knee, 0.6).choose(2, 200) == 0
    # A linear curve from the first row (no weight-pass floor): proposals never pay.
    assert _budget(lambda n: 0.001 * n, 0.9).choose(1, 1) == 0


def test_a_cheaper_verification_path_is_used_when_measured():
    """Steps with proposals may take another code path than plain decode steps (the lean CPU step): the two
    curves are learnt apart, and a measured-cheap verification turns speculation on where the plain curve
    alone would say compute-bound."""
    b = SpecBudget(4)
    for _ in range(20):
        b.acceptance.record(10, 8)
    for n in (8, 16, 32, 64):
        for _ in range(8):
            b.plain.observe(n, _knee(n, knee=4))
            b.spec.observe(n, 0.5 * _knee(n, knee=4))
    assert b.choose(8, 8) > 0
    b.spec = StepCosts()
    for n in (8, 16, 32, 64):
        for _ in range(8):
            b.spec.observe(n, 2.0 * _knee(n, knee=4))
    assert b.choose(8, 8) == 0


def test_prefill_steps_do_not_make_plain_decode_look_slow():
    """A W-like batch: decode-only steps of 64 rows are fast (the lean step), steps with a prefill chunk in the
    same row range slow, verification steps in between. Against the decode-only curve speculation loses."""
    b = SpecBudget(5)
    for _ in range(30):
        b.acceptance.record(10, 9)
    for _ in range(10):
        b.observe(64, 0, 0, 0.05)
        b.observe(100, 0, 0, 0.25, prefill=True)
        b.observe(69, 5, 4, 0.12)
        b.observe(74, 10, 9, 0.13)
        b.observe(130, 5, 4, 0.30, prefill=True)
    assert b.choose(64, 64) == 0
    assert b.paused_steps == 1
    # With a prefill chunk in the step as well, the comparison is against steps with prefill rows.
    assert b.gain(100, 5, prefill=True) is not None


def test_proposals_in_a_step_the_token_budget_fills_displace_prompt_rows():
    """Where decode + prompt rows already fill max_num_batched_tokens, proposals take prompt rows' places: even
    on a flat (memory-bound) curve a rejected proposal then costs a sure prompt row, so such a step does not
    speculate; with room under the budget it still does."""
    flat = _table(lambda n: 0.010, rows=(1, 64, 256, 1024, 2048, 4096))
    b = SpecBudget(5, table=flat, token_budget=2048)
    blind = SpecBudget(5, table=flat)  # no budget: proposals look free beside the prompt rows
    for m in (b, blind):
        for _ in range(200):
            m.acceptance.record(100, 60)
    assert blind.choose(64, 2048) > 0
    assert b.choose(64, 2048) == 0
    assert b.gain(64 + 1984, 64, prefill=True) == pytest.approx((1984 + 0.6 * 64) / 2048, rel=0.01)
    assert b.choose(64, 200) > 0  # 200 rows + proposals fit the budget: they add rows, displace none


def test_the_learner_converges_on_a_noisy_stream_with_outliers():
    rng = random.Random(0)
    costs = StepCosts()
    for _ in range(4000):
        n = rng.choice([1, 2, 3, 5, 8, 13, 21, 40, 64, 100, 200, 300])
        s = _knee(n) * rng.uniform(0.95, 1.05)
        if rng.random() < 0.03:
            s *= rng.choice([10.0, 0.1])  # a stalled step (another process, a GC) or a clock glitch
        costs.observe(n, s)
    # (Not at the knee itself: a chord over a convex corner is above it, the conservative side for proposals.)
    for n in (1, 5, 40, 64, 100, 300):
        assert costs.estimate(n) == pytest.approx(_knee(n), rel=0.12), n
    # Drift: the machine gets twice as fast (e.g. verification moves to a faster path); the estimate follows.
    for _ in range(1500):
        n = rng.choice([8, 64, 200])
        costs.observe(n, 0.5 * _knee(n) * rng.uniform(0.95, 1.05))
    assert costs.estimate(64) == pytest.approx(0.5 * _knee(64), rel=0.12)


def test_a_cold_outlier_does_not_become_the_estimate():
    costs = StepCosts()
    assert costs.estimate(8) is None
    for s in (1.0, 0.01):  # the first step of a process is often slow
        costs.observe(8, s)
    assert costs.estimate(8) is None, "two steps decide nothing yet"
    for s in (0.011, 0.0095, 0.0105):
        costs.observe(8, s)
    assert costs.estimate(8) == pytest.approx(0.0105, rel=0.06)
    assert costs.estimate(1) is None, "below everything measured: unknown"
    assert costs.estimate(12) == pytest.approx(0.0105, rel=0.06), "one bucket: flat inside it"
    assert costs.estimate(500) is None, "above the only bucket: unknown"


def test_cold_start_speculates_to_measure_and_probes_keep_both_curves_fresh():
    b = SpecBudget(4, probe_every=8)
    assert b.choose(1, 1) == 4, "nothing measured: speculate as the static budget did"
    # 64 cold sequences measure with one sequence's proposals, not 64 x 4 rows of compute.
    assert SpecBudget(4).choose(64, 64) == 4
    # Steps with proposals are cheap, plain steps were never seen at this size: after probe_every steps
    # one plain step is measured.
    budgets = []
    for _ in range(20):
        p = b.choose(1, 1)
        budgets.append(p)
        b.observe(1 + p, p, p // 2, 0.01)  # proposals are free here
    assert 0 in budgets and budgets.count(0) <= 3, budgets
    # A compute-bound batch: paused, with a small probe now and then to refresh the verification curve.
    b = SpecBudget(4, probe_every=8)
    for _ in range(8):
        b.observe(64, 0, 0, _knee(64))
        b.observe(68, 4, 1, _knee(68) * 1.5)
    budgets = []
    for _ in range(40):
        p = b.choose(64, 64)
        budgets.append(p)
        b.observe(64 + p, p, p // 4, _knee(64 + p) * (1.5 if p else 1.0))
    assert set(budgets) <= {0, 4}, budgets
    assert 1 <= budgets.count(4) <= 6, budgets
    assert b.paused_steps == budgets.count(0)


def test_a_budget_a_stall_made_look_slow_is_probed_and_chosen_again():
    """A draft model's step: every proposal costs a draft forward, and nearly all are accepted, so the full budget
    is best. Stalled steps at that budget inflate its estimate until a smaller one wins; the smaller budget's
    steps never refresh the larger one's, so only a probe brings the choice back."""
    def cost(rows: int) -> float:
        return 0.010 + 0.002 * (rows - 1)

    b = SpecBudget(4, probe_every=8)
    for p in (0, 1, 2, 4) * 6:
        b.observe(1 + p, p, p, cost(1 + p))
    assert b.choose(1, 1) == 4
    for _ in range(6):  # stalls at the full budget
        b.observe(5, 4, 4, 0.2)
    assert b.choose(1, 1) < 4
    budgets = []
    for _ in range(40):
        p = b.choose(1, 1)
        budgets.append(p)
        b.observe(1 + p, p, p, cost(1 + p))
    # Back at the full budget, but for the plain probe now and then.
    assert set(budgets[-16:]) <= {0, 4} and budgets[-16:].count(4) >= 14, budgets


def test_bad_step_costs_name_the_field(tmp_path_factory):
    from ironlm.spec_config import parse_speculative_config

    for bad in ([[1, 0.01]], [[2, 0.01], [1, 0.02]], [[0, 0.01], [4, 0.02]], [[1, -1.0], [4, 0.02]], "x",
                [[1, 0.01], [4]]):
        with pytest.raises(InvalidArgumentError) as e:
            parse_speculative_config({"num_speculative_tokens": 2, "step_costs": bad})
        assert e.value.param == "speculative_config.step_costs"
    with pytest.raises(InvalidArgumentError) as e:
        parse_speculative_config({"num_speculative_tokens": 2, "cost_model": "yes"})
    assert e.value.param == "speculative_config.cost_model"
    cfg = parse_speculative_config({"num_speculative_tokens": 2})
    assert cfg is not None and cfg.cost_model and cfg.max_batch_tokens is None and cfg.step_costs is None


# ---- the engine ---------------------------------------------------------------------------------------------

# Flat to 8 rows, then a row costs more than the rows before it on average: any batch past 8 rows is better off
# without a single proposal, whatever the acceptance.
TABLE = [[1, 0.010], [8, 0.010], [16, 0.040], [64, 0.400], [1024, 8.0]]
KW = {"num_kv_blocks": 512, "block_size": 4, "seed": 0, "dtype": "float32", "max_num_seqs": 16,
      "max_num_batched_tokens": 2048}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = str(make_tiny_model(tmp_path_factory.mktemp("spec_cost"), arch="llama"))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "step_costs": TABLE}
    return LLM(model, **KW), LLM(model, speculative_config=spec, **KW)


def _copying(vocab: int, seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    chunk = [rng.randrange(6, vocab) for _ in range(n)]
    return chunk * 3 + chunk[: n // 2]  # a copy in progress: lookup proposes the rest of the chunk


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_the_engine_pauses_a_compute_bound_batch_and_speculates_for_one_sequence(engines):
    plain, spec = engines
    vocab = spec.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    m0 = spec.get_metrics()
    one = [_copying(vocab, 1, 5)]  # the tiny random model falls into a loop here: proposals are accepted
    assert _tokens(spec, one, params) == _tokens(plain, one, params)
    m1 = spec.get_metrics()
    assert m1["spec_decode_num_draft_tokens"] > m0["spec_decode_num_draft_tokens"]
    assert m1["spec_decode_num_accepted_tokens"] > m0["spec_decode_num_accepted_tokens"]
    assert m1["spec_decode_paused_steps"] == m0["spec_decode_paused_steps"]
    # 16 sequences decode in lockstep (one prefill step, the same length): every decode step has 16 rows, and
    # each paused step runs exactly the plain engine's plan (rows, sampled rows, sequences).
    many = [_copying(vocab, s) for s in range(16)]
    shapes: tuple[list, list] = ([], [])
    for llm, out in zip((plain, spec), shapes):  # each paused step's plan and forward: what the plain step runs
        def tap(plan, timer=None, extra=None, _run=llm.engine.runner.execute, _out=out):
            _out.append((plan.num_tokens, plan.num_samples, plan.num_seqs, int(plan.max_query_len)))
            return _run(plan, timer, extra)
        llm.engine.runner.execute = tap
    try:
        assert _tokens(spec, many, params) == _tokens(plain, many, params)
    finally:
        for llm in (plain, spec):
            del llm.engine.runner.execute
    assert shapes[1] == shapes[0] and len(shapes[0]) >= params.max_tokens
    m2 = spec.get_metrics()
    assert m2["spec_decode_num_draft_tokens"] == m1["spec_decode_num_draft_tokens"], "no proposal at 16 rows"
    assert m2["spec_decode_paused_steps"] - m1["spec_decode_paused_steps"] >= params.max_tokens - 1
    assert m2["spec_decode_budget"] == 0
    assert spec.engine.stats()["blocks_used"] == 0
    text = ServerMetrics(spec.engine.stats, lambda: True, "m").render().decode()
    assert f'ironlm:spec_decode_paused_steps_total{{model_name="m"}} {float(m2["spec_decode_paused_steps"])}' in text
    assert 'ironlm:spec_decode_budget{model_name="m"} 0.0' in text
    # And one sequence again speculates.
    assert _tokens(spec, one, params) == _tokens(plain, one, params)
    assert spec.get_metrics()["spec_decode_num_draft_tokens"] > m2["spec_decode_num_draft_tokens"]
    assert spec.engine.stats()["blocks_used"] == 0
