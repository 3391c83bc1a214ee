"""Beam search (engine/beam_search.py) against transformers' `generate(num_beams=k)` as the oracle, offline and over
HTTP (`use_beam_search`), and the prefix-cache sharing that makes each beam step cheap.

The tiny random model's EOS is token 333 (plus </s>): a token the beams of PROMPT reach after two or three steps
with seed-0 weights, so EOS-finished beams compete with length-capped ones (the tests assert both occur).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from ironlm import LLM
from ironlm.exceptions import InvalidArgumentError
from ironlm.sampling_params import BeamSearchParams  # where vLLM has it
from ironlm.server.api import build_app
from server_utils import TINY_ENGINE_KW, AsyncLLMEngine, LiveServer, tiny_model_path, wait_for
from tiny_models import EOS_ID, load_hf_reference

EOS = 333
PROMPT = [5, 40, 77, 100, 12, 9, 33, 250, 61, 18, 90, 7, 120, 44, 3, 66, 81, 200]
OTHER = [9, 14, 201, 88, 17, 3, 99, 144, 60, 21]


@pytest.fixture(scope="module")
def path(tmp_path_factory: Any) -> Path:
    """The shared tiny llama (seed 0) with EOS 333 added: a copy, so building the weights is not paid twice."""
    out = tmp_path_factory.mktemp("beam") / "tiny"
    shutil.copytree(tiny_model_path(tmp_path_factory), out)
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS, EOS_ID]
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


@pytest.fixture(scope="module")
def hf(path: Any) -> Any:
    return load_hf_reference(path)


@pytest.fixture(scope="module")
def llm(path: Any) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=4)


def hf_beams(hf: Any, prompt: list[int], k: int, max_new: int, length_penalty: float,
             early_stopping: bool | str, n: int | None = None) -> list[tuple[list[int], float]]:
    """transformers' n best (generated tokens, score) of beam width k."""
    n = n or k
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=n, do_sample=False,
                          max_new_tokens=max_new, length_penalty=length_penalty, early_stopping=early_stopping,
                          output_scores=True, return_dict_in_generate=True)
    res = []
    for i in range(n):
        length = int((out.beam_indices[i] >= 0).sum())  # generated tokens, EOS included
        res.append((out.sequences[i, len(prompt):len(prompt) + length].tolist(), float(out.sequences_scores[i])))
    return res


def check_same(ours: list[tuple[list[int], float]], ref: list[tuple[list[int], float]]) -> None:
    assert [t for t, _ in ours] == [t for t, _ in ref]
    for (_, a), (_, b) in zip(ours, ref):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (a, b)


# (beam width, max tokens, length penalty, early stopping, the finish reasons that come back): each stopping rule,
# penalties favouring short and long sequences, EOS-finished beams beating and losing to length-capped ones.
CASES = [(3, 6, 1.0, "never", {"length"}), (3, 6, -0.5, False, {"stop", "length"}),
         (2, 6, 0.0, True, {"stop"}), (4, 5, 2.0, False, {"length"})]


@pytest.mark.parametrize("k,max_new,lp,es,reasons", CASES)
def test_matches_transformers(llm: LLM, hf: Any, k: int, max_new: int, lp: float, es: bool | str, reasons: set):
    out = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=k, max_tokens=max_new,
                                                                          length_penalty=lp, early_stopping=es))
    seqs = out[0].sequences
    check_same([(s.output_tokens, s.score) for s in seqs], hf_beams(hf, PROMPT, k, max_new, lp, es))
    for s in seqs:
        assert s.tokens[:len(PROMPT)] == PROMPT and len(s.logprobs) == len(s.output_tokens)
        assert s.finish_reason == ("stop" if s.output_tokens[-1] == EOS else "length")
        assert math.isclose(s.score, s.cum_logprob / len(s.output_tokens) ** lp, rel_tol=1e-9)
        assert math.isclose(s.cum_logprob, sum(lp_[t].logprob for lp_, t in zip(s.logprobs, s.output_tokens)),
                            rel_tol=1e-6)
        assert s.text == llm.get_tokenizer().decode(s.tokens)  # vLLM's: prompt and output
    assert {s.finish_reason for s in seqs} == reasons  # what makes the case the one it claims to be


def test_batch_of_prompts_and_text(llm: LLM, hf: Any):
    """Several prompts step together; each gets its own search, as if run alone. A text prompt is tokenized."""
    text = "hello world"
    text_ids = llm.get_tokenizer().encode(text)
    outs = llm.beam_search([{"prompt_token_ids": PROMPT}, OTHER, text],
                           BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=-0.5, early_stopping=False))
    for out, prompt in zip(outs, [PROMPT, OTHER, text_ids]):
        check_same([(s.output_tokens, s.score) for s in out.sequences], hf_beams(hf, prompt, 3, 5, -0.5, False))


def test_ignore_eos(llm: LLM):
    """With ignore_eos every beam runs to max_tokens, EOS tokens included as plain tokens."""
    p = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.0)
    assert any(s.finish_reason == "stop" for s in llm.beam_search(PROMPT, p)[0].sequences)
    seqs = llm.beam_search(PROMPT, BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.0,
                                                    ignore_eos=True))[0].sequences
    assert [len(s.output_tokens) for s in seqs] == [6, 6] and {s.finish_reason for s in seqs} == {"length"}


