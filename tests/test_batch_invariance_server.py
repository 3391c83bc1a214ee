"""Issue 26's check through a real server: 8 chat prompts, greedy, max_tokens 32, sent one after another and then
4x each at once (32 streams) to the default model served with batch_invariant: all 32 concurrent answers equal the
sequential ones, text and every token's logprob. Request dedupe is off (ServerConfig's default), so each of the
32 is its own sequence in a batch of up to 32 rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from ironlm import EngineConfig, LLMEngine
from ironlm.server.api import build_app
from server_utils import AsyncLLMEngine, LiveServer

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.",
           "Explain what a CPU cache is.", "Say hello in Spanish.", "What is 17 times 3?",
           "Name a famous painter.", "Give me a tip for learning to code."]


@pytest.fixture(scope="module")
def server():
    from ironlm.model.default import default_model_path

    config = EngineConfig(model=str(default_model_path()), device="cpu", batch_invariant=True, num_kv_blocks=256,
                          max_model_len=512, max_num_seqs=32)
    engine = AsyncLLMEngine(LLMEngine(config))
    live = LiveServer(build_app(engine, served_model_name="default"), engine)
    yield live
    live.stop()


def ask(client: openai.OpenAI, prompt: str) -> tuple[str, list[Any]]:
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=32, logprobs=True)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    return choice.message.content or "", [(t.token, t.logprob) for t in choice.logprobs.content]


def test_32_concurrent_answers_equal_the_sequential_ones(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    sequential = [ask(client, p) for p in PROMPTS]
    with ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(lambda p: ask(client, p), PROMPTS * 4))
    same = sum(got == sequential[i % len(PROMPTS)] for i, got in enumerate(concurrent))
    assert same == 32, f"only {same}/32 concurrent answers equal the sequential ones"
