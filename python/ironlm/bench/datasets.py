"""Benchmark datasets: seeded lists of (prompt token ids, output length) requests.

`random`: prompt and output lengths drawn uniformly from closed ranges, token ids drawn uniformly.
`prefix`: one shared random prefix followed by a unique random suffix per request.
`sharegpt`: real ShareGPT V3 conversations, sampled and filtered as vLLM's benchmark does (bench/sharegpt.py).
`multiturn`: conversations under one shared system prompt (`MultiturnDataset`); a turn's prompt holds the
conversation's real history, so it is built while the benchmark runs (bench/multiturn.py drives it).

Token ids come from `[low, vocab_size)`; `low` skips the lowest ids, where tokenizers keep their
special tokens (BOS/EOS/padding/chat markers), so a random prompt never contains a control token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ironlm.bench.sharegpt import ShareGPTSpec
from ironlm.bench.sharegpt import sample as sharegpt_sample


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Dataset:
    name: str
    config: dict
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def summary(self) -> dict:
        plens = [r.prompt_len for r in self.requests]
        olens = [r.output_len for r in self.requests]
        return {"name": self.name, "config": self.config, "num_requests": len(self.requests),
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "prompt_len_min": min(plens, default=0), "prompt_len_max": max(plens, default=0),
                "output_len_min": min(olens, default=0), "output_len_max": max(olens, default=0)}


def token_floor(vocab_size: int) -> int:
    """The lowest token id random prompts use: above the special tokens of a real vocabulary."""
    return min(128, vocab_size // 8)


def _check_range(name: str, lo: int, hi: int) -> None:
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must be a range [lo, hi] with 1 <= lo <= hi, got [{lo}, {hi}]")


def _ids(rng: np.random.Generator, n: int, low: int, vocab_size: int) -> list[int]:
    return rng.integers(low, vocab_size, size=n).tolist()


@dataclass(frozen=True)
class RandomSpec:
    num_requests: int = 64
    input_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)
    seed: int = 0


@dataclass(frozen=True)
class PrefixSpec:
    num_requests: int = 64
    prefix_len: int = 1024
    suffix_len: int = 32
    output_len: int = 32
    seed: int = 0


def random_dataset(spec: RandomSpec, vocab_size: int) -> Dataset:
    _check_range("input_len", *spec.input_len)
    _check_range("output_len", *spec.output_len)
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    plens = rng.integers(spec.input_len[0], spec.input_len[1] + 1, size=n)
    olens = rng.integers(spec.output_len[0], spec.output_len[1] + 1, size=n)
    low = token_floor(vocab_size)
    reqs = [BenchRequest(_ids(rng, int(p), low, vocab_size), int(o)) for p, o in zip(plens, olens)]
    return Dataset("random", {**asdict(spec), "vocab_size": vocab_size, "token_low": low}, reqs)


def prefix_dataset(spec: PrefixSpec, vocab_size: int) -> Dataset:
    _check_range("prefix_len", 1, spec.prefix_len)
    _check_range("suffix_len", 1, spec.suffix_len)
    _check_range("output_len", 1, spec.output_len)
    rng = np.random.default_rng(spec.seed)
    low = token_floor(vocab_size)
    prefix = _ids(rng, spec.prefix_len, low, vocab_size)
    reqs = [BenchRequest(prefix + _ids(rng, spec.suffix_len, low, vocab_size), spec.output_len)
            for _ in range(spec.num_requests)]
    return Dataset("prefix", {**asdict(spec), "vocab_size": vocab_size, "token_low": low}, reqs)


DATASETS = ("random", "prefix", "sharegpt")


def make_dataset(name: str, vocab_size: int, *, random: RandomSpec | None = None,
                 prefix: PrefixSpec | None = None, sharegpt: ShareGPTSpec | None = None,
                 tokenizer: Any = None) -> Dataset:
    """`tokenizer`: the model's, for `sharegpt` (whose prompts are text); the others draw token ids."""
    if name == "random":
        return random_dataset(random or RandomSpec(), vocab_size)
    if name == "prefix":
        return prefix_dataset(prefix or PrefixSpec(), vocab_size)
    if name == "sharegpt":
        if tokenizer is None:
            raise ValueError("the sharegpt dataset needs the model's tokenizer")
        pairs, config = sharegpt_sample(sharegpt or ShareGPTSpec(), tokenizer)
        return Dataset("sharegpt", config, [BenchRequest(ids, n) for ids, n in pairs])
    raise ValueError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)}")


WARMUPS = ("full", "short", "none")


