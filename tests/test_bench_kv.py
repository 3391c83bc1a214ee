"""The KV hierarchy benchmarks: the multiturn dataset, `--dataset multiturn --compare-tier`, `bench restart` and the
KV waste line of the throughput bench, end to end on a tiny random model (seconds; no timing assertions)."""

from __future__ import annotations

import pytest

from ironlm.bench.datasets import MultiturnSpec, multiturn_dataset, token_floor

VOCAB = 1000


# ---- the multiturn dataset --------------------------------------------------------------------
def _replay(ds, reply_of):
    """Every turn's prompt, built the way the bench builds them, with `reply_of(i, k)` as turn k's reply."""
    prompts = {}
    for i, conv in enumerate(ds.conversations):
        history: list[int] = []
        for k in range(conv.num_turns):
            prompt = ds.prompt(history, i, k)
            prompts[i, k] = prompt
            history = prompt + reply_of(i, k)
    return prompts


def test_multiturn_turns_carry_the_whole_history():
    spec = MultiturnSpec(num_conversations=6, turns=(4, 8), system_len=20, user_len=(3, 9), reply_len=5, seed=3)
    ds = multiturn_dataset(spec, VOCAB)
    low = token_floor(VOCAB)
    assert len(ds.conversations) == 6 and len(ds.system_prompt) == 20
    prompts = _replay(ds, lambda i, k: [i, k, 7, 7, 7])  # replies below the floor: told apart from prompt tokens
    for i, conv in enumerate(ds.conversations):
        assert 4 <= conv.num_turns <= 8
        for k in range(conv.num_turns):
            p = prompts[i, k]
            user = list(conv.user_turns[k])
            assert 3 <= len(user) <= 9 and all(low <= t < VOCAB for t in user)
            assert p[:20] == ds.system_prompt and p[-len(user):] == user
            assert len(p) == ds.prompt_len(i, k)
            if k:  # the previous prompt, then exactly the reply it got, then the new user message
                prev = prompts[i, k - 1]
                assert p[:len(prev)] == prev and p[len(prev):len(prev) + 5] == [i, k - 1, 7, 7, 7]
    assert ds.num_requests == len(prompts) and ds.prompt_tokens == sum(map(len, prompts.values()))
    assert ds.output_tokens == 5 * ds.num_requests
    assert ds.summary()["working_set_tokens"] == ds.working_set_tokens()


def test_multiturn_working_set_by_hand():
    # 2 conversations of 3 turns, system 10, user 4, reply 3.
    spec = MultiturnSpec(num_conversations=2, turns=(3, 3), system_len=10, user_len=(4, 4), reply_len=3)
    ds = multiturn_dataset(spec, VOCAB)
    # each history after its 3rd turn: 10 + 3 * (4 + 3) = 31 tokens, 21 of them its own
    assert ds.working_set_tokens() == 10 + 2 * 21
    spec = MultiturnSpec(num_conversations=12, turns=(1, 4), system_len=10, user_len=(4, 4), reply_len=3, seed=5)
    ds = multiturn_dataset(spec, VOCAB)
    turns = [c.num_turns for c in ds.conversations]
    assert len(set(turns)) > 1  # the peak is not simply the last round's
    # round k: every conversation with a turn k holds 7 * (k + 1) tokens of its own
    rounds = [10 + sum(7 * (k + 1) for n in turns if n > k) for k in range(max(turns))]
    assert ds.working_set_tokens() == max(rounds)


def test_multiturn_is_seeded():
    spec = MultiturnSpec(num_conversations=5, turns=(2, 6), system_len=16, user_len=(2, 12), reply_len=4, seed=1)
    a, b = multiturn_dataset(spec, VOCAB), multiturn_dataset(spec, VOCAB)
    assert a.system_prompt == b.system_prompt and a.conversations == b.conversations
    c = multiturn_dataset(MultiturnSpec(5, (2, 6), 16, (2, 12), 4, seed=2), VOCAB)
    assert c.system_prompt != a.system_prompt and c.conversations != a.conversations


@pytest.mark.parametrize("bad, param", [
    ({"num_conversations": 0}, "num_conversations"), ({"turns": (3, 2)}, "turns"),
    ({"system_len": 0}, "system_len"), ({"user_len": (0, 4)}, "user_len"), ({"reply_len": 0}, "reply_len")])
def test_multiturn_rejects_bad_parameters(bad, param):
    with pytest.raises(ValueError, match=param):
        multiturn_dataset(MultiturnSpec(**bad), VOCAB)
