"""Draft-model speculative decoding end to end: greedy output is the plain engine's token for token (logprobs
too) with a smaller random draft (rejections everywhere), a noisy copy of the target (runs accepted part way)
and the target itself as its own draft (everything accepted), through n > 1, stop strings, max_tokens and
preemption; no block leaks; seeded sampling repeats; the first two sampled tokens follow the target's
distribution (chi-square against transformers' own probabilities, enough samples that a biased verifier fails).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ironlm import LLM, SamplingParams, _core
from ironlm.config import EngineConfig
from ironlm.exceptions import InvalidArgumentError, UnsupportedModelError
from ironlm.sampler import Sampler
from ironlm.sampler.rejection import Drafts
from tiny_models import load_hf_reference, make_tiny_model

KW = {"block_size": 4, "seed": 0, "dtype": "float32"}


def _noisy_copy(src: Path, dst: Path, scale: float) -> Path:
    """The target with every weight perturbed: a draft that agrees often, not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    model.save_pretrained(str(dst))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(d, arch="llama")
    small = make_tiny_model(d, arch="llama", name="small", hidden_size=128, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, seed=3)
    return {"target": target, "small": small, "noisy": _noisy_copy(target, d / "noisy", 0.05)}


def _spec(path: Path, k: int = 3) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, "max_batch_tokens": 4096, "cost_model": False}


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(6, 337) for _ in range(n)] for n in (5, 11, 23)]


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]


def _same(a, b) -> None:
    for ra, rb in zip(a, b, strict=True):
        for (ta, la, fa), (tb, lb, fb) in zip(ra, rb, strict=True):
            assert (ta, fa) == (tb, fb)
            if la is not None:
                for da, db in zip(la, lb, strict=True):
                    assert da.keys() == db.keys()
                    for t in da:
                        assert da[t].logprob == pytest.approx(db[t].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def plain(models):
    return LLM(str(models["target"]), num_kv_blocks=512, **KW)


@pytest.mark.parametrize("draft", ["small", "noisy", "target"])
def test_greedy_output_is_the_plain_engines(models, plain, draft):
    spec = LLM(str(models["target"]), num_kv_blocks=512, speculative_config=_spec(models[draft]), **KW)
    prompts = _prompts()
    free = plain.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(temperature=0, max_tokens=16),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_text = plain.engine.tokenizer.decode(free[6:8])
    cases = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0, max_tokens=7, n=2),
        SamplingParams(temperature=0, max_tokens=16, stop=[stop_text], stop_token_ids=[free[11]]),
    ]
    for params in cases:
        _same(_run(plain, prompts, params), _run(spec, prompts, params))
    m = spec.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 30, m
    rate = m["spec_decode_acceptance_rate"]
    if draft == "target":  # its own draft: every proposal is the target's argmax
        assert rate > 0.97, m
        assert m["spec_decode_mean_acceptance_length"] > 3.0, m
    elif draft == "noisy":
        assert 0.2 < rate < 0.97, m
    assert len(m["spec_decode_acceptance_per_pos"]) == 3
    assert spec.engine.stats()["blocks_used"] == 0
    if draft == "noisy":  # /metrics renders the same figures (per position too)
        from ironlm.server.metrics import ServerMetrics

        text = ServerMetrics(spec.engine.stats, lambda: True, "m").render().decode()
        pos0 = m["spec_decode_acceptance_per_pos"][0]
        assert f'ironlm:spec_decode_acceptance_rate_per_pos{{model_name="m",position="0"}} {pos0}' in text, text
        assert f'ironlm:spec_decode_mean_acceptance_length{{model_name="m"}} ' \
               f'{m["spec_decode_mean_acceptance_length"]}' in text


def test_preemption_keeps_greedy_output(models, plain):
    """A pool too small for the batch: sequences are preempted and recomputed (the draft recomputes its KV)."""
    prompts = [p * 2 for p in _prompts()] * 2
    params = SamplingParams(temperature=0, max_tokens=40)
    spec = LLM(str(models["target"]), num_kv_blocks=40, speculative_config=_spec(models["noisy"], 4), **KW)
    _same(_run(plain, prompts, params), _run(spec, prompts, params))
    s = spec.engine.stats()
    assert s["num_preemptions"] > 0 and s["spec_decode_num_accepted_tokens"] > 0, s
    assert s["blocks_used"] == 0


def test_seeded_sampling_repeats_and_self_draft_accepts_all(models):
    spec = LLM(str(models["target"]), num_kv_blocks=512, speculative_config=_spec(models["target"]), **KW)
    prompts = _prompts()
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=11, max_tokens=16)
    a, b = _run(spec, prompts, params), _run(spec, prompts, params)
    assert a == b
    m = spec.get_metrics()
    # p == q: min(1, p/q) = 1 for every proposal.
    assert m["spec_decode_acceptance_rate"] > 0.97, m


