"""Engine and server configuration: every setting, its one default and its help text.

`EngineConfig` is the single source: `LLM(**kwargs)` accepts exactly its fields and `ironlm serve/generate/
chat` derive one flag per field from it (ironlm.cli_args), so a new field needs no edit anywhere else. Defaults
that depend on the device (token budget, context cap, CPU KV pool) live here too, as `resolve_*` methods, so
the engine never carries a number of its own. Help text goes in `field(metadata={"help": ...})`.

`ServerConfig` is the same for `ironlm serve`'s HTTP/gRPC settings: one flag per field, generated the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ironlm.exceptions import InvalidArgumentError
from ironlm.spec_config import SpeculativeConfig, parse_speculative_config

SCHEDULING_POLICIES = ("fcfs", "priority", "deadline", "fair")
PREEMPTION_MODES = ("aggressive", "conservative")
# Here rather than in ironlm.attention so that config validation and the CLIs need no torch import.
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
DISTRIBUTED_BACKENDS = ("mp", "torchrun")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# The activations' names and vLLM's 8-bit ones (fp8 = fp8_e4m3); what each picks: engine.kv_cache.resolve_kv_dtype
KV_CACHE_DTYPES = (*DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8", "awq", "gptq", "compressed-tensors")
QUANT_GROUP_SIZES = (32, 64, 128)
# ironlm.structured.tool_parsers.PARSERS' names (tests check they agree); here so the CLI needs no import.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
# ironlm.server.reasoning.PARSERS (tests check they agree).
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
RUNNERS = ("generate", "pooling")
TASKS = ("generate", "embed", "score", "classify")
POOLING_TYPES = ("last", "mean", "cls")
SCORE_MODES = ("auto", "classify", "yes_no", "cosine")
_DTYPE_ALIASES = ("fp32", "fp16", "bf16", "half", "float")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}

_CPU_TOKEN_BUDGET = 2048
_GPU_TOKEN_BUDGET = 8192
# On CPU the model's advertised context (e.g. 8k+) rarely fits a sensible KV pool; cap the default.
_CPU_MAX_MODEL_LEN = 8192
_CPU_KV_CACHE_BYTES = 1 << 30


def _invalid(param: str, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{param}: {reason}", param)


def parse_bytes(value: int | str | None, field: str = "kv_cache_memory") -> int | None:
    """`2GiB`, `512MB`, `1e9` or a plain int → bytes."""
    if value is None or isinstance(value, int):
        if isinstance(value, bool) or (isinstance(value, int) and value <= 0):
            raise _invalid(field, f"must be > 0, got {value!r}")
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise _invalid(field, f"must be bytes or a size such as '2GiB', got {value!r}")
    try:
        number = float(match.group(1))
    except ValueError:
        raise _invalid(field, f"must be bytes or a size such as '2GiB', got {value!r}") from None
    size = int(number * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise _invalid(field, f"must be > 0, got {value!r}")
    return size


def parse_tenant_weights(value: str | dict[str, float] | None) -> dict[str, float] | None:
    """`a=2,b=1` (or a dict) → {tenant: share}; every share a finite number > 0, each tenant once."""
    if value is None or value == "":
        return None
    pairs: list[tuple[str, Any]]
    if isinstance(value, dict):
        pairs = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, str):
        pairs = []
        for item in value.split(","):
            name, sep, weight = item.partition("=")
            if not sep or not name.strip():
                raise _invalid("tenant_weights", f"expected NAME=WEIGHT[,NAME=WEIGHT...], got {value!r}")
            pairs.append((name.strip(), weight.strip()))
    else:
        raise _invalid("tenant_weights", f"expected 'a=2,b=1' or a dict, got {type(value).__name__}")
    out: dict[str, float] = {}
    for name, weight in pairs:
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise _invalid("tenant_weights", f"weight of {name!r} is not a number: {weight!r}") from None
        if not (math.isfinite(w) and w > 0):
            raise _invalid("tenant_weights", f"weight of {name!r} must be > 0, got {weight!r}")
        if name in out:
            raise _invalid("tenant_weights", f"tenant {name!r} given twice")
        out[name] = w
    return out


def _check_ints(config: object, names: tuple[str, ...], low: int, optional: bool = False) -> None:
    """Each named field an int (a bool is not) >= `low`; None passes where `optional`."""
    for name in names:
        value = getattr(config, name)
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            what = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise _invalid(name, f"must be {what}, got {value!r}")


def _opt(default: Any, help: str, **cli: Any) -> Any:
    """A config field with its help text; `cli` holds argparse extras (choices, metavar, nargs)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    model: str | None = _opt(
        None, "HF model folder or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
    served_model_name: str | None = _opt(
        None, "name clients use for the model (serve takes several; the first is reported in responses)")
    dtype: str = _opt("auto", "activations and KV dtype (and dense weights'); auto = bfloat16 on GPU and on CPUs with "
        "native bf16, float32 on other CPUs and with quantized weights", choices=DTYPES)
    quantization: str = _opt(
        "auto", "weight storage: auto = keep what the file has (a GGUF's quantized blocks stay quantized on CPU), "
        "none = dequantize to dtype, int8 / int4 = quantize the linears at load (CPU kernels of the core, a Triton "
        "kernel on GPU), fp8 = e4m3 weights on GPUs with FP8 tensor cores (sm_89+); a checkpoint's own "
        "quantization_config (AWQ, GPTQ, compressed-tensors, FP8) is kept by auto or its method's name, none "
        "loads its exact dense weights", choices=QUANTIZATIONS)
    quantization_group_size: int | None = _opt(
        None, "weights per scale for int8/int4 (default: per output channel for int8, 32 for int4)",
        choices=QUANT_GROUP_SIZES)
    kv_cache_dtype: str = _opt(
        "auto", "KV cache element type: auto = the activations' dtype, except 16-bit where they are float32 only "
        "because quantized weights run on the CPU kernels (a GGUF's blocks, int8/int4, under dtype auto), as "
        "llama.cpp's default f16 cache: bfloat16 on CPUs with native bf16 (prompts then attend on the core's bf16 "
        "tiles), float16 elsewhere; float16 or bfloat16 under float32 activations on CPU halve the bytes every "
        "decode step reads and double the tokens the pool holds; fp8 (= fp8_e4m3) and fp8_e5m2 (CPU, under float32 "
        "or bfloat16 activations) store 8-bit floats, halving a 16-bit cache again, without scales (values past "
        "e4m3's +-448 saturate, as vLLM's with its default scale 1.0); rows are rounded once, on the write",
        choices=KV_CACHE_DTYPES)
    device: str = _opt("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    block_size: int = _opt(16, "tokens per KV block (power of two)")
    kv_cache_memory: int | str | None = _opt(
        None, "KV cache size, bytes or e.g. '2GiB' (default: 1 GiB on CPU, what gpu_memory_utilization "
        "leaves free on GPU)")
    num_kv_blocks: int | None = _opt(None, "KV blocks (overrides kv_cache_memory)")
    gpu_memory_utilization: float = _opt(0.9, "share of GPU memory the engine may use, KV cache included")
    max_model_len: int | None = _opt(
        None, "max prompt + output tokens per request (default: the model's context, capped to 8192 on CPU)")
    max_num_seqs: int = _opt(256, "max sequences in one batch")
    max_num_batched_tokens: int | None = _opt(
        None, "token budget per step (default: 2048 on CPU, 8192 on GPU, at least max_num_seqs)")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prompt prefixes")
    scheduling_policy: str = _opt(
        "fcfs", "order of waiting requests; fair = fair share across tenants (the OpenAI `user` field or the "
        "X-Tenant header) by virtual token counters, within each priority", choices=SCHEDULING_POLICIES)
    preemption: str = _opt(
        "aggressive", "admission under KV pressure: aggressive = admit every waiting request whose next chunk fits "
        "now and, when blocks run out, preempt the latest running one (recompute; swap with swap_space); "
        "conservative = admit a request only while free and evictable blocks cover what it and every running "
        "request still need to reach max_tokens (SGLang-style), so running requests are rarely preempted, at the "
        "cost of smaller batches", choices=PREEMPTION_MODES)
    tenant_weights: str | None = _opt(
        None, "fair-share weights of named tenants, e.g. 'a=2,b=1' (others get 1)", metavar="NAME=W,...")
    fair_input_token_weight: float = _opt(1.0, "cost of a prefill token in the fair-share counters")
    fair_output_token_weight: float = _opt(2.0, "cost of a generated token in the fair-share counters (VTC's 2)")
    scheduler_delay_factor: float = _opt(
        0.0, "while sequences run, admit new requests only once this x the last step time has passed since the "
        "last admission, to batch prefills (vLLM's flag; 0 = off)")
    max_queue_len: int | None = _opt(None, "waiting requests beyond this are refused (HTTP 503)")
    queue_timeout: float | None = _opt(
        None, "seconds a request may wait in the queue before it finishes with reason 'timeout' (a request's "
        "own `timeout` over HTTP/gRPC bounds the whole request, its wait included)", metavar="S")
    attention_backend: str = _opt("auto", "attention implementation", choices=ATTENTION_BACKENDS)
    seed: int = _opt(0, "seed of the engine's sampler (requests may bring their own)")
    grammar_compile_timeout: float = _opt(
        10.0, "seconds a structured-output grammar (JSON schema, regex, ...) may take to compile before its request "
        "fails with a 400", metavar="S")
    grammar_cache_size: int = _opt(256, "compiled structured-output grammars kept for reuse (LRU)")
    warmup: bool = _opt(True, "run one forward at startup so the first request is not the slow one")
    enforce_eager: bool = _opt(
        False, "never replay CUDA graphs: by default a GPU engine captures its decode step for batch sizes 1, 2, 4 "
        "and every multiple of 8 up to max_num_seqs (at most 256) at startup and replays them, padding a batch to "
        "the next size (vLLM's flag; CPU engines always run eager)")
    tensor_parallel_size: int = _opt(1, "ranks the model is sharded over (Megatron-style; gloo on CPU, nccl on GPU)")
    enable_expert_parallel: bool = _opt(
        False, "with tensor_parallel_size > 1: split each MoE layer's routed experts across the ranks (each loads "
        "and runs only its own; one all-reduce combines), attention staying tensor parallel")
    distributed_executor_backend: str = _opt(
        "mp", "how tensor-parallel ranks start: mp = ironlm spawns them on this node, torchrun = launched by "
        "torchrun (rank 0 serves, the others run the worker loop)", choices=DISTRIBUTED_BACKENDS)
    distributed_timeout: float = _opt(
        120.0, "seconds a tensor-parallel collective may wait for the other ranks before the engine is declared "
        "dead", metavar="S")
    # The KV hierarchy (a tier under the device pool's radix cache; engine/kv/tier.py).
    kv_offload_memory: int | str | None = _opt(
        None, "host-memory KV tier under the prefix cache, bytes or e.g. '16GiB' (pinned memory on GPU): evicted "
        "prefix blocks are copied there and copied back on a hit instead of being recomputed")
    kv_offload_dir: str | None = _opt(
        None, "folder of a disk KV tier (a memory-mapped file, kv_offload_size large) under the prefix cache; it "
        "persists across restarts of the same model, dtype and block size")
    kv_offload_size: int | str = _opt("4GiB", "size of the disk KV tier in kv_offload_dir, bytes or e.g. '4GiB'")
    swap_space: float = _opt(
        0.0, "GiB of host memory a preempted request's KV blocks are swapped to and back from when copying beats "
        "recomputing (vLLM's flag; 0 = off). Swaps into kv_offload_memory/kv_offload_dir instead when one is set",
        metavar="GIB")
    # Pooling models (engine/pooling.py): embeddings and (query, document) scores instead of generated text.
    runner: str = _opt(
        "generate", "generate = a causal LM (completions, chat); pooling = the decoder as an embedding or scoring "
        "model: prefill only, no sampling (/v1/embeddings, /v1/score, /v1/rerank, LLM.embed / LLM.score)",
        choices=RUNNERS)
    task: str | None = _opt(
        None, "vLLM's older spelling: embed / score = --runner pooling, classify = that with --score-mode classify, "
        "generate = --runner generate", choices=TASKS)
    pooling_type: str = _opt(
        "last", "--runner pooling: one vector per prompt from its final-norm hidden states: last = the last token "
        "(Qwen3-Embedding, e5-mistral), mean = the prompt's mean, cls = the first token. mean and cls bypass the "
        "prefix cache (a cache hit skips the rows they average or take)", choices=POOLING_TYPES)
    normalize: bool = _opt(True, "--runner pooling: L2-normalise embeddings (after any `dimensions` truncation)")
    score_mode: str = _opt(
        "auto", "--runner pooling: how a (query, document) pair is scored: classify = the checkpoint's "
        "sequence-classification head (score.weight; sigmoid of a single label, else softmax's last label), "
        "yes_no = softmax over the two score_tokens' logits at the last position (Qwen3-Reranker), cosine = cosine "
        "similarity of the two embeddings; auto = classify when the checkpoint has a head, else cosine",
        choices=SCORE_MODES)
    score_template: str | None = _opt(
        None, "--runner pooling: the prompt of a scored pair, with {query} and {document} (default: Qwen3-Reranker's "
        "for yes_no, the two texts one after the other for classify)", metavar="TEXT")
    score_tokens: str = _opt(
        "yes,no", "--runner pooling, score_mode yes_no: the positive and the negative token, each a text that is "
        "one token or a token id", metavar="YES,NO")
    speculative_config: str | Mapping[str, Any] | None = _opt(
        None, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' (n-gram prompt lookup in the core; greedy and seeded "
        "outputs unchanged; a measured cost model pauses it on steps it would slow down, \"cost_model\": false "
        "turns that off, \"max_batch_tokens\": N caps decode rows + proposals), or a draft "
        "model sharing the tokenizer: '{\"model\": PATH, \"num_speculative_tokens\": 4}' (greedy output unchanged, "
        "sampled output exactly the target's distribution)", metavar="JSON")
    kv_pin_prefix: tuple[str, ...] = _opt(
        (), "texts prefilled at startup whose whole KV blocks stay on the device for good: a shared prompt start "
        "as the model sees it (for chat, the rendered template up to the end of the system message)",
        nargs="*", metavar="TEXT")
    batch_invariant: bool = _opt(
        False, "CPU: every token's logits a function of its sequence alone, whatever shares the step (int8 kernels "
        "at every batch size, fixed-tile dense GEMMs, per-row attention; see README 'Batch invariance')")

    def __post_init__(self) -> None:
        _check_ints(self, ("block_size", "max_num_seqs", "num_kv_blocks", "max_model_len", "max_num_batched_tokens",
                           "max_queue_len"), 1, optional=True)
        _check_ints(self, ("tensor_parallel_size",), 1)
        _check_ints(self, ("grammar_cache_size",), 0)
        if self.block_size & (self.block_size - 1):
            raise _invalid("block_size", f"must be a power of two, got {self.block_size}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise _invalid("scheduling_policy",
                           f"must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if self.dtype not in DTYPES + _DTYPE_ALIASES:
            raise _invalid("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES + _DTYPE_ALIASES:
            raise _invalid("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise _invalid("attention_backend",
                           f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _invalid("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.preemption not in PREEMPTION_MODES:
            raise _invalid("preemption", f"must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption!r}")
        parse_tenant_weights(self.tenant_weights)
        self.speculation()
        for name in ("fair_input_token_weight", "fair_output_token_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise _invalid(name, f"must be a number > 0, got {value!r}")
        delay = self.scheduler_delay_factor
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not (math.isfinite(delay) and delay >= 0):
            raise _invalid("scheduler_delay_factor", f"must be a number >= 0, got {delay!r}")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise _invalid("queue_timeout", f"must be > 0, got {self.queue_timeout}")
        if not self.grammar_compile_timeout > 0:
            raise _invalid("grammar_compile_timeout", f"must be > 0, got {self.grammar_compile_timeout!r}")
        parse_bytes(self.kv_cache_memory)
        if self.distributed_executor_backend not in DISTRIBUTED_BACKENDS:
            raise _invalid("distributed_executor_backend", f"must be one of {', '.join(DISTRIBUTED_BACKENDS)}, "
                           f"got {self.distributed_executor_backend!r}")
        if not self.distributed_timeout > 0:
            raise _invalid("distributed_timeout", f"must be > 0, got {self.distributed_timeout!r}")
        if self.quantization not in QUANTIZATIONS:
            raise _invalid("quantization", f"must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        group = self.quantization_group_size
        if group is not None and group not in QUANT_GROUP_SIZES:
            raise _invalid("quantization_group_size",
                           f"must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}, got {group!r}")
        self._check_kv_tier()
        self._check_pooling()

    def _check_pooling(self) -> None:
        if self.task is not None:
            if self.task not in TASKS:
                raise _invalid("task", f"must be one of {', '.join(TASKS)}, got {self.task!r}")
            runner = "generate" if self.task == "generate" else "pooling"
            if self.runner != "generate" and self.runner != runner:
                raise _invalid("task", f"task {self.task} contradicts runner {self.runner}")
            self.runner = runner
            if self.task == "classify" and self.score_mode == "auto":
                self.score_mode = "classify"
        for name, choices in (("runner", RUNNERS), ("pooling_type", POOLING_TYPES), ("score_mode", SCORE_MODES)):
            if getattr(self, name) not in choices:
                raise _invalid(name, f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if not isinstance(self.normalize, bool):
            raise _invalid("normalize", f"must be true or false, got {self.normalize!r}")
        template = self.score_template
        if template is not None and (not isinstance(template, str) or "{query}" not in template
                                     or "{document}" not in template):
            raise _invalid("score_template", f"must contain {{query}} and {{document}}, got {template!r}")
        if not isinstance(self.score_tokens, str) or len(self.score_tokens.split(",")) != 2:
            raise _invalid("score_tokens", f"must be two tokens as 'YES,NO', got {self.score_tokens!r}")
        if self.runner != "pooling":
            return
        if self.tensor_parallel_size > 1:
            raise _invalid("tensor_parallel_size", "--runner pooling runs on one rank")
        if self.pooling_bypasses_cache() and (self.kv_tier_kind() is not None or self.kv_pin_prefix):
            raise _invalid("pooling_type", f"{self.pooling_type} pooling bypasses the prefix cache, so a KV tier or "
                           "pinned prefixes would serve nothing")

    def pooling_bypasses_cache(self) -> bool:
        """mean and cls pooling read prompt rows a prefix-cache hit would not compute: the engine runs them with
        the prefix cache off (last-token pooling and scoring use it)."""
        return self.runner == "pooling" and self.pooling_type != "last"

    def _check_kv_tier(self) -> None:
        parse_bytes(self.kv_offload_memory, "kv_offload_memory")
        if self.kv_offload_size is None:
            raise _invalid("kv_offload_size", "must be bytes or a size such as '4GiB', got None")
        parse_bytes(self.kv_offload_size, "kv_offload_size")
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir):
            raise _invalid("kv_offload_dir", f"must be a folder path, got {self.kv_offload_dir!r}")
        if self.kv_offload_memory is not None and self.kv_offload_dir is not None:
            raise _invalid("kv_offload_dir", "one KV tier at a time: kv_offload_memory is set too")
        swap = self.swap_space
        if isinstance(swap, bool) or not isinstance(swap, (int, float)) or not (math.isfinite(swap) and swap >= 0):
            raise _invalid("swap_space", f"must be a number of GiB >= 0, got {swap!r}")
        pins = self.kv_pin_prefix
        if isinstance(pins, str) or not isinstance(pins, (list, tuple)) or not all(
                isinstance(p, str) and p for p in pins):
            raise _invalid("kv_pin_prefix", f"must be a list of non-empty texts, got {pins!r}")
        if self.kv_tier_kind() is not None and not self.enable_prefix_caching:
            name = "kv_offload_dir" if self.kv_offload_dir is not None else (
                "kv_offload_memory" if self.kv_offload_memory is not None else "swap_space")
            raise _invalid(name, "a KV tier lives under the prefix cache: it needs enable_prefix_caching")
        if pins and not self.enable_prefix_caching:
            raise _invalid("kv_pin_prefix", "pinned prefixes live in the prefix cache: it needs enable_prefix_caching")

    def kv_tier_kind(self) -> str | None:
        """"memory", "disk" or None: the tier under the device pool these settings ask for."""
        if self.kv_offload_dir is not None:
            return "disk"
        if self.kv_offload_memory is not None or self.swap_space > 0:
            return "memory"
        return None

    def resolve_kv_tier_bytes(self) -> int:
        """Bytes of the KV tier (0 = none): kv_offload_memory, kv_offload_size with a folder, else swap_space GiB."""
        kind = self.kv_tier_kind()
        if kind == "disk":
            return parse_bytes(self.kv_offload_size, "kv_offload_size") or 0
        if self.kv_offload_memory is not None:
            return parse_bytes(self.kv_offload_memory, "kv_offload_memory") or 0
        return int(self.swap_space * 1024**3)

    def speculation(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (None: off)."""
        return parse_speculative_config(self.speculative_config)

    def tenant_weight_map(self) -> dict[str, float] | None:
        """`tenant_weights` parsed: {tenant: share}."""
        return parse_tenant_weights(self.tenant_weights)

    def scheduler_config(self, *, num_blocks: int, max_num_batched_tokens: int, max_model_len: int,
                         tier_blocks: int, sliding_window: int | None) -> SchedulerConfig:
        """The core scheduler's settings, given what only a loaded engine knows: its KV pool, token budget and
        context length, its tier's slots and the widest sliding window when every layer slides (else None)."""
        return SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            policy=self.scheduling_policy,
            enable_prefix_caching=self.enable_prefix_caching and not self.pooling_bypasses_cache(),
            # The capacity is max_num_seqs running + max_queue_len waiting (checked in add_request): requests that
            # arrive together all wait until the next step schedules them, so the core's waiting bound is the sum.
            max_queue_len=None if self.max_queue_len is None else self.max_queue_len + self.max_num_seqs,
            tenant_weights=self.tenant_weight_map() or {}, input_token_weight=self.fair_input_token_weight,
            output_token_weight=self.fair_output_token_weight, scheduler_delay_factor=self.scheduler_delay_factor,
            tier_blocks=tier_blocks, swap=self.swap_space > 0, sliding_window=sliding_window,
            reserve_decode=self.preemption == "conservative")

    # ---- defaults that depend on where the engine runs --------------------------------------------------
    def resolve_max_num_batched_tokens(self, device_type: str) -> int:
        """The per-step token budget: the configured one, else a device default of at least max_num_seqs."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        default = _CPU_TOKEN_BUDGET if device_type == "cpu" else _GPU_TOKEN_BUDGET
        return max(default, self.max_num_seqs)

    def resolve_max_model_len(self, native: int, device_type: str) -> int:
        """The configured context length, else the model's own (`native`), capped on CPU."""
        if self.max_model_len is not None:
            return self.max_model_len
        return native if device_type == "cuda" else min(native, _CPU_MAX_MODEL_LEN)

    def resolve_kv_cache_memory(self, device_type: str) -> int | None:
        """KV pool bytes: the configured size; on CPU 1 GiB by default; None = profile free GPU memory."""
        size = parse_bytes(self.kv_cache_memory)
        if size is None and device_type == "cpu":
            return _CPU_KV_CACHE_BYTES
        return size


@dataclass(frozen=True)
class SchedulerConfig:
    """What the core's `Scheduler` is built from (`_core.Scheduler(config)` reads these attributes). No field has a
    default: `EngineConfig.scheduler_config` fills it from the engine's settings and the sizes known once the model
    is loaded, so the defaults live in EngineConfig alone."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str
    enable_prefix_caching: bool
    max_queue_len: int | None
    tenant_weights: dict[str, float]
    input_token_weight: float
    output_token_weight: float
    scheduler_delay_factor: float
    tier_blocks: int
    swap: bool
    sliding_window: int | None
    reserve_decode: bool


@dataclass
class ServerConfig:
    """Settings of the HTTP/gRPC front end (`ironlm serve`), not of the engine: one flag per field."""

    host: str = _opt("127.0.0.1", "address to bind (loopback by default)")
    port: int = _opt(8000, "HTTP port")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' (default: $IRONLM_API_KEY)")
    grpc_port: int | None = _opt(None, "also serve gRPC on this port")
    drain_timeout: float = _opt(30.0, "seconds in-flight requests get to finish after SIGTERM")
    health_stall_timeout: float = _opt(300.0, "/health answers 503 once one engine step has run this many seconds",
                                       metavar="S")
    log_level: str = _opt("info", "log level", choices=("debug", "info", "warning", "error"))
    # Overload and faults (server/breaker.py, server/shedding.py, the engine loop's restart).
    circuit_breaker: bool = _opt(True, "refuse new requests (503) for a cool-down when too many recent ones failed")
    circuit_breaker_threshold: float = _opt(
        0.05, "server-side error rate (5xx, not 503) over the last --circuit-breaker-window requests that opens it")
    circuit_breaker_window: int = _opt(100, "requests the breaker's error rate is measured over")
    circuit_breaker_min_requests: int = _opt(20, "finished requests the window needs before the breaker may open")
    circuit_breaker_cooldown: float = _opt(10.0, "seconds the open breaker refuses requests before probing",
                                           metavar="S")
    circuit_breaker_probes: int = _opt(3, "requests let through half-open; all succeed: closed, one fails: open")
    load_shedding: bool = _opt(True, "refuse (503 + Retry-After) at once requests the queue cannot serve in time")
    shed_max_wait: float | None = _opt(
        None, "refuse (503) a request without its own timeout whose estimated queue wait exceeds this; requests "
        "with a timeout are refused when the estimate exceeds it", metavar="S")
    shed_priority_waiting: int | None = _opt(
        None, "refuse (503) a request when this many requests of a better priority are waiting (default: half of "
        "--max-queue-len when that is set, else off)")
    engine_restart_after_failures: int = _opt(
        3, "failed engine steps in a row that restart the engine loop (failing its in-flight requests)")
    engine_max_restarts: int = _opt(
        2, "loop restarts in a row without a good step before the engine is declared dead (/health 503)")
    # Request dedupe (engine/dedupe.py): off by default, since shared requests no longer count one queue place each.
    dedupe_requests: bool = _opt(
        False, "identical deterministic requests (greedy, or the same seed) in flight share one engine sequence")
    result_cache_size: int = _opt(
        0, "finished deterministic results kept (LRU) to answer identical later requests without the engine; 0 = off")
    # Hostile clients (server/guards.py, server/http_limits.py).
    max_request_bytes: int = _opt(16 * 1024**2, "largest request body accepted (413 beyond it, counted while reading)",
                                  metavar="BYTES")
    max_prompts_per_request: int = _opt(64, "most prompts one /v1/completions request may carry in its list")
    max_request_logprobs: int = _opt(
        200_000, "most logprob entries one request may ask for: prompts x n x max_tokens x top logprobs (a 400 "
        "beyond it; n=128 with 20 logprobs each would stream megabytes from a 150-byte request)")
    timeout_keep_alive: float = _opt(5.0, "seconds an idle keep-alive connection stays open", metavar="S")
    timeout_request_header: float = _opt(
        10.0, "seconds a client has to send a complete request head, from connecting or from its previous "
        "response (slow-headers clients are cut off)", metavar="S")
    max_request_header_bytes: int = _opt(64 * 1024, "largest request line + headers accepted (431 beyond it)",
                                         metavar="BYTES")
    timeout_request_body: float = _opt(
        60.0, "seconds a client has to send its whole request body once the head is complete (408 beyond it: "
        "slow-body clients are cut off)", metavar="S")
    max_connections_per_client: int = _opt(
        1024, "open connections one client address may hold; more get 429 and are closed (0: no cap, e.g. behind "
        "a proxy that all clients share)")
    max_request_drain_bytes: int = _opt(
        64 * 1024**2, "a refused request's body (413, 408, ...) is read and discarded up to this many bytes so the "
        "client can read the answer instead of a connection reset; beyond it the connection closes at once",
        metavar="BYTES")
    allowed_origins: tuple[str, ...] = _opt((), "CORS: origins browsers may call from ('*' for any; default: no "
                                            "CORS headers at all)", nargs="*")
    allowed_methods: tuple[str, ...] = _opt(("GET", "POST"), "CORS: allowed methods", nargs="*")
    allowed_headers: tuple[str, ...] = _opt(("Authorization", "Content-Type"), "CORS: allowed request headers",
                                            nargs="*")
    allow_credentials: bool = _opt(False, "CORS: allow credentials (cookies, HTTP auth)")
    chat_template: str | None = _opt(
        None, "chat template for every chat request instead of the model's: a file path or the Jinja text itself")
    trust_request_chat_template: bool = _opt(
        False, "let requests bring their own `chat_template` (rendered sandboxed, time- and size-bounded)")
    tool_call_parser: str = _opt(
        "auto", "how tool calls are read from chat output with tool_choice auto (auto: from the chat template, then "
        "the model type)", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str = _opt(
        "auto", "split a reasoning model's <think>...</think> text into message.reasoning_content (and reasoning) "
        "apart from content; auto: qwen3 (or deepseek_r1 for DeepSeek's) when the chat template writes <think>, "
        "else none", choices=REASONING_PARSERS)
    # The Responses API's in-memory store (server/response_store.py), for previous_response_id and GET/DELETE.
    response_store_size: int = _opt(
        1000, "finished /v1/responses results kept in memory (LRU) for previous_response_id; 0 = off (nothing "
        "stored, previous_response_id refused)")
    response_store_max_chars: int = _opt(
        64 * 1024**2, "characters (of JSON) the response store may hold in all; the least recently used go first")

    def __post_init__(self) -> None:
        _check_ints(self, ("circuit_breaker_window", "circuit_breaker_min_requests", "circuit_breaker_probes",
                           "engine_restart_after_failures", "shed_priority_waiting"), 1, optional=True)
        _check_ints(self, ("result_cache_size", "response_store_size"), 0)
        _check_ints(self, ("response_store_max_chars",), 1)
        if not isinstance(self.engine_max_restarts, int) or self.engine_max_restarts < 0:
            raise _invalid("engine_max_restarts", f"must be an integer >= 0, got {self.engine_max_restarts!r}")
        if not 0.0 <= self.circuit_breaker_threshold < 1.0:
            raise _invalid("circuit_breaker_threshold", f"must be in [0, 1), got {self.circuit_breaker_threshold!r}")
        if self.circuit_breaker_min_requests > self.circuit_breaker_window:
            raise _invalid("circuit_breaker_min_requests", f"must be <= circuit_breaker_window "
                           f"({self.circuit_breaker_window}), got {self.circuit_breaker_min_requests}")
        for name in ("circuit_breaker_cooldown", "shed_max_wait"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise _invalid(name, f"must be > 0, got {value!r}")
        for name in ("port", "grpc_port"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= 65535):
                raise _invalid(name, f"must be a port number in [0, 65535], got {value!r}")
        for name in ("drain_timeout", "health_stall_timeout"):
            if not getattr(self, name) > 0:
                raise _invalid(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise _invalid("tool_call_parser", f"must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                           f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise _invalid("reasoning_parser", f"must be one of {', '.join(REASONING_PARSERS)}, "
                           f"got {self.reasoning_parser!r}")
        self._check_client_limits()

    def _check_client_limits(self) -> None:
        _check_ints(self, ("max_request_bytes", "max_prompts_per_request", "max_request_header_bytes",
                           "max_request_drain_bytes", "max_request_logprobs"), 1)
        _check_ints(self, ("max_connections_per_client",), 0)
        for name in ("timeout_keep_alive", "timeout_request_header", "timeout_request_body"):
            if not getattr(self, name) > 0:
                raise _invalid(name, f"must be > 0, got {getattr(self, name)!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise _invalid(name, f"must be a list of strings, got {value!r}")
            setattr(self, name, tuple(value))  # argparse hands over lists
