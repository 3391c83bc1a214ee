"""Sampler: every sampling parameter against a straightforward reference, seeded reproducibility, logprobs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import ironlm.sampler.filters as filters_mod
from ironlm.sampler import Sampler, SamplerOutput
from ironlm.sampling_params import SamplingParams as SP

EOS = 2


class CountingSampler(Sampler):
    """Plays the core's part: counts each slot's outputs and hands them to `sample` as `output_lens`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: dict[int, int] = {}

    def step(self, logits: torch.Tensor, slots: np.ndarray, ban_stop: np.ndarray | None = None) -> SamplerOutput:
        slots = np.asarray(slots, dtype=np.int64)
        lens = np.array([self.outputs.get(s, 0) for s in slots.tolist()], np.int64)
        out = self.sample(logits, slots, lens, ban_stop)
        for s in slots.tolist():
            self.outputs[s] = self.outputs.get(s, 0) + 1
        return out

    def remove(self, slot: int) -> None:
        super().remove(slot)
        self.outputs.pop(slot, None)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The tensors here are tiny: intra-op threads only add wake-up latency (badly so on a shared 2-core box).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make(vocab: int, params: list[SP], *, prompts: list[list[int]] | None = None, seeds: list[int | None] | None = None,
         sampler_seed: int = 0, max_slots: int = 8) -> CountingSampler:
    s = CountingSampler(vocab, "cpu", max_slots=max_slots, seed=sampler_seed)
    for i, p in enumerate(params):
        s.add(i, p, (prompts or [[]] * len(params))[i], (seeds or [None] * len(params))[i])
    return s


def draw_many(logits_row: torch.Tensor, params: SP, slots: int, steps: int) -> np.ndarray:
    """Counts of tokens drawn from one fixed logits row by `slots` independent sequences over `steps` steps."""
    s = make(logits_row.numel(), [params] * slots, max_slots=slots)
    batch = logits_row.expand(slots, -1).contiguous()
    counts = np.zeros(logits_row.numel(), np.int64)
    for _ in range(steps):
        out = s.step(batch, np.arange(slots))
        counts += np.bincount(out.token_ids, minlength=logits_row.numel())
    return counts


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a token with zero probability"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


# Chi-square critical values at p = 1e-4 (the tests are deterministic: the sampler is seeded).
CHI2_CRIT = {3: 21.1, 4: 23.5, 5: 25.7, 9: 33.7, 11: 37.3}


# -- greedy and logprobs ---------------------------------------------------------------------------------


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 4
    s = make(300, [SP(temperature=0.0, logprobs=0)] * 6)
    out = s.step(logits, np.arange(6))
    assert np.array_equal(out.token_ids, logits.argmax(-1).numpy())
    ref = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    np.testing.assert_allclose(out.logprobs, ref.numpy(), rtol=0, atol=1e-5)
    assert out.top_ids is None and out.top_logprobs is None


@pytest.mark.parametrize("params", [SP(temperature=0.0), SP(temperature=0.8, top_k=5, presence_penalty=0.5)])
def test_no_logprobs_asked_skips_them_and_keeps_the_tokens(params: SP) -> None:
    torch.manual_seed(7)
    logits = torch.randn(3, 400) * 3
    asked = make(400, [dataclasses.replace(params, logprobs=0)] * 3, prompts=[[1, 2]] * 3, seeds=[5, 6, 7])
    plain = make(400, [params] * 3, prompts=[[1, 2]] * 3, seeds=[5, 6, 7])
    for _ in range(3):
        want, got = asked.step(logits, np.arange(3)), plain.step(logits, np.arange(3))
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        assert np.isnan(got.logprobs).all() and not np.isnan(want.logprobs).any()


def test_a_lone_rows_logprob_has_the_bits_it_has_in_a_batch() -> None:
    # two threads: torch would split a lone row's sum over them (another order than a batch row's sum)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(8)
        logits = torch.randn(3, 1 << 16) * 5
        s = make(1 << 16, [SP(temperature=0.0, logprobs=0)] * 3)
        batch = s.step(logits, np.arange(3)).logprobs
        for i in range(3):
            assert s.step(logits[i:i + 1].contiguous(), np.array([i])).logprobs[0] == batch[i]
    finally:
        torch.set_num_threads(before)