def test_the_drafts_prompt_catch_up_is_not_counted_as_a_step_cost(models):
    """The cost model learns what a step of so many rows costs; the draft's prefill of a new sequence's prompt
    (made slow here) is paid once a sequence whatever the budget, so the step it lands in is observed without it."""
    spec = LLM(str(models["target"]), num_kv_blocks=512, speculative_config={**_spec(models["target"]),
                                                                             "cost_model": True}, **KW)
    eng = spec.engine
    forward, observe = eng.drafter._forward, eng.spec_budget.observe
    seen: list[tuple[int, float, float]] = []

    def slow_prefill(ids, *args):  # type: ignore[no-untyped-def]
        if sum(len(i) for i in ids) > 2:
            time.sleep(0.5)
        return forward(ids, *args)

    def record(rows, proposed, accepted, seconds, prefill=False):  # type: ignore[no-untyped-def]
        seen.append((proposed, eng.drafter.catchup_seconds, seconds))
        observe(rows, proposed, accepted, seconds, prefill)

    eng.drafter._forward, eng.spec_budget.observe = slow_prefill, record
    prompt = _prompts()[2] * 4
    spec.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                  use_tqdm=False)
    steps = [s for s in seen if s[0] > 0]
    assert steps and steps[0][1] >= 0.5 and all(c == 0 for _, c, _ in steps[1:]), seen
    assert max(sec for _, _, sec in steps) < 0.4, seen


def _filtered(logits: torch.Tensor, temperature: float, top_k: int) -> np.ndarray:
    p = torch.softmax(logits.double() / temperature, -1)
    if top_k:
        p = p * (p >= p.topk(top_k).values[-1])
    return (p / p.sum()).numpy()


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.8, 5)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k):
    """The real pieces of a draft step without the models: the core reserves two proposal rows per sequence,
    `Sampler.propose` draws them from known draft distributions q0, q1, `set_proposals` hands them in, the
    Sampler verifies them against known target distributions p0, p1 and the core keeps the run. Position 1
    must follow p0, position 2 (reached when proposal 1 was kept) p1, and proposal 1 must be kept with
    probability sum(min(p0, q0)). 8192 sequences: keeping proposals in the target's top-3, or redrawing a
    rejected row from p instead of the residual, fails these."""
    V, batch, rounds = 8, 1024, 8
    g = torch.Generator().manual_seed(1)
    p_logits = [torch.randn(V, generator=g) * 1.5 for _ in range(3)]
    q_logits = [torch.randn(V, generator=g) * 1.5 for _ in range(2)]
    p0, p1 = (_filtered(x, temperature, top_k) for x in p_logits[:2])
    q0 = _filtered(q_logits[0], temperature, top_k)
    cfg = EngineConfig(block_size=4, max_num_seqs=batch).scheduler_config(num_blocks=8192, max_num_batched_tokens=8192,
                                                        max_model_len=64, tier_blocks=0, sliding_window=None)
    sched = _core.Scheduler(cfg)
    sched.set_speculation(2, 4, 1, 100000, external=True)
    sampler = Sampler(V, "cpu", max_slots=batch, seed=0)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    h0, h1, kept = np.zeros(V), np.zeros(V), 0
    for r in range(rounds):
        slots = []
        for i in range(batch):
            slots += sched.add_request(f"{r}-{i}", [1, 2, 3], 8)
            sampler.add(slots[-1], params, [1, 2, 3], seed=r * batch + i)
        sched.schedule()
        sched.update(np.full(batch, 3))
        plan = sched.schedule()
        sd = plan.sample_draft
        assert (sd[2::3] == -1).all() and (sd[0::3] >= 0).all() and (sd[1::3] >= 0).all()
        rows = np.flatnonzero(sd >= 0)
        tokens = np.empty(len(rows), np.int64)
        qs = []
        for j in range(2):
            r_j = np.arange(j, len(sd), 3)
            tok, rnd, q = sampler.propose(q_logits[j].expand(batch, V), plan.sample_slots[r_j],
                                          plan.sample_output_lens[r_j], plan.sample_ban_stop[r_j])
            assert rnd.all() and q is not None
            tokens[j::2] = tok
            qs.append(q)
        sched.set_proposals(plan, tokens)
        assert (plan.sample_draft[rows] == tokens).all()
        probs = torch.stack(qs, 1).reshape(-1, V)  # row order: (seq 0: q0, q1), (seq 1: q0, q1), ...
        logits = torch.stack([p_logits[j % 3] for j in range(len(sd))])
        out = sampler.sample(logits, plan.sample_slots, plan.sample_output_lens, plan.sample_ban_stop,
                             drafts=Drafts(rows, tokens, np.ones(len(rows), bool), probs))
        sched.update(out.token_ids)
        emitted = sched.emitted()
        first, second = out.token_ids[0::3], out.token_ids[1::3]
        assert emitted[0::3].all() and (emitted[1::3] == (first == tokens[0::2])).all()
        h0 += np.bincount(first, minlength=V)
        kept += int(emitted[1::3].sum())
        h1 += np.bincount(second[emitted[1::3]], minlength=V)
        for slot in slots:
            sched.finish(slot)
            sampler.remove(slot)
    total = rounds * batch
    assert chisquare(h0[p0 > 0], p0[p0 > 0] * total).pvalue > 1e-3
    assert h0[p0 == 0].sum() == 0
    assert chisquare(h1[p1 > 0], p1[p1 > 0] * kept).pvalue > 1e-3
    beta = np.minimum(p0, q0).sum()
    assert abs(kept - total * beta) < 4 * (total * beta * (1 - beta)) ** 0.5, (kept, total * beta)


