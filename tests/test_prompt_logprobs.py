"""Prompt logprobs against transformers: SamplingParams.prompt_logprobs offline, and over HTTP `prompt_logprobs`
and legacy completions' echo + logprobs (+ max_tokens 0) through the real openai client.

The oracle is transformers' log_softmax of the full-sequence logits (fp32, CPU): every prompt position after the
first must agree within 1e-5 — across a chunked prefill (a 16-token step budget), after a prefix-cache hit of
another request, and batched with requests that do not ask for them (whose outputs must not change).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from ironlm import LLM, EngineConfig, LLMEngine, SamplingParams
from ironlm.engine.outputs import PromptLogprobs
from ironlm.exceptions import InvalidArgumentError
from ironlm.server.api import build_app
from server_utils import TINY_ENGINE_KW, AsyncLLMEngine, LiveServer, tiny_model_path

ATOL = 1e-5
TOP = 3
CHUNK = 16  # max_num_batched_tokens: every prompt below is prefilled over several steps
TEXT = "hello world, the model is a token of the world and the model is the world of tokens " * 2


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def hf(path: Any) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=256,
               max_num_seqs=4, max_num_batched_tokens=CHUNK)


def reference(hf: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p - 1 is the distribution transformers gives prompt token p."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def check(plp: PromptLogprobs | None, ids: list[int], ref: torch.Tensor, k: int = TOP) -> float:
    """Every entry against the reference (the token's logprob and rank, the top-k's ids, values and ranks);
    returns the largest difference."""
    assert plp is not None and len(plp) == len(ids)
    assert plp[0] is None
    worst = 0.0
    for p in range(1, len(ids)):
        entry, row, tid = plp[p], ref[p - 1], ids[p]
        assert entry is not None
        worst = max(worst, abs(entry[tid].logprob - float(row[tid])))
        assert entry[tid].rank == int((row > row[tid]).sum()) + 1
        top = row.topk(k)
        assert set(entry) == {tid, *top.indices.tolist()}
        for rank, (value, alt) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            worst = max(worst, abs(entry[alt].logprob - value))
            if alt != tid:
                assert entry[alt].rank == rank
    assert worst <= ATOL
    return worst


def test_offline_chunked_matches_transformers(llm: LLM, hf: Any):
    out = llm.generate([TEXT], SamplingParams(prompt_logprobs=TOP, max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 3 * CHUNK  # the prompt took several prefill steps
    check(out.prompt_logprobs, out.prompt_token_ids, reference(hf, out.prompt_token_ids))


def test_offline_prefix_cache_hit_still_yields_them(llm: LLM, hf: Any):
    """A cached prefix (left by a plain request) is recomputed for a request that asks for prompt logprobs; the
    cache itself still serves the plain requests."""
    prefix = "the world of the model and the token " * 3
    plain = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prefix], plain, use_tqdm=False)
    again = llm.generate([prefix + "is hello"], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16  # the prefix is in the cache
    out = llm.generate([prefix + "is hello"], SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    ids = out.prompt_token_ids
    check(out.prompt_logprobs, ids, reference(hf, ids), k=0)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


def test_offline_batched_with_plain_requests_and_n(llm: LLM, hf: Any):
    """Several prompts in one batch, n = 2, k varying per request: each gets its own; plain neighbours get none
    and the same tokens as alone."""
    texts = [TEXT[:60], "hello", TEXT[:100] + "token", "a"]
    alone = llm.generate(texts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    params = [SamplingParams(prompt_logprobs=5, max_tokens=4, temperature=0, n=2),
              SamplingParams(max_tokens=4, temperature=0),
              SamplingParams(prompt_logprobs=1, max_tokens=4, temperature=0, logprobs=2),
              SamplingParams(prompt_logprobs=2, max_tokens=4, temperature=0)]
    outs = llm.generate(texts, params, use_tqdm=False)
    for out, ref, p in zip(outs, alone, params):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        elif len(out.prompt_token_ids) == 1:
            assert out.prompt_logprobs == [None]
        else:
            check(out.prompt_logprobs, out.prompt_token_ids, reference(hf, out.prompt_token_ids), p.prompt_logprobs)
    first, second = outs[0].outputs  # greedy: n = 2 gives the same tokens twice
    assert first.token_ids == second.token_ids


def test_offline_preempted_requests_keep_them(path: Any, hf: Any):
    """Four requests over a KV pool too small for all of them: the engine preempts (recompute) and re-runs one,
    which must neither lose nor duplicate its prompt's entries."""
    small = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=128,
                max_num_seqs=4, max_num_batched_tokens=CHUNK)
    try:
        texts = [f"hello world, the model is a token of the world {i}{i}{i}" for i in range(4)]
        outs = small.generate(texts, SamplingParams(prompt_logprobs=1, max_tokens=30, temperature=0, ignore_eos=True),
                              use_tqdm=False)
        assert small.engine.stats()["num_preemptions"] >= 1
        for out in outs:
            check(out.prompt_logprobs, out.prompt_token_ids, reference(hf, out.prompt_token_ids), k=1)
    finally:
        small.shutdown()