def test_chosen_logprob_is_raw_even_when_processing_changes_the_distribution() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 200) * 3
    params = [SP(temperature=0.5, top_k=10, logprobs=0), SP(temperature=2.0, repetition_penalty=1.7),
              SP(temperature=0, logit_bias={7: 100}), SP(min_p=0.1, presence_penalty=1.0)]
    s = make(200, params, prompts=[[1, 2, 3]] * 4)
    out = s.step(logits, np.arange(4))
    ref = torch.log_softmax(logits, -1)[torch.arange(4), torch.from_numpy(out.token_ids)]
    np.testing.assert_allclose(out.logprobs, ref.numpy(), atol=1e-5)
    assert out.token_ids[2] == 7


def test_top_logprobs_sorted_and_correct_with_k_the_batch_maximum() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 500)
    s = make(500, [SP(temperature=0, logprobs=2), SP(logprobs=5), SP(temperature=0)])
    out = s.step(logits, np.arange(3))
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.shape == (3, 5)
    ref_vals, ref_ids = torch.log_softmax(logits, -1).topk(5, -1)
    np.testing.assert_array_equal(out.top_ids, ref_ids.numpy())
    np.testing.assert_allclose(out.top_logprobs, ref_vals.numpy(), atol=1e-5)
    assert np.all(np.diff(out.top_logprobs, axis=1) <= 0)
    # A vocab that splits into whole blocks takes the block-maxima path; rounded logits make many ties.
    wide = (torch.randn(3, 4096) * 4).round()
    s = make(4096, [SP(logprobs=20), SP(temperature=0), SP(logprobs=3, top_k=7)])
    out = s.step(wide, np.arange(3))
    ref_vals = torch.log_softmax(wide, -1).topk(20, -1).values
    np.testing.assert_allclose(out.top_logprobs, ref_vals.numpy(), atol=1e-5)
    picked = torch.log_softmax(wide, -1).gather(1, torch.from_numpy(out.top_ids))
    np.testing.assert_allclose(picked.numpy(), out.top_logprobs, atol=1e-5)  # ids match their values
    assert all(len(set(row)) == 20 for row in out.top_ids.tolist())
    # logprobs=0 asks only for the chosen token (always returned): no top-N columns.
    s0 = make(500, [SP(logprobs=0)])
    assert s0.step(logits[:1], np.array([0])).top_ids is None


# -- temperature, top-k, top-p, min-p ----------------------------------------------------------------------


def test_tiny_temperature_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    torch.manual_seed(3)
    logits = torch.randn(5, 1000) * 2
    greedy = logits.argmax(-1).numpy()
    for params in (SP(temperature=1e-6), SP(temperature=1.5, top_k=1), SP(temperature=1.5, top_p=1e-6)):
        s = make(1000, [params] * 5, seeds=[10, 11, 12, 13, 14])
        for _ in range(3):
            assert np.array_equal(s.step(logits, np.arange(5)).token_ids, greedy), params


def test_temperature_distribution_matches_softmax_chi_square() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.7])
    T = 0.7
    counts = draw_many(logits, SP(temperature=T), slots=1000, steps=20)
    stat, df = chi_square(counts, torch.softmax(logits / T, -1).double().numpy())
    assert stat < CHI2_CRIT[df], stat
    # ...and the temperature matters: the T=1 distribution is rejected by the same data.
    stat1, _ = chi_square(counts, torch.softmax(logits, -1).double().numpy())
    assert stat1 > 5 * CHI2_CRIT[df]


def ref_top_k_top_p(logits: torch.Tensor, k: int, p: float) -> np.ndarray:
    """vLLM order: top-k, renormalise, keep the smallest prefix reaching mass p, renormalise."""
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(descending=True)
    keep = order[:k] if k > 0 else order
    sub = probs[keep] / probs[keep].sum()
    cum = sub.cumsum(0)
    n = int((cum < p).sum()) + 1
    out = torch.zeros_like(probs)
    out[keep[:n]] = sub[:n] / sub[:n].sum()
    return out.numpy()


@pytest.mark.parametrize(("k", "p"), [(4, 1.0), (-1, 0.8), (6, 0.75)])
def test_top_k_top_p_distribution(k: int, p: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.7, -0.3, 0.9])
    counts = draw_many(logits, SP(top_k=k, top_p=p), slots=800, steps=15)
    stat, df = chi_square(counts, ref_top_k_top_p(logits, k, p))
    assert stat < CHI2_CRIT[df], (stat, counts)