def warmup_dataset(name: str, vocab_size: int, mode: str, *, random: RandomSpec | None = None,
                   prefix: PrefixSpec | None = None, sharegpt: ShareGPTSpec | None = None,
                   tokenizer: Any = None) -> Dataset | None:
    """The untimed pass every engine and configuration gets before its first timed run.

    "full": the timed workload's shape drawn with the next seed, so that nothing the timed pass asks for is
    already in a prefix cache; "short": two 8-token prompts, 2 output tokens (allocator and kernels only);
    "none": no warm-up."""
    if mode not in WARMUPS:
        raise ValueError(f"warmup must be one of {WARMUPS}, got {mode!r}")
    if mode == "none":
        return None
    random, prefix = random or RandomSpec(), prefix or PrefixSpec()
    next_sharegpt = None if sharegpt is None else replace(sharegpt, seed=sharegpt.seed + 1)
    warm = make_dataset(name, vocab_size, random=replace(random, seed=random.seed + 1),
                        prefix=replace(prefix, seed=prefix.seed + 1), sharegpt=next_sharegpt, tokenizer=tokenizer)
    if mode == "short":
        warm.requests = [BenchRequest(r.prompt_token_ids[:8], 2) for r in warm.requests[:2]]
        warm.config = {**warm.config, "warmup": "short"}
    return warm


@dataclass(frozen=True)
class MultiturnSpec:
    num_conversations: int = 32
    turns: tuple[int, int] = (4, 8)
    system_len: int = 256  # the system prompt every conversation starts with
    user_len: tuple[int, int] = (32, 96)
    reply_len: int = 32  # assistant tokens per turn (EOS ignored, so the history's length is known up front)
    seed: int = 0


@dataclass(frozen=True)
class Conversation:
    user_turns: tuple[tuple[int, ...], ...]  # the user message of each turn

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)


@dataclass
class MultiturnDataset:
    """Turn k's prompt = system prompt + (user_j + the model's reply_j for j < k) + user_k.

    The replies are whatever the engine generated for the earlier turns, so prompts exist only at run time;
    their lengths do not depend on the replies' content (every reply is `reply_len` tokens)."""

    config: dict
    system_prompt: list[int]
    reply_len: int
    conversations: list[Conversation] = field(default_factory=list)
    name: str = "multiturn"

    def prompt(self, history: list[int], conversation: int, turn: int) -> list[int]:
        """`history`: the conversation's previous prompt and reply (empty before turn 0)."""
        base = history if turn else self.system_prompt
        return base + list(self.conversations[conversation].user_turns[turn])

    def prompt_len(self, conversation: int, turn: int) -> int:
        users = self.conversations[conversation].user_turns[:turn + 1]
        return len(self.system_prompt) + sum(map(len, users)) + turn * self.reply_len

    @property
    def num_requests(self) -> int:
        return sum(c.num_turns for c in self.conversations)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_len(i, k) for i, c in enumerate(self.conversations) for k in range(c.num_turns))

    @property
    def output_tokens(self) -> int:
        return self.num_requests * self.reply_len

    def working_set_tokens(self) -> int:
        """Peak KV, in tokens, that every live conversation's history needs (the system prompt once).

        Conversations advance about one turn per round (turn k+1 waits for turn k), so round k holds each
        conversation that has a turn k at its history through that turn's reply; the peak is over rounds."""
        system = len(self.system_prompt)
        rounds = max((c.num_turns for c in self.conversations), default=0)
        peak = 0
        for k in range(rounds):
            live = [i for i, c in enumerate(self.conversations) if c.num_turns > k]
            peak = max(peak, system + sum(self.prompt_len(i, k) + self.reply_len - system for i in live))
        return peak

    def summary(self) -> dict:
        turns = [c.num_turns for c in self.conversations]
        return {"name": self.name, "config": self.config, "num_conversations": len(self.conversations),
                "num_requests": self.num_requests, "turns_min": min(turns, default=0),
                "turns_max": max(turns, default=0), "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "working_set_tokens": self.working_set_tokens()}


def multiturn_dataset(spec: MultiturnSpec, vocab_size: int) -> MultiturnDataset:
    if spec.num_conversations < 1:
        raise ValueError(f"num_conversations must be >= 1, got {spec.num_conversations}")
    _check_range("turns", *spec.turns)
    _check_range("system_len", 1, spec.system_len)
    _check_range("user_len", *spec.user_len)
    _check_range("reply_len", 1, spec.reply_len)
    rng = np.random.default_rng(spec.seed)
    low = token_floor(vocab_size)
    system = _ids(rng, spec.system_len, low, vocab_size)
    conversations = []
    for _ in range(spec.num_conversations):
        n = int(rng.integers(spec.turns[0], spec.turns[1] + 1))
        lens = rng.integers(spec.user_len[0], spec.user_len[1] + 1, size=n)
        conversations.append(Conversation(tuple(tuple(_ids(rng, int(m), low, vocab_size)) for m in lens)))
    config = {**asdict(spec), "vocab_size": vocab_size, "token_low": low}
    return MultiturnDataset(config, system, spec.reply_len, conversations)
