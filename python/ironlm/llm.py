"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import difflib
import inspect
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, cast

from tqdm.auto import tqdm

from ironlm import llm_beam, llm_pooling
from ironlm.config import EngineConfig
from ironlm.engine import LLMEngine
from ironlm.engine.beam_search import BeamSearchOutput
from ironlm.engine.outputs import RequestOutput
from ironlm.exceptions import InvalidArgumentError
from ironlm.llm_pooling import EmbeddingRequestOutput, ScoringRequestOutput
from ironlm.sampling_params import BeamSearchParams, SamplingParams
from ironlm.stats import latency_summary

PromptType = str | list[int] | dict
Conversation = list[dict[str, Any]]


class LLM:
    """Batch generation over one model. `model=None` serves the built-in SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: any `EngineConfig` field (see `inspect.signature(LLM)`), plus `enable_metrics`, accepted
        for vLLM compatibility: metrics are always collected, so it changes nothing."""
        kwargs.pop("enable_metrics", None)
        known = {f.name for f in fields(EngineConfig)}
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")
        config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(config)
        self._finished: list[RequestOutput] = []
        self._busy_seconds = 0.0
        self._generated = 0
        self._prompt_tokens = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """End the engine (idempotent; also runs at exit): a disk KV tier saves its blocks for the next start."""
        self.engine.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise InvalidArgumentError("priority must have one entry per prompt", param="priority")
        ids = []
        engine = self.engine
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"llm-{id(self)}-{time.monotonic_ns()}-{i}"
                engine.add_request(rid, prompt, p, priority=0 if priority is None else priority[i])
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[Conversation], [messages] if one else messages)
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(
            c, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))}
            for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The `params.beam_width` best sequences of each prompt, best first, as vLLM's `LLM.beam_search`
        (selection, scores and stopping as transformers' `num_beams` generate: engine/beam_search.py)."""
        def generate(batch: list[dict], step: SamplingParams) -> list[RequestOutput]:
            return self.generate(batch, step, use_tqdm=False)

        return llm_beam.beam_search(self.engine, generate, prompts, params, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """Embeddings of `prompts` (`runner="pooling"`): `outputs.embedding` per prompt, as in vLLM; `dimensions`
        truncates (Matryoshka), re-normalised when the engine normalises."""
        return llm_pooling.embed(self, prompts, use_tqdm, dimensions)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Relevance of each (text_1, text_2) pair (`runner="pooling"`; one text_1 against all text_2, or pairwise):
        the classifier's or yes/no score of a scoring model, the embeddings' cosine of an embedding model."""
        return llm_pooling.score(self, text_1, text_2, use_tqdm)

    def _params_list(self, sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                     n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidArgumentError(f"sampling_params has {len(params)} entries for {n} prompts",
                                       param="sampling_params")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        start = time.perf_counter()
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        bar.update(1)
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine lost {len(pending)} requests")  # a bug, never a hang
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        self._busy_seconds += time.perf_counter() - start
        outputs = [done[rid] for rid in ids]
        self._finished.extend(outputs)
        self._generated += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        self._prompt_tokens += sum(len(o.prompt_token_ids) for o in outputs)
        return outputs

    def get_metrics(self) -> dict:
        """Throughput, TTFT/TPOT statistics, prefix-cache hit rate, KV usage, preemptions."""
        stats = self.engine.stats()
        ttft = [o.metrics.ttft for o in self._finished if o.metrics.ttft is not None]
        tpot = []
        for o in self._finished:
            m, n = o.metrics, max((len(c.token_ids) for c in o.outputs), default=0)
            if n > 1 and m.finished_time and m.first_token_time:
                tpot.append((m.finished_time - m.first_token_time) / (n - 1))
        busy = self._busy_seconds or float("nan")
        queries = stats["prefix_cache_queries"]
        return {
            "num_requests": len(self._finished),
            "elapsed_s": self._busy_seconds,
            "prompt_tokens": self._prompt_tokens,
            "output_tokens": self._generated,
            "output_tokens_per_s": self._generated / busy,
            "throughput": self._generated / busy,  # vLLM's name: generated tokens/s
            "total_tokens_per_s": (self._generated + self._prompt_tokens) / busy,
            "requests_per_s": len(self._finished) / busy,
            "ttft_s": latency_summary(ttft),
            "tpot_s": latency_summary(tpot),
            "prefix_cache_hit_rate": stats["prefix_cache_hits"] / queries if queries else 0.0,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": stats["prefix_cache_hits"],
            "kv_cache_usage_perc": stats["kv_cache_usage_perc"],
            "num_preemptions": stats["num_preemptions"],
            "prefix_cache_hits_tier": stats["prefix_hits_tier"],
            "kv_promotions": stats["kv_promotions"],
            "kv_demotions": stats["kv_demotions"],
            "swap_in_blocks": stats["swap_in_blocks"],
            "swap_out_blocks": stats["swap_out_blocks"],
            "kv_waste_perc": stats["kv_waste_perc"],
            "model_weight_bytes": stats["model_weight_bytes"],
            "kv_bytes_per_token": stats["kv_bytes_per_token"],
            "kv_bytes_per_token_mha": stats["kv_bytes_per_token_mha"],
            "step_breakdown_s": self.engine.step_breakdown(),
            **{k: v for k, v in stats.items() if k.startswith("spec_decode_")},
        }


def _init_signature() -> inspect.Signature:
    """LLM.__init__ as if it listed every EngineConfig field, so help(), IDEs and `inspect` show them."""
    kind = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                annotation="str | None")]
    params += [inspect.Parameter(f.name, kind, default=f.default, annotation=f.type)
               for f in fields(EngineConfig) if f.name != "model"]
    params.append(inspect.Parameter("enable_metrics", kind, default=True, annotation="bool"))
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _init_signature()  # type: ignore[attr-defined]