def test_top_p_nucleus_of_thousands_of_tokens() -> None:
    # Nearly flat logits: the 0.9 nucleus has thousands of tokens; none may be cut off and the tail beyond
    # the first few hundred must get its share.
    V = 6000
    logits = torch.linspace(0.0, 0.5, V)
    ref = ref_top_k_top_p(logits, -1, 0.9)
    assert (ref > 0).sum() > 4000
    counts = draw_many(logits, SP(top_p=0.9), slots=250, steps=4)
    assert counts[ref == 0].sum() == 0
    ranks = np.argsort(-ref)
    far = ranks[256: int((ref > 0).sum())]
    assert abs(counts[far].sum() / counts.sum() - ref[far].sum()) < 0.05


def test_top_p_exact_fallback_after_rejections(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows that exhaust the rejection attempts are finished by an exact sort: same distribution.
    monkeypatch.setattr(filters_mod, "MAX_REJECTION_ROUNDS", 0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.7, -0.3, 0.9])
    counts = draw_many(logits, SP(top_p=0.8, min_p=0.2), slots=800, steps=10)
    ref = torch.from_numpy(ref_top_k_top_p(logits, -1, 0.8))
    ref[ref < 0.2 * ref.max()] = 0
    stat, df = chi_square(counts, (ref / ref.sum()).numpy())
    assert stat < CHI2_CRIT[df], (stat, counts)


def test_top_k_keeps_every_token_tied_at_the_boundary() -> None:
    # Ties straddle the first candidate window (k + 1 values): the sampler must widen it, and keeps all ties
    # (vLLM keeps exactly k, picking arbitrarily among ties; keeping them all makes the set well defined).
    logits = torch.zeros(40)
    logits[0], logits[1:6] = 3.0, 2.0
    counts = draw_many(logits, SP(top_k=2), slots=300, steps=4)
    assert counts[6:].sum() == 0 and counts[:6].min() > 0


@pytest.mark.parametrize("V", [2048, 3001])  # one a multiple of the inverse-CDF block, one padded
def test_inverse_cdf_over_a_wide_vocab(V: int) -> None:
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(V, generator=gen) * 1.5
    counts = draw_many(logits, SP(), slots=1000, steps=12)
    probs = torch.softmax(logits.double(), -1).numpy()
    # Group tokens into 10 id ranges (checks the block level) and 10 probability deciles (the inner level).
    for groups in (np.arange(V) * 10 // V, np.argsort(np.argsort(probs)) * 10 // V):
        c = np.bincount(groups, weights=counts, minlength=10)
        p = np.bincount(groups, weights=probs, minlength=10)
        stat, df = chi_square(c, p)
        assert stat < CHI2_CRIT[df], (stat, c)


def test_min_p_filters_relative_to_the_top_token() -> None:
    logits = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.09, 0.06, 0.05]))
    counts = draw_many(logits, SP(min_p=0.2), slots=600, steps=10)  # keeps p >= 0.08
    ref = torch.softmax(logits.double(), -1)
    ref[ref < 0.2 * ref.max()] = 0
    stat, df = chi_square(counts, (ref / ref.sum()).numpy())
    assert counts[4:].sum() == 0 and stat < CHI2_CRIT[df]


def test_min_p_is_applied_after_temperature_and_with_top_k() -> None:
    logits = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.09, 0.06, 0.05]))
    # T=0.5 squares the ratios: 0.09/0.40 -> 0.05 < 0.1, so token 3 is cut although 0.09/0.40 > 0.1.
    counts = draw_many(logits, SP(temperature=0.5, min_p=0.1, top_k=5), slots=400, steps=5)
    assert counts[3:].sum() == 0 and counts[:3].min() > 0


# -- penalties, bias, min_tokens -----------------------------------------------------------------------------