def _first_two_probs(path: Path, prompt: list[int], temperature: float) -> np.ndarray:
    """The target's joint distribution of its first two sampled tokens, [V, V], from transformers."""
    ref = load_hf_reference(path)
    with torch.no_grad():
        p1 = torch.softmax(ref(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        V = p1.shape[0]
        batch = torch.tensor([prompt]).repeat(V, 1)
        seqs = torch.cat([batch, torch.arange(V)[:, None]], 1)
        p2 = torch.softmax(ref(seqs).logits[:, -1].double() / temperature, -1)
    return (p1[:, None] * p2).numpy()


def _chi2(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value over bins of cells taken in order of decreasing probability, each bin expecting at
    least `min_expected` samples (the bins depend on the known distribution only, not on the data)."""
    n = counts.sum()
    order = np.argsort(probs.ravel())[::-1]
    exp, obs = probs.ravel()[order] * n, counts.ravel()[order]
    last = int(exp.sum() // min_expected) - 1
    assert last >= 1, "too few samples for a chi-square"
    bins = np.minimum((np.cumsum(exp) - exp) // min_expected, last).astype(np.int64)
    e, o = np.bincount(bins, exp), np.bincount(bins, obs)
    keep = e > 0
    return float(chisquare(o[keep], e[keep] * o[keep].sum() / e[keep].sum()).pvalue)


def test_first_two_tokens_follow_the_target_distribution(models):
    """1024 seeded requests, k = 1, so the second token is always a verified proposal of the small random draft
    (the first comes from the prefill row; about 28 % of proposals are kept): the joint histogram of the first
    two tokens against the target's exact joint distribution. A verifier that redraws rejected rows from p
    instead of the residual shifts mass toward the draft's choices and fails this (noncentrality ~127 over ~50
    bins); the sampler-level test above catches subtler biases with 8192 sequences."""
    prompt = _prompts()[0]
    temperature = 0.7
    spec = LLM(str(models["target"]), num_kv_blocks=2048, max_num_seqs=512,
               speculative_config=_spec(models["small"], 1), **KW)
    n = 1024
    # max_tokens 3: after the first token, room for one proposal and the row after it.
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    outs = spec.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    pairs = np.array([o.outputs[0].token_ids[:2] for o in outs])
    m = spec.get_metrics()
    assert m["spec_decode_num_draft_tokens"] == n, m  # every second token was a proposal
    assert 0.2 < m["spec_decode_acceptance_rate"] < 0.95, m  # and both outcomes happen often
    probs = _first_two_probs(models["target"], prompt, temperature)
    V = probs.shape[0]
    counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V)
    assert _chi2(counts, probs, 20.0) > 1e-3
    assert _chi2(counts.sum(0), probs.sum(0), 20.0) > 1e-3  # the second token alone: the one speculation decides


def test_bad_draft_models_are_refused(models, tmp_path):
    from ironlm.model import default_model_path

    with pytest.raises(UnsupportedModelError, match="tokenizer"):  # SmolLM2's tokenizer is not the tiny one
        LLM(str(models["target"]), num_kv_blocks=64, speculative_config=_spec(default_model_path()), **KW)
    with pytest.raises(InvalidArgumentError) as e2:
        LLM(str(models["target"]), num_kv_blocks=64,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **KW)
    assert e2.value.param == "speculative_config.model"
    with pytest.raises(FileNotFoundError):
        LLM(str(models["target"]), num_kv_blocks=64, speculative_config=_spec(tmp_path / "missing"), **KW)
