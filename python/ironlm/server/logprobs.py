"""Engine logprobs (one {token id: Logprob} dict per generated token) in the two OpenAI shapes, and prompt logprobs
(one per prompt token, None for the first) in vLLM's `prompt_logprobs` shape and in legacy completions' echo."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ironlm.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from ironlm.server.serving_common import LOGPROB_FLOOR, clamp_logprob


def _token_str(tokenizer: Any, tid: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


def _legacy(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], tokenizer: Any,
            offset: int) -> tuple[dict, int]:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid) if entry is not None else None
        s = _token_str(tokenizer, tid, chosen)
        tokens.append(s)
        token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
        if entry is None:  # the first prompt token: nothing predicts it (OpenAI's null)
            top.append(None)
        else:
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


def completion_logprobs(c: CompletionOutput, start: int, tokenizer: Any, offset: int) -> tuple[dict, int]:
    """Legacy-completions logprobs for tokens [start:], text offsets from `offset`; returns the new offset."""
    entries = c.logprobs or []
    ids = c.token_ids[start:]
    return _legacy(ids, [entries[j] if j < len(entries) else {} for j in range(start, start + len(ids))],
                   tokenizer, offset)


def echo_logprobs(out: RequestOutput, tokenizer: Any, num_top: int | None, offsets: list[int] | None) -> dict:
    """Legacy-completions logprobs of the prompt (echo): None for the first token, the token and the top
    `num_top` for the others (the engine may have computed more for `prompt_logprobs`). `offsets`: where each
    token starts in the echoed text (`prompt_offsets`); None: the token strings' running lengths, as vLLM's."""
    top = num_top or 0
    entries: PromptLogprobs = [None if e is None else {t: lp for t, lp in e.items()
                                                       if t == tid or (lp.rank is not None and lp.rank <= top)}
                               for tid, e in zip(out.prompt_token_ids, out.prompt_logprobs or [])]
    ids = out.prompt_token_ids
    entries += [{}] * (len(ids) - len(entries))
    lp, _ = _legacy(ids, entries, tokenizer, 0)
    if offsets is not None:
        lp["text_offset"] = offsets
    return lp


def prompt_offsets(out: RequestOutput, tokenizer: Any) -> list[int] | None:
    """Where each prompt token starts in the prompt's text, from the tokenizer's offset mapping (a BOS the text
    does not hold starts at 0); None when it cannot tell (a slow tokenizer, token ids given, a tokenization that
    differs). It tokenizes the text again: call it off the event loop."""
    if out.prompt is None or not getattr(tokenizer, "is_fast", False):
        return None
    enc = tokenizer(out.prompt, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(out.prompt_token_ids):
        return None
    return [int(start) for start, _ in enc["offset_mapping"]]


def join_legacy(first: dict, second: dict) -> dict:
    """Two legacy logprobs objects as one (the echoed prompt's, then the generated tokens')."""
    return {k: first[k] + second[k] for k in first}


def prompt_logprobs_wire(plp: PromptLogprobs | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [None if e is None else {str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in plp]


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