def ref_penalize(logits: torch.Tensor, prompt: list[int], outputs: list[int], p: SP) -> torch.Tensor:
    """Straight from vLLM's definition, one token at a time."""
    out = logits.clone()
    seen = set(prompt) | set(outputs)
    for t in range(out.numel()):
        if t in seen:
            x = out[t].item()
            out[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = outputs.count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return out


@pytest.mark.parametrize("params", [
    SP(temperature=0, repetition_penalty=1.4),
    SP(temperature=0, repetition_penalty=0.7),
    SP(temperature=0, presence_penalty=0.8),
    SP(temperature=0, frequency_penalty=0.5),
    SP(temperature=0, frequency_penalty=-0.3, presence_penalty=0.6, repetition_penalty=1.2),
])
def test_penalties_match_reference_over_many_steps(params: SP) -> None:
    V, S, steps = 40, 6, 25
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (0, 3, 8, 1, 15, 5)]
    # Rows 0/2 have no penalties: they share the batch with penalised rows and must stay plain greedy.
    plist = [params if i % 2 else SP(temperature=0) for i in range(S)]
    s = make(V, plist, prompts=prompts)
    outputs: list[list[int]] = [[] for _ in range(S)]
    changed = 0
    for _ in range(steps):
        logits = torch.randn(S, V, generator=gen)
        got = s.step(logits, np.arange(S)).token_ids
        for i in range(S):
            ref = ref_penalize(logits[i], prompts[i], outputs[i], plist[i]) if i % 2 else logits[i]
            assert got[i] == int(ref.argmax()), (i, outputs[i])
            changed += int(got[i] != int(logits[i].argmax()))
            outputs[i].append(int(got[i]))
    assert changed > 5  # the case is constructed so the penalty really moves the argmax


def test_each_penalty_flips_a_constructed_argmax() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]] * 4)
    # repetition: token 0 is in the prompt -> 3.0 / 1.1 < 2.9
    s = make(4, [SP(temperature=0, repetition_penalty=1.1)], prompts=[[0]])
    assert s.step(logits[:1], np.array([0])).token_ids[0] == 1
    # presence/frequency count outputs only: a prompt token is not penalised by them.
    s = make(4, [SP(temperature=0, presence_penalty=0.5)], prompts=[[0]])
    assert s.step(logits[:1], np.array([0])).token_ids[0] == 0  # token 0 now generated once
    assert s.step(logits[:1], np.array([0])).token_ids[0] == 1
    s = make(4, [SP(temperature=0, frequency_penalty=0.06)])
    toks = [int(s.step(logits[:1], np.array([0])).token_ids[0]) for _ in range(4)]
    assert toks == [0, 0, 1, 0]  # 3.0-0.06 > 2.9; 3.0-0.12 < 2.9; 2.9-0.06 < 2.88
    # repetition penalty on a negative logit multiplies (pushes further down).
    neg = torch.tensor([[-1.0, -1.1, -5.0, -6.0]])
    s = make(4, [SP(temperature=0, repetition_penalty=1.2)], prompts=[[0]])
    assert s.step(neg, np.array([0])).token_ids[0] == 1


def test_logit_bias_forces_and_bans_tokens_per_row() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 100)
    low = int(logits[0].argmin())
    top1 = int(logits[1].argmax())
    s = make(100, [SP(logit_bias={low: 100.0}), SP(temperature=0, logit_bias={top1: -100.0}), SP(temperature=0)])
    for _ in range(5):
        out = s.step(logits, np.arange(3)).token_ids
        assert out[0] == low
        assert out[1] == int(logits[1].topk(2).indices[1])
        assert out[2] == int(logits[2].argmax())


def test_logit_bias_rows_added_later_with_wider_tables_keep_earlier_rows_intact() -> None:
    logits = torch.zeros(2, 50)
    logits[:, 0] = 5.0
    s = CountingSampler(50, "cpu", max_slots=2, seed=0)
    s.add(0, SP(temperature=0, logit_bias={3: 10.0}), [])
    s.add(1, SP(temperature=0, logit_bias={i: -1.0 for i in range(10, 30)} | {0: -20.0}), [])
    assert s.step(logits, np.array([0, 1])).token_ids.tolist() == [3, 1]
    with pytest.raises(ValueError, match="logit_bias"):
        s.add(2, SP(logit_bias={50: 1.0}), [])


