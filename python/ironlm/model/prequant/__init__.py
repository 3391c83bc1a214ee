"""Pre-quantized checkpoints (AWQ, GPTQ, compressed-tensors, FP8): read `config.json`'s `quantization_config`,
unpack each quantized linear exactly into the core's 32-blocks (`_core.QuantMatrix.from_parts`) and install them.

    scheme = detect(path, quantization)        # None: not pre-quantized (and not asked to be)
    spec = spec_for(scheme, device, tp)        # the QuantSpec the load runs under
    load(model, path, scheme, keep=spec.enabled)

`--quantization` `auto` and the checkpoint's own method keep its integers quantized on the CPU's int8 kernels;
`none` loads their exact dequantization dense; anything else is refused, naming the field. FP8 weights are not
affine integers: on the CPU they load as dense f32, exactly (see fp8.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ironlm.exceptions import InvalidArgumentError, UnsupportedModelError
from ironlm.model.prequant import awq, compressed, fp8, gptq
from ironlm.model.prequant.bits import Unpacked
from ironlm.model.prequant.install import install, install_fp8
from ironlm.model.prequant.scheme import METHODS, Scheme, parse
from ironlm.model.quantize import QuantSpec

if TYPE_CHECKING:
    from ironlm.distributed.group import TPGroup
    from ironlm.model.llama import DecoderLM

logger = logging.getLogger(__name__)

__all__ = ["METHODS", "Scheme", "Unpacked", "detect", "load", "read", "spec_for"]

_LEAVES = {"awq": awq.LEAVES, "gptq": gptq.LEAVES, "compressed-tensors": compressed.LEAVES, "fp8": fp8.LEAVES}


def detect(path: Path, quantization: str) -> Scheme | None:
    """The checkpoint's scheme when it has a `quantization_config`; an error when `quantization` contradicts it
    or names a pre-quantized method the checkpoint does not have."""
    cfg = json.loads((path / "config.json").read_text())
    qcfg = cfg.get("quantization_config")
    if not qcfg:
        if quantization in ("awq", "gptq", "compressed-tensors"):
            raise InvalidArgumentError(
                f"quantization: {quantization} loads a checkpoint quantized with it, and {path} has no "
                "quantization_config in config.json", "quantization")
        return None
    scheme = parse(qcfg)
    fp8_ct = scheme.method == "compressed-tensors" and scheme.fmt == "float-quantized"
    if quantization in ("auto", "none", scheme.method) or (quantization == "fp8" and fp8_ct):
        return scheme
    raise InvalidArgumentError(
        f"quantization: {quantization!r}, but the checkpoint is already {scheme.method}-quantized "
        f"(quantization_config.quant_method); use auto, {scheme.method}, or none for its exact dense weights",
        "quantization")


def spec_for(scheme: Scheme, quantization: str, device: torch.device, tp: TPGroup | None) -> QuantSpec:
    """Quantized on the core (`bits` = the container width), or dense (`none`). FP8 loads as exact dense f32 on
    the CPU and keeps a CPU spec (`bits` 8) so that dtype auto means float32 there too (bf16 would round it)."""
    if tp is not None:
        raise UnsupportedModelError(f"{scheme.method} checkpoints with tensor parallelism (tensor_parallel_size > 1)")
    if quantization == "none":
        return QuantSpec()
    if device.type != "cpu":
        # The Triton dequant-GEMM is symmetric (w = s q, q signed): it takes sym integer checkpoints exactly.
        if scheme.method == "fp8" or scheme.fmt == "float-quantized":
            if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
                raise UnsupportedModelError(f"{scheme.method} FP8 checkpoints on device={device}: the GPU path "
                                            "needs FP8 tensor cores (sm_89+); the CPU loads them as exact f32")
            return QuantSpec(bits=8, source=scheme.method, backend="fp8")
        if not scheme.sym:
            raise UnsupportedModelError(
                f"quantization_config: {scheme.method} with zero points (asymmetric) on device={device}: the GPU "
                "dequant-GEMM is symmetric (run it on the CPU, or --quantization none for the dense weights)")
        return QuantSpec(bits=scheme.container, group_size=scheme.group, source=scheme.method, backend="triton")
    return QuantSpec(bits=scheme.container, group_size=scheme.group, source=scheme.method, backend="core")


def read(name: str, tensors: dict[str, torch.Tensor], scheme: Scheme) -> Unpacked | torch.Tensor:
    """One linear's checkpoint tensors (leaf name → tensor) as core blocks, or dense f32 (FP8)."""
    if scheme.method == "awq":
        return awq.unpack(name, tensors, scheme)
    if scheme.method == "gptq":
        return gptq.unpack(name, tensors, scheme)
    if scheme.method == "fp8":
        return fp8.unpack(name, tensors)
    return compressed.unpack(name, tensors, scheme)


