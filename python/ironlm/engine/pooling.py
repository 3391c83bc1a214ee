"""Pooling models: the decoder run as an embedding or a (query, document) scoring model (`runner="pooling"`).

A pooling request is an ordinary scheduler request for one output token (`PoolingParams`): the core batches and
chunks its prompt like any prefill and admits it under the same budgets; the step whose chunk completes the prompt
is its last. In a pooling engine `Pooler.step` stands in for the forward and the sampler: it runs the forward up
to the final norm for the rows it needs, pools them, stores the result on the request (`RequestOutput.pooled`) and
hands the core a placeholder token, which ends the request (max_tokens 1) and never reaches an output's text.

What a request yields (`Pooler.task`):
- "embed": one vector from the prompt's final-norm hidden states: the last row (`last`), the first (`cls`) or
  their mean (`mean`), L2-normalised with `normalize`. Last-token pooling reads only the row the step computes
  anyway, so it is correct with a prefix-cache hit; `mean` and `cls` need rows a hit would skip, so the engine runs
  them with the prefix cache off (EngineConfig.pooling_bypasses_cache). Chunked prompts add their rows chunk by
  chunk; a prompt recomputed after a preemption skips the rows it already added.
- "score": one number: the sequence-classification head's (sigmoid of a single label, else softmax's last
  label) or, for `score_mode="yes_no"`, softmax over the two score tokens' logits at the last position
  (Qwen3-Reranker). Embedding models score pairs by the cosine of their embeddings instead (`cosine`, in the
  callers: the engine only embeds).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ironlm import _core
from ironlm.distributed.plan_codec import StepArrays
from ironlm.exceptions import InvalidArgumentError
from ironlm.sampler import SamplerOutput
from ironlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm.config import EngineConfig
    from ironlm.engine.model_runner import ModelRunner
    from ironlm.engine.outputs import RequestOutput
    from ironlm.engine.sequence_table import EngineRequest, SequenceTable
    from ironlm.engine.timing import StepTimer

logger = logging.getLogger("ironlm.engine")

# Qwen3-Reranker's prompt (its model card): a judge's system message, the pair, an empty thinking block.
QWEN3_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    f"<Instruct>: {QWEN3_RERANK_INSTRUCTION}\n<Query>: {{query}}\n<Document>: {{document}}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
_FIELD = re.compile(r"\{(query|document)\}")


class _StepEngine(Protocol):
    """What `Pooler.engine_step` uses of the LLMEngine whose step it finishes (a protocol: no import cycle)."""

    timer: StepTimer
    faults: Any
    table: SequenceTable
    scheduler: _core.Scheduler
    num_steps: int

    def _fail_step(self, plan: _core.SchedulerPlan, exc: Exception,
                   touched: dict[str, EngineRequest]) -> list[RequestOutput]: ...

    def _finish_seq(self, slot: int, reason: str, stop_token: int | None,
                    touched: dict[str, EngineRequest]) -> None: ...

    def _collect(self, touched: dict[str, EngineRequest]) -> list[RequestOutput]: ...


@dataclass
class PoolingParams(SamplingParams):
    """A pooling request's parameters: one greedy placeholder token, never detokenized."""

    temperature: float = 0.0
    max_tokens: int | None = 1
    detokenize: bool = False


def check_request(pooler: Pooler | None, params: SamplingParams) -> None:
    """A generation request for a pooling engine or a pooling request for a generating one is refused."""
    if pooler is None and isinstance(params, PoolingParams):
        raise InvalidArgumentError("this engine generates text: start it with --runner pooling (runner='pooling') "
                                   "to embed or score", param="runner")
    if pooler is not None and not isinstance(params, PoolingParams):
        raise InvalidArgumentError("this engine runs a pooling model (--runner pooling): it embeds and scores, it "
                                   "does not generate", param="runner")


def make_pooler(config: EngineConfig, runner: ModelRunner) -> Pooler | None:
    """The engine's pooler (None for runner "generate", which a classifier checkpoint cannot run)."""
    if config.runner != "pooling":
        if runner.model_config.num_labels:
            raise InvalidArgumentError("this checkpoint is a sequence classifier (score.weight, no LM head): "
                                       "start it with --runner pooling", param="runner")
        return None
    return Pooler(config, runner)