def test_banned_rows_mask_exactly_their_stop_token_ids() -> None:
    # The core decides which rows are banned (min_tokens not reached) and which ids stop each sequence
    # (EOS left out under ignore_eos); the sampler masks those ids on those rows, whatever the row's company.
    V = 20
    logits = torch.full((4, V), -5.0)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 11] = 8.0
    s = CountingSampler(V, "cpu", max_slots=8, seed=0)
    s.add(0, SP(temperature=0, min_tokens=3, stop_token_ids=[7]), [], stop_token_ids=[EOS, 7])
    s.add(1, SP(temperature=0), [], stop_token_ids=[EOS])
    s.add(2, SP(temperature=0, min_tokens=2, ignore_eos=True), [], stop_token_ids=[])
    s.add(3, SP(temperature=0.5, min_tokens=2), [], stop_token_ids=[EOS, 7, 11])
    seen = []
    for step in range(4):
        ban = np.array([step < 3, False, step < 2, step < 2])
        seen.append(s.step(logits, np.arange(4), ban).token_ids.tolist())
    assert [row[0] for row in seen] == [11, 11, 11, EOS]
    assert [row[1] for row in seen] == [EOS] * 4
    assert [row[2] for row in seen] == [EOS] * 4  # ignore_eos: EOS is not a stop, so not masked
    assert all(row[3] not in (EOS, 7, 11) for row in seen[:2]) and seen[2][3] == EOS
    # Without a ban every row is left alone (no hidden counter of the sampler's own).
    assert s.step(logits, np.arange(4)).token_ids.tolist()[:3] == [EOS] * 3


# -- seeds, slots, n > 1 -------------------------------------------------------------------------------------


def run_seeded(slot: int, others: int, position: int, params: SP, seed: int, logits_seq: list[torch.Tensor],
               prompt: list[int]) -> list[int]:
    """Sample `params` with `seed` in `slot`, sharing every step with `others` unrelated random rows."""
    s = CountingSampler(logits_seq[0].numel(), "cpu", max_slots=4, seed=99 + others)
    s.add(slot, params, prompt, seed)
    other_slots = [i for i in range(slot + others + 1) if i != slot][:others]
    for j, o in enumerate(other_slots):
        s.add(o, SP(temperature=0.9, top_p=0.95 if j % 2 else 1.0, presence_penalty=0.3 * (j % 5)), [1, 2])
    slots = list(other_slots)
    slots.insert(position, slot)
    gen = torch.Generator().manual_seed(others)
    toks = []
    for row in logits_seq:
        batch = torch.randn(len(slots), row.numel(), generator=gen)
        batch[position] = row
        toks.append(int(s.step(batch, np.array(slots)).token_ids[position]))
    return toks


@pytest.mark.parametrize("params", [SP(temperature=1.0), SP(temperature=0.8, top_p=0.9, top_k=50),
                                    SP(temperature=0.7, top_p=0.8),
                                    SP(temperature=1.2, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.2)])
def test_seeded_output_independent_of_batch_company_and_position(params: SP) -> None:
    gen = torch.Generator().manual_seed(6)
    seq = [torch.randn(500, generator=gen) * 2 for _ in range(12)]
    alone = run_seeded(0, 0, 0, params, 1234, seq, [5, 6])
    assert run_seeded(3, 5, 2, params, 1234, seq, [5, 6]) == alone
    assert run_seeded(9, 12, 12, params, 1234, seq, [5, 6]) == alone  # slot beyond max_slots: grows
    assert run_seeded(0, 0, 0, params, 4321, seq, [5, 6]) != alone


def test_unseeded_requests_reproducible_from_sampler_seed() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = [torch.randn(4, 300, generator=gen) for _ in range(5)]

    def run(sampler_seed: int) -> list[list[int]]:
        s = make(300, [SP()] * 4, sampler_seed=sampler_seed)
        return [s.step(x, np.arange(4)).token_ids.tolist() for x in logits]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_n_sequences_share_prompt_stats_but_draw_independently() -> None:
    # An n > 1 request adds one slot per sequence, seeded seed + index.
    V = 300
    s = make(V, [SP(temperature=0.05, repetition_penalty=2.0)] * 4, prompts=[[3]] * 4, seeds=[101, 102, 103, 104])
    logits = torch.zeros(V)
    logits[3], logits[4] = 5.0, 4.0  # token 3 is in the prompt: 5 / 2 < 4 for every sequence
    assert s.step(logits.expand(4, -1), np.arange(4)).token_ids.tolist() == [4, 4, 4, 4]

    gen = torch.Generator().manual_seed(8)
    params = SP(temperature=1.0, repetition_penalty=2.0)
    s = make(V, [params] * 4, prompts=[[3]] * 4, seeds=[101, 102, 103, 104])
    logits = [torch.randn(V, generator=gen) for _ in range(6)]
    outs = [s.step(x.expand(4, -1), np.arange(4)).token_ids.tolist() for x in logits]
    assert len({tuple(col) for col in zip(*outs)}) == 4  # four different streams
    # A sequence's stream is its seed's, wherever its slot.
    t = CountingSampler(V, "cpu", max_slots=4, seed=0)
    t.add(2, params, [3], 103)
    assert [t.step(x[None], np.array([2])).token_ids[0] for x in logits] == [row[2] for row in outs]


