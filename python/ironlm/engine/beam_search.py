"""Beam search as a loop of one-token engine requests, as vLLM's `LLM.beam_search` runs it.

Each step sends every live beam to the engine as a request whose prompt is the beam's tokens so far (`max_tokens=1`,
greedy, the top `beam_width + len(eos)` logprobs). A beam's tokens extend its parent's, so the radix prefix cache
hands the request its parent's full KV blocks: the beams of one prompt share those blocks copy-free and only the
last, partial block (under `block_size` tokens) is computed again each step. `BeamSearchOutput.num_cached_tokens`
counts the prompt tokens served from the cache.

Candidate selection and stopping follow Hugging Face transformers' `generate(num_beams=k)`, so results match it:
- per step the candidates are the top `(1 + #eos) * k` continuations of all live beams by cumulative logprob
  (at least `2k`); a candidate ending in EOS is kept as finished only when it ranks in the top k, and the next
  live beams are the best k candidates that do not end in EOS;
- on the `max_tokens`-th token the top k candidates all finish (finish_reason "length");
- a finished sequence scores `cumulative_logprob / generated_len ** length_penalty`, EOS counted in the length
  (vLLM divides by the prompt and generated length without EOS; transformers' score is used here);
- `early_stopping`: True stops once k sequences finished; False stops when the best live beam, scored at its
  current length, cannot beat the worst of k finished (transformers' default heuristic); "never" (the default)
  stops only when no live beam can beat it at any length up to `max_tokens` (exact: logprobs are <= 0).
Per beam the top `k + #eos` tokens are enough to rebuild the global top candidates that can matter: a candidate
ranked in the top k overall is in its beam's top k, and a beam's k best non-EOS tokens are in its top `k + #eos`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ironlm.engine.outputs import Logprob, RequestOutput
from ironlm.sampling_params import BeamSearchParams, EarlyStopping, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BeamSearchInstance", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "EarlyStopping"]


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt then the generated tokens, as in vLLM."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token: the step's top logprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None
    score: float = 0.0  # cum_logprob / generated_len ** length_penalty
    num_prompt_tokens: int = 0

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
    num_cached_tokens: int = 0  # step prompt tokens served by the prefix cache, all steps together
    num_step_prompt_tokens: int = 0  # step prompt tokens, all steps together


@dataclass
class _Candidate:
    logprob: float  # cumulative
    parent: BeamSearchSequence
    token: int
    top: dict[int, Logprob]


class BeamSearchInstance:
    """The beams of one prompt; `advance` takes one engine step's output per live beam."""

    def __init__(self, prompt_tokens: list[int], params: BeamSearchParams, eos_ids: Iterable[int],
                 max_tokens: int) -> None:
        """`max_tokens`: params.max_tokens, capped where the model's context ends."""
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.max_tokens = max_tokens
        self.prompt_len = len(prompt_tokens)
        self.live = [BeamSearchSequence(tokens=list(prompt_tokens), num_prompt_tokens=len(prompt_tokens))]
        self.finished: list[BeamSearchSequence] = []
        self.generated = 0
        self.done = max_tokens < 1
        self.cached_tokens = 0
        self.step_prompt_tokens = 0

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        p, k = self.params, self.params.beam_width
        cands: list[tuple[float, int, int, _Candidate]] = []
        for b, (beam, out) in enumerate(zip(self.live, outputs, strict=True)):
            self.cached_tokens += out.num_cached_tokens
            self.step_prompt_tokens += len(out.prompt_token_ids)
            if out.error:
                raise RuntimeError(f"beam step {out.request_id} failed: {out.error}")
            lps = out.outputs[0].logprobs
            if not lps:
                raise RuntimeError(f"beam step {out.request_id} came back without logprobs")
            top = lps[0]
            for tok, lp in top.items():
                cum = beam.cum_logprob + lp.logprob
                cands.append((-cum, b, tok, _Candidate(cum, beam, tok, top)))
        # On equal logprobs the earlier beam, then the lower token id, first: the order of a flattened top-k.
        cands.sort(key=lambda t: t[:3])
        self.generated += 1
        last = self.generated >= self.max_tokens
        live: list[BeamSearchSequence] = []
        # No check that a finished candidate can still improve on k finished ones: `done` ended the search first.
        for rank, (_, _, _, c) in enumerate(cands[:max(2, 1 + len(self.eos)) * k]):
            if last or c.token in self.eos:
                if rank < k:
                    self.finished.append(self._extend(c, "stop" if c.token in self.eos else "length"))
            elif len(live) < k:
                live.append(self._extend(c, None))
        self.finished.sort(key=lambda s: -s.score)
        del self.finished[k:]
        self.live = live
        self.done = last or not live or not self._improvable() or (p.early_stopping is True and self._full())

    def _extend(self, c: _Candidate, finish: str | None) -> BeamSearchSequence:
        parent = c.parent
        return BeamSearchSequence(tokens=parent.tokens + [c.token], logprobs=parent.logprobs + [c.top],
                                  cum_logprob=c.logprob, finish_reason=finish, score=self._score(c.logprob),
                                  num_prompt_tokens=self.prompt_len)

    def _score(self, cum_logprob: float, length: int | None = None) -> float:
        return cum_logprob / (length or self.generated) ** self.params.length_penalty

    def _full(self) -> bool:
        return len(self.finished) >= self.params.beam_width

    def _improvable(self) -> bool:
        """Can a live beam still beat the worst of k finished sequences?"""
        if not self._full() or not self.live:
            return True
        p = self.params
        length = self.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else self.generated
        return self._score(self.live[0].cum_logprob, length) > self.finished[-1].score

    def result(self) -> list[BeamSearchSequence]:
        """The best beam_width sequences, best first (live beams fill in when fewer finished: a tiny vocabulary)."""
        k = self.params.beam_width
        rest = sorted((_with_score(b, self._score(b.cum_logprob)) for b in self.live), key=lambda s: -s.score)
        return (self.finished + rest)[:k] if len(self.finished) < k else self.finished