def score_token_ids(spec: str, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> tuple[int, int]:
    """`score_tokens` ("yes,no" or ids) -> (positive id, negative id); each text must be exactly one token."""
    ids: list[int] = []
    for part in spec.split(","):
        text = part.strip()
        if text.isdigit():
            tid = int(text)
        else:
            enc = tokenizer.encode(text, add_special_tokens=False)
            if len(enc) != 1:
                raise InvalidArgumentError(f"score_tokens: {text!r} is {len(enc)} tokens, not one", "score_tokens")
            tid = int(enc[0])
        if not 0 <= tid < vocab_size:
            raise InvalidArgumentError(f"score_tokens: id {tid} is outside the vocabulary", "score_tokens")
        ids.append(tid)
    return ids[0], ids[1]


@dataclass
class _Acc:
    """A sequence's pooled rows so far: their sum (mean) or the first row (cls), and the next position to add."""

    total: torch.Tensor | None = None
    next_pos: int = 0


class Pooler:
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.runner = runner
        self.pooling_type = config.pooling_type
        self.normalize = config.normalize
        labels = runner.model_config.num_labels
        mode = config.score_mode
        if mode == "auto":
            mode = "classify" if labels else "cosine"
        if mode == "classify" and not labels:
            raise InvalidArgumentError("score_mode: classify needs a sequence-classification checkpoint "
                                       "(*ForSequenceClassification with score.weight)", "score_mode")
        if mode == "yes_no" and labels:
            raise InvalidArgumentError("score_mode: yes_no needs the LM head; this checkpoint is a classifier",
                                       "score_mode")
        self.score_mode = mode
        self.task = "embed" if mode == "cosine" else "score"
        self.hidden_size = runner.model_config.hidden_size
        self.template = config.score_template
        if self.template is None and mode == "yes_no":
            self.template = QWEN3_RERANK_TEMPLATE
        self.yes_no = (score_token_ids(config.score_tokens, runner.tokenizer, runner.model_config.vocab_size)
                       if mode == "yes_no" else None)
        self._acc: dict[int, _Acc] = {}  # slot -> its mean/cls rows so far

    # ---- prompts -------------------------------------------------------------------------------------------
    def pair_prompt(self, query: str, document: str) -> dict[str, Any]:
        """The token ids a scoring model reads for one pair: the template filled in (no special tokens added, as
        Qwen3-Reranker tokenizes it), else the tokenizer's own pair encoding."""
        tokenizer = self.runner.tokenizer
        if self.template is None:
            ids = tokenizer(query, document)["input_ids"]
        else:
            values = {"query": query, "document": document}
            text = _FIELD.sub(lambda m: values[m.group(1)], self.template)
            ids = tokenizer.encode(text, add_special_tokens=False)
        return {"prompt_token_ids": [int(t) for t in ids]}

    # ---- the step ------------------------------------------------------------------------------------------
    def engine_step(self, engine: _StepEngine, plan: _core.SchedulerPlan,
                    touched: dict[str, EngineRequest]) -> list[RequestOutput]:
        """The rest of `LLMEngine._step` for a pooling engine: the forward pools, the core gets placeholders and
        finishes each completed prompt (max_tokens 1), whose output carries no token."""
        timer = engine.timer
        try:
            if engine.faults is not None:
                engine.faults.check("forward")
            sampled = self.step(plan, engine.table, timer)
            timer.lap("sample")
        except Exception as exc:  # a failed step fails its requests, never the engine
            logger.exception("pooling step failed; failing the %d sequences in it", plan.num_seqs)
            return engine._fail_step(plan, exc, touched)
        finished = {slot: (reason, tok) for _, slot, reason, tok in engine.scheduler.update(sampled.token_ids)}
        timer.lap("update")
        now = _core.monotonic()
        for slot in plan.sample_slots.tolist():
            seq = engine.table.seq(slot)
            if seq is not None:
                seq.request.metrics.first_token_time = seq.request.metrics.last_token_time = now
            if slot not in finished:  # one token always ends it; never let a placeholder be decoded on
                engine.scheduler.finish(slot)
                finished[slot] = ("length", None)
        for slot, (reason, _) in finished.items():
            engine._finish_seq(slot, reason, None, touched)
        outputs = engine._collect(touched)
        timer.lap("output")
        engine.num_steps += 1
        return outputs

    def step(self, plan: _core.SchedulerPlan, table: SequenceTable, timer: StepTimer | None) -> SamplerOutput:
        """Run the plan's forward, pool what it completes onto the requests; the placeholder tokens to sample."""
        arrays = StepArrays.of(plan)
        num = len(plan.sample_slots)
        if self.task == "score":
            values = self._scores(self.runner.run(arrays, timer))
        else:
            values = self._embed(arrays, plan, table, timer)
        for slot, value in zip(plan.sample_slots.tolist(), values):
            seq = table.seq(slot)
            if seq is not None:
                seq.request.pooled = value
        return SamplerOutput(token_ids=np.zeros(num, dtype=np.int64), logprobs=np.zeros(num, dtype=np.float32))

    def _scores(self, logits: torch.Tensor) -> list[np.ndarray]:
        if self.yes_no is not None:
            probs = torch.softmax(logits[:, list(self.yes_no)].float(), dim=-1)[:, 0]
        elif logits.shape[1] == 1:
            probs = torch.sigmoid(logits[:, 0].float())
        else:
            probs = torch.softmax(logits.float(), dim=-1)[:, -1]
        return [np.array([p], dtype=np.float32) for p in probs.cpu().tolist()]

    def _embed(self, arrays: StepArrays, plan: _core.SchedulerPlan, table: SequenceTable,
               timer: StepTimer | None) -> list[np.ndarray]:
        positions = arrays.positions
        if self.pooling_type == "last":
            rows = arrays.logits_indices
        elif self.pooling_type == "cls":
            rows = np.flatnonzero(positions == 0).astype(np.int64)
        else:
            rows = np.arange(len(positions), dtype=np.int64)
        hidden = self.runner.run(replace(arrays, logits_indices=rows), timer, hidden=True)
        if self.pooling_type == "last":
            out = hidden
        else:
            self._accumulate(hidden, rows, arrays, plan.seq_slots)
            out = torch.stack([self._finish(slot, table) for slot in plan.sample_slots.tolist()]) if len(
                plan.sample_slots) else hidden[:0]
        if self.normalize:
            out = F.normalize(out.float(), p=2, dim=-1)
        return list(out.float().cpu().numpy())

    def _accumulate(self, hidden: torch.Tensor, rows: np.ndarray, arrays: StepArrays, seq_slots: np.ndarray) -> None:
        qsl, positions = arrays.query_start_loc, arrays.positions
        if self.pooling_type == "cls":
            owners = np.searchsorted(qsl, rows, side="right") - 1
            for i, owner in enumerate(owners.tolist()):
                self._acc[int(seq_slots[owner])] = _Acc(hidden[i].clone(), 1)
            return
        for i, slot in enumerate(seq_slots.tolist()):
            start, end = int(qsl[i]), int(qsl[i + 1])
            if start == end:
                continue
            first = int(positions[start])
            acc = self._acc.get(slot)
            if first == 0 or acc is None:  # a new sequence in this slot, or its recompute from the start
                acc = self._acc[slot] = _Acc(torch.zeros(hidden.shape[1], dtype=torch.float64,
                                                         device=hidden.device), 0)
            if first > acc.next_pos:
                raise RuntimeError(f"mean pooling: slot {slot} resumes at position {first} but has rows up to "
                                   f"{acc.next_pos} (a prefix-cache hit skipped rows)")
            skip = acc.next_pos - first  # rows a recompute computes again
            if skip < end - start:
                assert acc.total is not None
                acc.total += hidden[start + skip:end].sum(dim=0, dtype=torch.float64)
                acc.next_pos = first + end - start

    def _finish(self, slot: int, table: SequenceTable) -> torch.Tensor:
        acc = self._acc.pop(slot, None)
        seq = table.seq(slot)
        length = len(seq.request.prompt_token_ids) if seq is not None else None
        if acc is None or acc.total is None or (self.pooling_type == "mean" and acc.next_pos != length):
            raise RuntimeError(f"{self.pooling_type} pooling: slot {slot} completed its prompt without all its rows")
        if self.pooling_type == "mean":
            return (acc.total / acc.next_pos).float()
        return acc.total.float()


def truncate(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Matryoshka truncation to the first `dimensions` entries, re-normalised when the model normalises."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    out = vector[:dimensions].astype(np.float32)
    if normalize:
        norm = float(np.linalg.norm(out))
        out = out / norm if norm > 0 else out
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / denom) if denom > 0 else 0.0