def test_validation():
    for bad in (-1, 21, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError) as info:
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
        assert info.value.param == "prompt_logprobs"
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0


# ---- over HTTP ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(path: Any) -> Any:
    kw: dict[str, Any] = {**TINY_ENGINE_KW, "max_num_batched_tokens": CHUNK, "max_num_seqs": 8}
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", **kw)))
    live = LiveServer(build_app(engine, served_model_name="tiny"), engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_http_echo_logprobs_max_tokens_0(client: openai.OpenAI, hf: Any, llm: LLM):
    """lm-evaluation-harness's loglikelihood request: the prompt alone comes back, scored."""
    resp = client.completions.create(model="tiny", prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    (choice,) = resp.choices
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 0
    ids = llm.get_tokenizer().encode(TEXT)
    assert resp.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset is not None
    # Offsets index the echoed text: the BOS (not in the text) at 0, every other token where its text starts.
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    pieces = [TEXT[a:b] for a, b in zip(lp.text_offset[1:], lp.text_offset[2:] + [len(TEXT)])]
    assert "".join(pieces) == TEXT and pieces == lp.tokens[1:]
    ref = reference(hf, ids)
    tok = llm.get_tokenizer()
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - float(ref[p - 1, ids[p]])) <= ATOL
        top = lp.top_logprobs[p]
        # The token and the top 2, keyed by text: of tokens that decode alike the likelier one stays.
        want: dict[str, float] = {}
        for t in sorted({ids[p], *ref[p - 1].topk(2).indices.tolist()}, key=lambda t: -float(ref[p - 1, t])):
            want.setdefault(tok.decode([t]), float(ref[p - 1, t]))
        assert top is not None and top.keys() == want.keys()
        assert all(abs(top[s] - v) <= ATOL for s, v in want.items())


def test_http_echo_then_generated(client: openai.OpenAI, llm: LLM):
    """echo + logprobs with tokens to generate: the prompt's entries, then the generated ones (as without echo)."""
    kw: dict[str, Any] = {"model": "tiny", "prompt": "hello world", "logprobs": 1, "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(echo=True, **kw).choices[0]
    assert echoed.text == "hello world" + plain.text
    n = len(llm.get_tokenizer().encode("hello world"))
    assert plain.logprobs is not None and echoed.logprobs is not None
    assert echoed.logprobs.token_logprobs is not None and echoed.logprobs.tokens is not None
    # Equal up to float noise: the echoed prompt was recomputed and its LM head ran over more rows.
    assert echoed.logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=ATOL)
    assert echoed.logprobs.tokens[n:] == plain.logprobs.tokens
    assert echoed.logprobs.text_offset is not None and plain.logprobs.text_offset is not None
    assert echoed.logprobs.text_offset[n:] == [o + len("hello world") for o in plain.logprobs.text_offset]
    assert echoed.logprobs.text_offset == sorted(echoed.logprobs.text_offset)
    stream = client.completions.create(echo=True, stream=True, **kw)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == echoed.text
    streamed = [x for c in chunks if c.logprobs is not None for x in c.logprobs.token_logprobs or []]
    assert streamed == echoed.logprobs.token_logprobs


def test_http_prompt_logprobs_extension(client: openai.OpenAI, hf: Any, llm: LLM, server: LiveServer):
    """vLLM's `prompt_logprobs` extra field: on the completion choice, on the chat response."""
    resp = client.completions.create(model="tiny", prompt=TEXT[:80], max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    ids = llm.get_tokenizer().encode(TEXT[:80])
    wire = resp.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert wire[0] is None and len(wire) == len(ids)
    ref = reference(hf, ids)
    for p in range(1, len(ids)):
        entry = wire[p]
        assert abs(entry[str(ids[p])]["logprob"] - float(ref[p - 1, ids[p]])) <= ATOL
        assert {int(t) for t, e in entry.items() if e["rank"] <= 2} >= set(ref[p - 1].topk(2).indices.tolist())
    stream = client.completions.create(model="tiny", prompt=TEXT[:80], max_tokens=2, temperature=0, stream=True,
                                       extra_body={"prompt_logprobs": 2})
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]  # type: ignore[union-attr]
    assert firsts[0] == wire and all(f is None for f in firsts[1:])
    chat = httpx.post(f"{server.base_url}/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    ids = llm.engine.apply_chat_template([{"role": "user", "content": "hello"}])
    assert len(body["prompt_logprobs"]) == len(ids) and body["prompt_logprobs"][0] is None
    check_ids = reference(hf, ids)
    for p in range(1, len(ids)):
        assert abs(body["prompt_logprobs"][p][str(ids[p])]["logprob"] - float(check_ids[p - 1, ids[p]])) <= ATOL


def test_http_errors(server: LiveServer):
    url = f"{server.base_url}/completions"
    cases = [({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
             ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
             ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
             ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens")]
    for body, param in cases:
        r = httpx.post(url, json={"model": "tiny", **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.json()
    chat = httpx.post(f"{server.base_url}/chat/completions",
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"


def test_http_budget_counts_prompt_logprobs(path: Any):
    """--max-request-logprobs counts the prompt's entries: 20 prompt tokens × 5 is over a budget of 50."""
    from ironlm.config import ServerConfig

    kw: dict[str, Any] = dict(TINY_ENGINE_KW)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", **kw)))
    live = LiveServer(build_app(engine, served_model_name="tiny", config=ServerConfig(max_request_logprobs=50)),
                      engine)
    try:
        prompt = list(range(10, 30))
        url = f"{live.base_url}/completions"
        r = httpx.post(url, json={"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        r = httpx.post(url, json={"prompt": prompt, "prompt_logprobs": 5, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        r = httpx.post(url, json={"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 20
    finally:
        live.stop()


def test_http_timeout_keeps_prompt_logprobs(tmp_path_factory: pytest.TempPathFactory):
    """A request cut by its `timeout` mid-generation still answers with the prompt's logprobs (echo)."""
    from server_utils import RealServer

    served = RealServer(tmp_path_factory)
    try:
        served.faults.delay = 0.05
        r = httpx.post(f"{served.base_url}/completions", json={
            "prompt": "hello world", "echo": True, "logprobs": 0, "max_tokens": 200, "ignore_eos": True,
            "timeout": 1.0}, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "timeout"
        n = r.json()["usage"]["prompt_tokens"]
        lps = choice["logprobs"]["token_logprobs"]
        assert lps[0] is None and all(isinstance(x, float) for x in lps[1:n])
    finally:
        served.faults.delay = 0.0
        served.stop()
