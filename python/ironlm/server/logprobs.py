"""Engine logprobs (one {token id: Logprob} dict per generated token) in the two OpenAI shapes."""

from __future__ import annotations

from typing import Any

from ironlm.engine.outputs import CompletionOutput, Logprob
from ironlm.server.serving_common import LOGPROB_FLOOR, clamp_logprob


def _token_str(tokenizer: Any, tid: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


def completion_logprobs(c: CompletionOutput, start: int, tokenizer: Any, offset: int) -> tuple[dict, int]:
    """Legacy-completions logprobs for tokens [start:], text offsets from `offset`; returns the new offset."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    text_offset: list[int] = []
    entries = c.logprobs or []
    for j in range(start, len(c.token_ids)):
        tid = c.token_ids[j]
        entry = entries[j] if j < len(entries) else {}
        chosen = entry.get(tid)
        s = _token_str(tokenizer, tid, chosen)
        tokens.append(s)
        token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)  # type: ignore[arg-type]
        # As vLLM: the chosen token plus the top-N (N or N + 1 entries). Keys are strings, and distinct
        # tokens can decode alike (partial UTF-8): keep the likelier one.
        alts: dict[str, float] = {}
        for t, lp in _ranked(entry):
            alts.setdefault(_token_str(tokenizer, t, lp), clamp_logprob(lp.logprob))
        top.append(alts)
        text_offset.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": text_offset}, offset


def chat_logprobs(c: CompletionOutput, start: int, tokenizer: Any, num_top: int) -> dict:
    """Chat logprobs for tokens [start:]: exactly `num_top` alternatives per token, best first."""
    content = []
    entries = c.logprobs or []
    for j in range(start, len(c.token_ids)):
        tid = c.token_ids[j]
        entry = entries[j] if j < len(entries) else {}
        chosen = entry.get(tid)
        s = _token_str(tokenizer, tid, chosen)
        alts = [{"token": (t := _token_str(tokenizer, k, lp)), "logprob": clamp_logprob(lp.logprob),
                 "bytes": list(t.encode("utf-8"))} for k, lp in _ranked(entry)[:num_top]]
        content.append({"token": s, "logprob": clamp_logprob(chosen.logprob) if chosen else LOGPROB_FLOOR,
                        "bytes": list(s.encode("utf-8")), "top_logprobs": alts})
    return {"content": content}

