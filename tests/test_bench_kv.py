"""The KV hierarchy benchmarks: the multiturn dataset, `--dataset multiturn --compare-tier`, `bench restart` and the
KV waste line of the throughput bench, end to end on a tiny random model (seconds; no timing assertions)."""

from __future__ import annotations

import json

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


# ---- the benches, end to end on a tiny model --------------------------------------------------
# A pool of 24 blocks of 4 (96 tokens) under conversations whose working set is ~4x that.
TINY_KV = ["--device", "cpu", "--dtype", "float32", "--block-size", "4", "--max-model-len", "96"]
TINY_MULTITURN = ["--num-conversations", "10", "--turns", "4", "5", "--system-len", "16", "--user-len", "4", "8",
                  "--reply-len", "4"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("bench_kv"), arch="llama"))


def test_multiturn_compare_tier_end_to_end(tiny_model, tmp_path, capsys):
    from ironlm.bench.cli import main

    out = tmp_path / "mt.json"
    rc = main(["throughput", tiny_model, "--dataset", "multiturn", *TINY_MULTITURN, "--compare-tier", *TINY_KV,
               "--num-kv-blocks", "24", "--no-progress", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    off, on = report["results"]
    assert (off["label"], off["tier"], on["label"], on["tier"]) == ("no tier", False, "tier", True)
    assert on["tier_args"]["kv_offload_dir"] and on["tier_args"]["kv_offload_size"] > 0  # sized automatically
    ds = report["dataset"]
    assert off["working_set_ratio"] == ds["working_set_tokens"] / 96 >= 4
    for r in (off, on):
        assert r["turns"] == ds["num_requests"] and r["turns_short"] == 0
        assert r["prefill_tokens"] <= ds["prompt_tokens"] + r["counters"]["num_preemptions"] * 96
        assert 0 <= r["kv_waste"] < 0.5 and r["steps"]["kv_slots_allocated"] > 0
        assert r["steps"]["decode_only_steps"] > 0 and r["steps"]["prefill_steps_s"] > 0
    # the histories no longer fit: without a tier most are recomputed, with one they come back from it
    assert off["counters"]["prefix_hits_tier"] == 0 and off["counters"]["kv_promotions"] == 0
    assert on["counters"]["prefix_hits_tier"] > 0 and on["counters"]["kv_promotions"] > 0
    assert on["counters"]["kv_demotions"] > 0 and on["prefix_hit_rate"] > off["prefix_hit_rate"]
    assert on["prefill_tokens"] < off["prefill_tokens"]
    cmp = report["tier_comparison"]
    assert cmp["prefill_tokens_ratio"] == pytest.approx(off["prefill_tokens"] / on["prefill_tokens"])
    assert cmp["same_replies"]  # greedy, fp32: promoted KV gives the replies recomputed KV gives
    text = capsys.readouterr().out
    assert "without / with tier: prefill tokens" in text and "working set" in text


def test_multiturn_refuses_a_conversation_longer_than_the_context(tiny_model):
    from ironlm.bench import multiturn as mt

    spec = MultiturnSpec(num_conversations=2, turns=(8, 8), system_len=16, user_len=(8, 8), reply_len=4)
    with pytest.raises(ValueError, match="max_model_len"):
        mt.run(mt.MultiturnConfig(model=tiny_model, spec=spec, progress=False,
                                  engine_args={"device": "cpu", "dtype": "float32", "num_kv_blocks": 64,
                                               "block_size": 4, "max_model_len": 96}))


def test_restart_bench_end_to_end(tiny_model, tmp_path, capsys):
    from ironlm.bench.cli import main

    out = tmp_path / "restart.json"
    rc = main(["restart", tiny_model, "--prompt-len", "64", "--suffix-len", "4", "--repeats", "2", *TINY_KV,
               "--num-kv-blocks", "64", "--kv-offload-dir", str(tmp_path), "--no-progress", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["engine_a"]["cached_tokens"] == 0
    assert len(report["with_tier"]) == len(report["without_tier"]) == 2
    for b in report["with_tier"]:  # the 2nd restart too: the 1st one's promoted blocks went back to the tier
        assert b["cached_tokens"] == b["prefix_hits_tier"] == 64 and b["kv_promotions"] == 16  # all 16, from disk
    for c in report["without_tier"]:
        assert c["cached_tokens"] == 0 and c["prefix_hits_tier"] == 0
    assert report["ttft_ratio"] == pytest.approx(report["ttft_without_tier_s"] / report["ttft_with_tier_s"])
    assert list(tmp_path.iterdir()) == [out]  # the fresh tier folder made inside the one given is gone
    assert "TTFT without / with the disk tier" in capsys.readouterr().out


def test_throughput_bench_reports_kv_waste(tiny_model, capsys):
    from ironlm.bench.cli import main

    rc = main(["throughput", tiny_model, "--num-requests", "6", "--input-len", "5", "30", "--output-len", "3", "9",
               *TINY_KV, "--num-kv-blocks", "256", "--warmup", "none", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("KV waste"))
    waste = float(line.split(": ")[1].split("%")[0])
    # block 4: a sequence wastes at most 3 slots, prompts of 5+ tokens, so < 3/8 of the slots any step
    assert 0 < waste < 37.5
