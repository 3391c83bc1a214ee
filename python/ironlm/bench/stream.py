"""One stream over HTTP: what a single user of a server sees, for `ironlm bench latency --streamed`.

Requests are `serve`'s (POST /v1/completions, token-id prompts, greedy, EOS ignored, SSE), sent one at a time by
a light blocking client (bench/sse_client.py): on a 2-core machine the async client of `serve` took ~0.5-0.9 ms of
CPU per token from the engine it was measuring.
- TTFT: a `prompt_len`-token prompt and one output token, timed from send to the first token chunk;
  prefill tokens/s = prompt_len / TTFT.
- streamed decode: a 1-token prompt and `gen_len + 1` output tokens; tokens/s = gen_len / (last token chunk −
  first token chunk), the same steps as the in-process decode test, so the two differ only by the path from
  the engine step to the client (detokenization, SSE framing, the event loop, the socket).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ironlm.bench.datasets import BenchRequest
from ironlm.bench.serve import RequestResult, completion_payload
from ironlm.bench.sse_client import stream_request


def stream_once(url: str, prompt: Sequence[int], max_tokens: int, timeout_s: float = 600.0) -> RequestResult:
    req = BenchRequest(list(prompt), max_tokens)
    res = RequestResult(req.prompt_len, req.output_len)
    stream_request(url.rstrip("/") + "/v1/completions", completion_payload(req), res, timeout_s)
    if not res.success:
        raise RuntimeError(f"streamed request to {url} failed: {res.error}")
    if res.output_tokens != max_tokens:
        raise RuntimeError(f"{url} streamed {res.output_tokens} tokens, expected {max_tokens}")
    return res


def streamed_prefill(url: str, prompt: Sequence[int]) -> tuple[float, float]:
    """(prompt tokens/s, TTFT in s) of one prompt."""
    res = stream_once(url, prompt, 1)
    return len(prompt) / res.ttft, res.ttft


def streamed_decode(url: str, first_token: int, gen_len: int) -> float:
    """Tokens/s of `gen_len` decode steps as the client receives them (the first token comes from the prefill)."""
    res = stream_once(url, [first_token], gen_len + 1)
    span = sum(res.itl)
    if len(res.itl) < 1 or span <= 0:
        raise RuntimeError(f"{url} sent all {gen_len + 1} tokens in {res.token_chunks} chunk(s): no decode timing")
    # Chunks after the first carry the other gen_len tokens (one each from ironlm and vLLM; if a server packed
    # several into a chunk, the count still holds: tokens, not chunks, over the first-to-last span).
    return gen_len / span


def server_rounds(url: str, prompts: Sequence[Sequence[int]], gen_len: int, repeats: int) -> dict[str, Any]:
    """An untimed round on the last prompt, then `repeats` rounds of TTFT + streamed decode."""
    streamed_prefill(url, prompts[-1])
    streamed_decode(url, prompts[-1][0], gen_len)
    samples: dict[str, list[float]] = {"prefill_tok_s": [], "ttft_s": [], "decode_tok_s": []}
    for rnd in range(repeats):
        tok_s, ttft = streamed_prefill(url, prompts[rnd])
        samples["prefill_tok_s"].append(tok_s)
        samples["ttft_s"].append(ttft)
        samples["decode_tok_s"].append(streamed_decode(url, prompts[rnd][0], gen_len))
    return samples
