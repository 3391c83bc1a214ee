"""The engine's Python-side state of requests and their sequences: outputs, detokenizers, timings.

The Rust core owns a sequence's tokens and blocks and names it by a slot; the sampler keeps per-slot
sampling state. `SequenceTable` is the one place that adds and removes a slot's Python state, for the
engine and the sampler together, so the two never disagree about which slots are live.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ironlm.detokenizer import IncrementalDetokenizer
from ironlm.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from ironlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm.sampler import Sampler


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[EngineSequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    pooled: Any = None  # a pooling model's embedding or score (engine/pooling.py)
    prompt_logprobs: PromptLogprobs | None = None  # filled by the engine's PromptLogprobs as the prompt runs

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=[seq.output() for seq in self.seqs], finished=self.finished, metrics=self.metrics,
            pooled=self.pooled,
            num_cached_tokens=self.num_cached_tokens, error=self.error, prompt_logprobs=self.prompt_logprobs,
        )


@dataclass(eq=False)
class EngineSequence:
    index: int
    slot: int
    request: EngineRequest
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @classmethod
    def create(cls, index: int, slot: int, request: EngineRequest,
               tokenizer: PreTrainedTokenizerBase) -> EngineSequence:
        p = request.params
        detok = None
        if p.detokenize:
            detok = IncrementalDetokenizer(
                tokenizer, request.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens, stop=p.stop_strings,
                include_stop_str_in_output=p.include_stop_str_in_output)
        return cls(index, slot, request, detok, logprobs=[] if p.logprobs is not None else None)

    def append(self, token: int, logprob: float, top: tuple[list[int], list[float]] | None,
               tokenizer: PreTrainedTokenizerBase, stop_token: bool = False) -> str | None:
        """Record one sampled token; returns the stop string if one matched.

        A token that stopped the sequence (EOS, stop_token_ids) stays in token_ids but, as in
        vLLM, never reaches the text.
        """
        self.token_ids.append(token)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = {token: Logprob(logprob, decoded_token=str(tokenizer.decode([token])))}
            if top is not None:
                k = self.request.params.logprobs or 0
                for rank, (tid, lp) in enumerate(zip(top[0][:k], top[1][:k]), start=1):
                    if tid == token:
                        entry[token].rank = rank
                    else:
                        entry[tid] = Logprob(lp, rank=rank, decoded_token=str(tokenizer.decode([tid])))
            self.logprobs.append(entry)
        if self.detok is None or stop_token:
            return None
        delta = self.detok.add([token])
        return delta.stop_str if delta.stopped else None

    def finish(self, reason: str, stop_token: int | None = None) -> None:
        """`stop_token`: the stop_token_ids entry the core matched (None for EOS, which reports none)."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        if self.detok is not None and not self.detok.stopped:
            self.detok.finish()  # flush text held back for a possible stop string or a partial character
        if stop_token is not None:
            self.stop_reason = stop_token

    def output(self) -> CompletionOutput:
        text = self.detok.output_text if self.detok is not None else ""
        return CompletionOutput(
            index=self.index, text=text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )


class SequenceTable:
    """Live requests by id and their sequences by slot; the only caller of `Sampler.add` / `Sampler.remove`."""

    def __init__(self, sampler: Sampler, tokenizer: PreTrainedTokenizerBase) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.requests: dict[str, EngineRequest] = {}  # accepted and not yet reported finished
        self._seqs: dict[int, EngineSequence] = {}  # slot -> sequence still running in the core

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: EngineRequest, slots: Sequence[int], stop_token_ids: Sequence[int]) -> None:
        """Register a request the core accepted, one sequence per slot it gave (n > 1: several).
        `stop_token_ids`: the ids the core stops its sequences on (the sampler masks them for min_tokens)."""
        params = request.params
        for index, slot in enumerate(slots):
            seed = None if params.seed is None else params.seed + index
            self.sampler.add(slot, params, request.prompt_token_ids, seed, stop_token_ids=stop_token_ids)
            seq = EngineSequence.create(index, slot, request, self.tokenizer)
            request.seqs.append(seq)
            self._seqs[slot] = seq
        self.requests[request.request_id] = request

    def seq(self, slot: int) -> EngineSequence | None:
        return self._seqs.get(slot)

    def requests_in(self, slots: Iterable[int]) -> list[EngineRequest]:
        """The distinct live requests owning `slots`, in first-seen order."""
        found: dict[str, EngineRequest] = {}
        for slot in slots:
            seq = self._seqs.get(slot)
            if seq is not None:
                found.setdefault(seq.request.request_id, seq.request)
        return list(found.values())

    def finish(self, slot: int, reason: str, stop_token: int | None = None) -> EngineRequest | None:
        """The core finished `slot`: drop its sampler state and close its output. Returns its request."""
        seq = self._seqs.pop(slot, None)
        if seq is None:
            return None
        self.sampler.remove(slot)
        seq.finish(reason, stop_token)
        return seq.request

    def release(self, request: EngineRequest, reason: str) -> None:
        """The request leaves early (abort, failed step): close every sequence still running with `reason`."""
        for seq in request.seqs:
            if self._seqs.pop(seq.slot, None) is not None:
                self.sampler.remove(seq.slot)
            if seq.finish_reason is None:
                seq.finish(reason)

    def pop(self, request_id: str) -> EngineRequest | None:
        """Forget a request (aborted, or finished and reported); its sequences must be finished or released."""
        return self.requests.pop(request_id, None)