def _collects(scheme: Scheme, leaf: str, tensor: torch.Tensor) -> bool:
    if leaf in _LEAVES[scheme.method]:
        return True
    return leaf == "weight" and (tensor.dtype == torch.float8_e4m3fn or
                                 (scheme.method == "compressed-tensors" and compressed.is_quantized_weight(tensor)))


def load(model: DecoderLM, path: Path, scheme: Scheme, keep: bool, backend: str = "core") -> None:
    """Every checkpoint tensor into `model`: dense ones as usual, each quantized linear unpacked and installed
    quantized (`keep`; on the core, or `backend` "triton": the GPU's symmetric dequant-GEMM, "fp8": FP8 weights
    kept e4m3 in Fp8Linear) or as its exact dense weights."""
    from ironlm.model import weights
    from ironlm.model.loader import iter_weights, weight_files

    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_weights(weight_files(path)):
        prefix, _, leaf = name.rpartition(".")
        if prefix and _collects(scheme, leaf, tensor):
            groups.setdefault(prefix, {})[leaf] = tensor
        else:
            model.load_weight(name, tensor)
    parts: dict[str, Unpacked] = {}
    fp8_parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    dense_fp8 = False
    for prefix, tensors in groups.items():
        name = weights.canonical(model.config, prefix + ".weight")
        if model.weight_target(name) is None:
            if prefix.endswith("_proj"):  # e.g. Phi-3's fused qkv_proj, which dense loads split
                raise UnsupportedModelError(
                    f"{prefix}: a quantized projection ironlm cannot place as stored ({model.config.architecture}"
                    " fuses or renames it); pre-quantized checkpoints load llama-style q/k/v/o/gate/up/down")
            continue  # a module ironlm does not use
        if "weight" not in tensors and not any(k in tensors for k in ("qweight", "weight_packed")):
            raise UnsupportedModelError(f"{prefix}: quantization tensors {sorted(tensors)} without the weights")
        if backend == "fp8":  # e4m3 kept for the GPU's Fp8Linear
            weight = tensors["weight"]
            if weight.dtype != torch.float8_e4m3fn:
                raise UnsupportedModelError(f"{name}: {weight.dtype} weight in an FP8 checkpoint")
            fp8_parts[name] = (weight, fp8.row_scales(name, weight, fp8.scale_of(name, tensors)))
            model.mark_loaded(name)
            continue
        w = read(name, tensors, scheme)
        if isinstance(w, torch.Tensor):
            model.load_weight(name, w)
            dense_fp8 = True
        elif keep:
            parts[name] = w
            model.mark_loaded(name)
        else:
            model.load_weight(name, w.dense())
    if dense_fp8 and model.dtype != torch.float32:
        logger.warning("FP8 weights of %s rounded to %s (dtype); float32 holds them exactly", path, model.dtype)
    model.finish_loading()
    if keep and parts:
        install(model, parts, backend, scheme.bits)
    if fp8_parts:
        install_fp8(model, fp8_parts)