def _with_score(beam: BeamSearchSequence, score: float) -> BeamSearchSequence:
    beam.score, beam.finish_reason = score, "length"
    return beam


def step_params(params: BeamSearchParams, num_eos: int) -> SamplingParams:
    return SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=params.top_logprobs(num_eos),
                          detokenize=False)


def pending_prompts(instances: Sequence[BeamSearchInstance]) -> list[list[int]]:
    """The next step's engine prompts: every live beam of every unfinished instance, in order."""
    return [b.tokens for inst in instances if not inst.done for b in inst.live]


def advance_all(instances: Sequence[BeamSearchInstance], outputs: Sequence[RequestOutput]) -> None:
    """Hand each unfinished instance its beams' outputs (in `pending_prompts` order)."""
    at = 0
    for inst in [i for i in instances if not i.done]:
        n = len(inst.live)
        inst.advance(outputs[at:at + n])
        at += n


def finish(inst: BeamSearchInstance, tokenizer: PreTrainedTokenizerBase,
           text: Callable[[BeamSearchSequence], list[int]] | None = None) -> BeamSearchOutput:
    """The instance's output with each sequence's text: `text(seq)` picks the ids to decode (default: all its
    tokens, prompt included, as vLLM's LLM.beam_search)."""
    seqs = inst.result()
    for s in seqs:
        decoded = tokenizer.decode(s.tokens if text is None else text(s))
        assert isinstance(decoded, str)  # decode is typed for batches too
        s.text = decoded
    return BeamSearchOutput(seqs, num_cached_tokens=inst.cached_tokens, num_step_prompt_tokens=inst.step_prompt_tokens)


def capped_max_tokens(params: BeamSearchParams, prompt_len: int, max_model_len: int) -> int:
    """params.max_tokens, within the model's context (the last step's prompt plus its token must fit)."""
    return max(1, min(params.max_tokens, max_model_len - prompt_len))