def test_removed_slot_is_reset_before_reuse() -> None:
    V = 10
    logits = torch.tensor([[1.0, 0.9] + [0.0] * 8])
    s = CountingSampler(V, "cpu", max_slots=2, seed=0)
    s.add(0, SP(temperature=0, presence_penalty=2.0), [])
    assert s.step(logits, np.array([0])).token_ids[0] == 0
    assert s.step(logits, np.array([0])).token_ids[0] == 1
    s.remove(0)
    s.add(0, SP(temperature=0, presence_penalty=2.0), [])  # no leftover counts from before
    assert s.step(logits, np.array([0])).token_ids[0] == 0
    with pytest.raises(ValueError, match="in use"):
        s.add(0, SP(), [])


def test_the_random_stream_is_keyed_by_the_output_position() -> None:
    # The core hands each row its sequence's output count: a sequence recomputed after preemption, or sampled in
    # another step order, draws at position k what it draws at position k anywhere else.
    V = 200
    gen = torch.Generator().manual_seed(9)
    logits = [torch.randn(1, V, generator=gen) for _ in range(8)]
    params = SP(temperature=1.0, top_p=0.9)
    a = Sampler(V, "cpu", max_slots=8, seed=0)
    a.add(0, params, [1], 77)
    straight = [int(a.sample(x, np.array([0]), np.array([k])).token_ids[0]) for k, x in enumerate(logits)]
    assert len(set(straight)) > 3
    b = Sampler(V, "cpu", max_slots=8, seed=0)
    b.add(5, params, [1], 77)
    backwards = [int(b.sample(logits[k], np.array([5]), np.array([k])).token_ids[0]) for k in reversed(range(8))]
    assert backwards[::-1] == straight
    # The same logits at another position draw differently (the stream moves on).
    again = [int(b.sample(logits[0], np.array([5]), np.array([k])).token_ids[0]) for k in range(1, 8)]
    assert again != [straight[0]] * 7


def test_mixed_batch_greedy_rows_unaffected_by_random_rows() -> None:
    torch.manual_seed(10)
    logits = torch.randn(8, 1000)
    params = [SP(temperature=0) if i % 2 == 0 else SP(temperature=1.0, top_p=0.5, frequency_penalty=1.0)
              for i in range(8)]
    s = make(1000, params)
    out = s.step(logits, np.arange(8)).token_ids
    assert np.array_equal(out[::2], logits[::2].argmax(-1).numpy())


def test_bf16_logits_and_empty_batch() -> None:
    s = make(64, [SP(temperature=0)])
    logits = torch.randn(1, 64).to(torch.bfloat16)
    assert s.step(logits, np.array([0])).token_ids[0] == int(logits.float().argmax())
    assert s.step(torch.zeros(0, 64), np.zeros(0, np.int64)).token_ids.shape == (0,)


def test_sample_checks_its_per_row_arrays() -> None:
    s = make(8, [SP(temperature=0)])
    x = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="output_lens"):
        s.sample(x, np.array([0]), np.array([0, 1]))
    with pytest.raises(ValueError, match="ban_stop"):
        s.sample(x, np.array([0]), np.array([0]), np.array([True, False]))


def test_greedy_row_max_is_torchs_first_maximal_index_ties_and_nan_included() -> None:
    from ironlm.sampler.sampler import _row_max

    torch.manual_seed(9)
    logits = torch.randn(4, 1000)
    logits[1, [17, 400]] = 50.0  # a tie: the first index wins
    logits[2, [3, 900]] = float("nan")  # NaN counts as the maximum, first one
    logits[3] = float("-inf")
    values, indices = _row_max(logits)
    want_values, want_indices = logits.max(dim=-1)
    assert torch.equal(indices, want_indices) and indices.tolist()[:3] == [int(logits[0].argmax()), 17, 3]
    torch.testing.assert_close(values, want_values, equal_nan=True)