def test_beams_share_kv_blocks_through_the_prefix_cache(llm: LLM):
    """Each step's request for a beam is its parent's tokens plus one: every full block of it (block_size 4) is a
    prefix-cache hit, the prompt's and those the parent beams generated alike; only the partial last block runs."""
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # fresh: nothing of it is cached
    before = llm.engine.stats()["prefix_cache_hits"]
    k, steps = 3, 6
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=k, max_tokens=steps, early_stopping="never",
                                                   ignore_eos=True))[0]
    bs = 4
    # Step 0 is the prompt alone (a miss); step t >= 1 runs k beams of len(prompt) + t tokens.
    expected = sum(k * ((len(prompt) + t - 1) // bs) * bs for t in range(1, steps))
    assert out.num_step_prompt_tokens == len(prompt) + sum(k * (len(prompt) + t) for t in range(1, steps))
    assert out.num_cached_tokens == expected
    assert llm.engine.stats()["prefix_cache_hits"] - before == expected
    assert expected > k * (steps - 1) * ((len(prompt) - 1) // bs) * bs  # generated tokens' blocks are shared too


@pytest.mark.parametrize("kwargs,param", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 19, "max_tokens": 4}, "beam_width"),  # 19 + 2 EOS logprobs per step > 20
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": 0.7}, "temperature"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
    ({"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_bad_params(llm: LLM, kwargs: dict, param: str):
    with pytest.raises(InvalidArgumentError) as err:
        llm.beam_search(PROMPT, BeamSearchParams(**kwargs))
    assert err.value.param == param


# ---- HTTP -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(path: Any) -> Any:
    from ironlm import EngineConfig, LLMEngine

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", **TINY_ENGINE_KW)))
    live = LiveServer(build_app(engine, served_model_name="tiny"), engine)
    yield live
    live.stop()


def test_http_use_beam_search(server: LiveServer, hf: Any, path: Any):
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    tok = load_tokenizer(path)
    r = client.completions.create(model="tiny", prompt=[PROMPT, OTHER], max_tokens=6, n=2, best_of=3,
                                  extra_body={"use_beam_search": True, "length_penalty": -0.5,
                                              "early_stopping": False})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate([PROMPT, OTHER]):
        ref = hf_beams(hf, prompt, 3, 6, -0.5, False, n=2)
        for c, (tokens, _) in zip(r.choices[2 * i:2 * i + 2], ref):
            stop = tokens[-1] in (EOS, EOS_ID)
            assert c.finish_reason == ("stop" if stop else "length")
            assert c.text == tok.decode(tokens[:-1] if stop else tokens)  # vLLM's: the EOS is left out
    assert r.usage.prompt_tokens == len(PROMPT) + len(OTHER)
    assert r.usage.completion_tokens == sum(len(t) for p in (PROMPT, OTHER) for t, _ in hf_beams(hf, p, 3, 6, -0.5,
                                                                                                  False, n=2))
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the beam steps' prefix-cache hits


def test_http_text_prompt_echo(server: LiveServer, hf: Any, path: Any):
    tok = load_tokenizer(path)
    r = httpx.post(f"{server.base_url}/completions", json={
        "model": "tiny", "prompt": "hello world", "max_tokens": 4, "n": 2, "use_beam_search": True, "echo": True,
        "temperature": 0})
    assert r.status_code == 200, r.text
    ref = hf_beams(hf, tok.encode("hello world"), 2, 4, 1.0, "never")
    assert [c["text"] for c in r.json()["choices"]] == ["hello world" + tok.decode(
        t[:-1] if t[-1] in (EOS, EOS_ID) else t) for t, _ in ref]


def test_http_chat_use_beam_search(server: LiveServer, hf: Any, path: Any):
    tok = load_tokenizer(path)
    messages = [{"role": "user", "content": "hello model"}]
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2,  # type: ignore[arg-type]
                                       extra_body={"use_beam_search": True, "length_penalty": 0.0})
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    ref = hf_beams(hf, ids, 2, 5, 0.0, "never")
    assert [c.message.content for c in r.choices] == [
        tok.decode(t[:-1] if t[-1] in (EOS, EOS_ID) else t) for t, _ in ref]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == sum(len(t) for t, _ in ref)


@pytest.mark.parametrize("body,param", [
    ({"temperature": 1.0}, "temperature"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"n": 0}, "n"),
])
def test_http_chat_bad_params(server: LiveServer, body: dict, param: str):
    r = httpx.post(f"{server.base_url}/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "use_beam_search": True,
        **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_http_timeout_bounds_the_whole_search(server: LiveServer):
    """`timeout` is the whole search's, not each step's: one far shorter than the search ends it with a 503, and
    the engine is left with nothing of it running."""
    r = httpx.post(f"{server.base_url}/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 200, "n": 4, "use_beam_search": True, "ignore_eos": True,
        "timeout": 0.05}, timeout=60)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "timeout"
    engine = server.engine
    assert engine is not None
    assert wait_for(lambda: engine.num_inflight == 0 and engine.stats()["num_requests_running"] == 0)


def load_tokenizer(path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("body,param", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 3, "best_of": 2, "use_beam_search": False}, "best_of"),
    ({"best_of": 3, "use_beam_search": False}, "best_of"),  # best_of != n needs use_beam_search
    ({"n": 19}, "n"),
    ({"n": 2, "best_of": 19}, "best_of"),
    ({"temperature": 0.8}, "temperature"),
    ({"stream": True}, "stream"),
    ({"logprobs": 2}, "logprobs"),
    ({"top_p": 0.5}, "top_p"),
    ({"stop": ["x"]}, "stop"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"early_stopping": "maybe"}, "early_stopping"),
    ({"max_tokens": 0, "echo": True}, "max_tokens"),
])
def test_http_bad_params(server: LiveServer, body: dict, param: str):
    r = httpx.post(f"{server.base_url}/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 3, "use_beam_search": True, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
