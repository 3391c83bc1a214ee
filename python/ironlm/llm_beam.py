"""`LLM.beam_search` (vLLM's offline beam search) over the engine's one-token steps (engine/beam_search.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from tqdm.auto import tqdm

from ironlm.engine.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchParams,
    advance_all,
    capped_max_tokens,
    finish,
    pending_prompts,
    step_params,
)
from ironlm.engine.prompts import encode_prompt
from ironlm.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from ironlm.engine.llm_engine import LLMEngine
    from ironlm.engine.outputs import RequestOutput
    from ironlm.engine.prompts import PromptType
    from ironlm.sampling_params import SamplingParams

# LLM.generate without its progress bar (this module cannot name LLM: ironlm.llm imports it).
Generate = Callable[[list[dict], "SamplingParams"], list["RequestOutput"]]


def beam_search(engine: LLMEngine, generate: Generate, prompts: PromptType | Sequence[PromptType],
                params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    if not isinstance(params, BeamSearchParams):
        raise InvalidArgumentError(f"params must be a BeamSearchParams, got {type(params).__name__}", param="params")
    one = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                and isinstance(prompts[0], int))
    prompt_list = cast("list[PromptType]", [prompts] if one else list(prompts))
    eos = list(engine.model_config.eos_token_ids)
    sp = step_params(params, len(eos))
    instances = []
    for p in prompt_list:
        ids = encode_prompt(engine.tokenizer, p, engine.model_config.vocab_size)[1]
        instances.append(BeamSearchInstance(ids, params, eos, capped_max_tokens(params, len(ids), engine.max_model_len)))
    bar = tqdm(total=params.max_tokens, desc="Beam search", unit="tok", disable=not use_tqdm)
    try:
        while batch := pending_prompts(instances):
            advance_all(instances, generate([{"prompt_token_ids": b} for b in batch], sp))
            bar.update(1)
    finally:
        bar.close()
    return [finish(inst, engine.tokenizer) for inst in instances]
