"""Tiny pre-quantized checkpoints for the prequant tests: a random tiny llama (tests/tiny_models.py, hidden 256 and
intermediate 384, so groups of 128 exist), its seven projections per layer quantized round-to-nearest and written
in one format, next to a reference folder holding the exact dequantization as plain fp32 weights.

    make_prequant(tmp_path, case) -> Built(qdir, refdir, linears)

AWQ and GPTQ are packed here, loop by loop as AutoAWQ's and AutoGPTQ's packers lay the words out (AWQ's nibble
order [0, 2, 4, 6, 1, 3, 5, 7] along the output dimension; GPTQ's bit stream along the input dimension, 3-bit
values straddling words, zero points stored minus one); compressed-tensors checkpoints are written by the
compressed-tensors library itself (its compressors quantize and pack), and their references are that library's
own decompression.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tiny_models import make_tiny_model

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Case:
    method: str  # awq | gptq | ct-pack | ct-int | ct-fp8 | fp8
    bits: int = 4
    group: int = 128  # 0 = per channel
    sym: bool = False
    act_order: bool = False
    static_acts: bool = False  # ct-int: W8A8 with a static input_scale
    fmt: str = "gptq"  # GPTQ's checkpoint_format
    arch: str = "llama"  # tiny_models arch (qwen2: q/k/v biases)
    tied: bool = False


@dataclass
class Built:
    qdir: Path
    refdir: Path
    # per quantized weight name: its exact f32 dequantization [out, in]
    linears: dict[str, torch.Tensor] = field(default_factory=dict)


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor | None = None,
        zmin: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest `[out, in]` → (q int64 `[out, in]` in 0..2^b-1, fp16 scales `[out, G]`, zeros int64
    `[out, G]`), column i in group `g_idx[i]` (default `i // group`)."""
    out, cols = w.shape
    group = group or cols
    g = torch.arange(cols) // group if g_idx is None else g_idx.to(torch.int64)
    ngroups = int(g.max()) + 1
    maxq = (1 << bits) - 1
    scales = torch.empty(out, ngroups)
    zeros = torch.empty(out, ngroups, dtype=torch.int64)
    for k in range(ngroups):
        wk = w[:, g == k]
        if sym:
            s = wk.abs().amax(1) / ((maxq + 1) // 2 - 0.5)
            z = torch.full((out,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = wk.amin(1).clamp(max=0), wk.amax(1).clamp(min=0)
            s = (hi - lo) / maxq
            z = torch.round(-lo / s).to(torch.int64).clamp(zmin, maxq)
        scales[:, k] = s.half().float()
        zeros[:, k] = z
    s_col, z_col = scales[:, g], zeros[:, g]
    q = torch.round(w / s_col + z_col).clamp(0, maxq).to(torch.int64)
    return q, scales.half(), zeros


def dequant(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
            group: int) -> torch.Tensor:
    cols = q.shape[1]
    g = torch.arange(cols) // (group or cols) if g_idx is None else g_idx.to(torch.int64)
    return scales.float()[:, g] * (q - zeros[:, g]).float()


def _i32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def pack_gptq_rows(v: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's packer: `v` `[n, m]` unsigned → uint32 `[n bits / 32, m]`, packed along the first dimension."""
    v = v.astype(np.uint64)
    out = np.zeros((v.shape[0] * bits // 32, v.shape[1]), dtype=np.uint64)
    if bits in (2, 4, 8):
        per = 32 // bits
        for row in range(out.shape[0]):
            for j in range(per):
                out[row] |= v[row * per + j] << np.uint64(bits * j)
        return out & 0xFFFFFFFF
    assert bits == 3
    i = row = 0
    while row < out.shape[0]:
        for j in range(10):
            out[row] |= v[i + j] << np.uint64(3 * j)
        i += 10
        out[row] |= v[i] << np.uint64(30)
        row += 1
        out[row] |= (v[i] >> np.uint64(2)) & np.uint64(1)
        i += 1
        for j in range(10):
            out[row] |= v[i + j] << np.uint64(3 * j + 1)
        i += 10
        out[row] |= v[i] << np.uint64(31)
        row += 1
        out[row] |= (v[i] >> np.uint64(1)) & np.uint64(3)
        i += 1
        for j in range(10):
            out[row] |= v[i + j] << np.uint64(3 * j + 2)
        i += 10
        row += 1
    return out & 0xFFFFFFFF


def pack_awq(v: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM packer: `v` `[n, m]` 4-bit → uint32 `[n, m / 8]`, nibble k = column 8 j + AWQ_ORDER[k]."""
    v = v.astype(np.uint64)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
    for col in range(out.shape[1]):
        for k in range(8):
            out[:, col] |= v[:, col * 8 + AWQ_ORDER[k]] << np.uint64(4 * k)
    return out


def _gptq(w: torch.Tensor, case: Case, order: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    cols = w.shape[1]
    group = case.group or cols
    g_idx = None
    if order is not None:  # GPTQ's desc_act: groups follow a column permutation (its Hessian order)
        g_idx = torch.empty(cols, dtype=torch.int64)
        g_idx[order] = torch.arange(cols) // group
    # v1 stores z - 1, so zero points of 0 do not round-trip (AutoGPTQ's own quirk): keep them >= 1
    q, s, z = rtn(w, case.bits, group, case.sym, g_idx, zmin=1 if case.fmt == "gptq" else 0)
    ref = dequant(q, s, z, g_idx, group)
    stored_z = z - 1 if case.fmt == "gptq" else z
    t = {"qweight": _i32(pack_gptq_rows(q.t().numpy(), case.bits)),
         "qzeros": _i32(_pack_cols(stored_z.t().numpy(), case.bits)),
         "scales": s.t().contiguous(),
         "g_idx": (torch.arange(cols) // group if g_idx is None else g_idx).to(torch.int32)}
    return t, ref


def _pack_cols(v: np.ndarray, bits: int) -> np.ndarray:
    """Packed along the second dimension (GPTQ's qzeros): the row packer on the transpose."""
    return np.ascontiguousarray(pack_gptq_rows(np.ascontiguousarray(v.T), bits).T)


def _awq(w: torch.Tensor, case: Case) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, s, z = rtn(w, 4, case.group, False)
    ref = dequant(q, s, z, None, case.group)
    t = {"qweight": _i32(pack_awq(q.t().numpy())), "qzeros": _i32(pack_awq(z.t().numpy())),
         "scales": s.t().contiguous()}
    return t, ref


def _awq_gemv(w: torch.Tensor, case: Case) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ's GEMV layout: along the input dimension in plain nibble order, zero points and scales along the
    groups padded to its calculate_zeros_width (groups / 8 rounded up, then to a multiple of 128 / group)."""
    q, s, z = rtn(w, 4, case.group, False)
    ref = dequant(q, s, z, None, case.group)
    out, cols = w.shape
    groups = cols // case.group
    width = -(-groups // 8)
    mult = max(1, 128 // case.group)
    width = -(-width // mult) * mult
    zp = np.zeros((out, width * 8), dtype=np.int64)
    zp[:, :groups] = z.numpy()
    scales = torch.zeros(out, width * 8, dtype=torch.float16)
    scales[:, :groups] = s
    t = {"qweight": _i32(np.ascontiguousarray(pack_gptq_rows(q.t().numpy(), 4).T)),
         "qzeros": _i32(np.ascontiguousarray(pack_gptq_rows(zp.T, 4).T)), "scales": scales}
    return t, ref


def _ct_scheme(case: Case) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if case.method == "ct-fp8":
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                   strategy="channel" if case.group == 0 else "tensor")
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    strategy = "group" if case.group else "channel"
    weights = QuantizationArgs(num_bits=case.bits, type="int", symmetric=case.sym, strategy=strategy,
                               group_size=case.group or None)
    acts = None
    if case.method == "ct-int":
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor",
                                dynamic=not case.static_acts)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def _ct_format(case: Case) -> str:
    return {"ct-pack": "pack-quantized", "ct-int": "int-quantized", "ct-fp8": "float-quantized"}[case.method]


def _ct(w: torch.Tensor, case: Case) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_scheme(case)
    out, cols = w.shape
    if case.method == "ct-fp8":
        amax = w.abs().amax(1, keepdim=True) if case.group == 0 else w.abs().amax().reshape(1)
        scale = (amax / 448.0).to(torch.bfloat16)
        sd = {"weight": w, "weight_scale": scale}
    else:
        width = case.group or cols
        wg = w.reshape(out, cols // width, width)
        s, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), scheme.weights)
        sd = {"weight": w, "weight_scale": s.half()}
        if not case.sym:
            sd["weight_zero_point"] = zp
    comp = BaseCompressor.get_value_from_registry(_ct_format(case))
    packed = comp.compress(dict(sd), scheme)
    # the library's own decompression, scales in f32 so that its arithmetic is exact like ironlm's
    ref = comp.decompress({**packed, "weight_scale": packed["weight_scale"].float()}, scheme)["weight"].float()
    if case.static_acts:
        packed["input_scale"] = torch.tensor([0.05], dtype=torch.float32)
    return packed, ref


def _fp8_block(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """transformers' fine-grained FP8 layout: e4m3 with one f32 `weight_scale_inv` per 128x128 block."""
    out, cols = w.shape
    blocks = w.reshape(out // 128, 128, cols // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(out, cols).to(torch.float8_e4m3fn)
    ref = (q.float().reshape(out // 128, 128, cols // 128, 128) * scale[:, None, :, None]).reshape(out, cols)
    return {"weight": q, "weight_scale_inv": scale}, ref


def quantization_config(case: Case) -> dict[str, Any]:
    if case.method == "awq":
        version = "gemv" if case.fmt == "gemv" else "gemm"
        return {"quant_method": "awq", "bits": 4, "group_size": case.group, "zero_point": True, "version": version}
    if case.method == "gptq":
        return {"quant_method": "gptq", "bits": case.bits, "group_size": case.group or -1, "sym": case.sym,
                "desc_act": case.act_order, "checkpoint_format": case.fmt}
    if case.method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig(config_groups={"group_0": _ct_scheme(case)}, format=_ct_format(case),
                             quantization_status="compressed", ignore=["lm_head"])
    return cfg.model_dump(mode="json")


def make_prequant(tmp_path: Path, case: Case, seed: int = 0, **overrides: Any) -> Built:
    base = make_tiny_model(tmp_path / "base", case.arch, seed=seed, tie_word_embeddings=case.tied, **overrides)
    sd = load_file(str(base / "model.safetensors"))
    rng = torch.Generator().manual_seed(seed + 7)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    qsd: dict[str, torch.Tensor] = {}
    refsd: dict[str, torch.Tensor] = {}
    built = Built(tmp_path / "quantized", tmp_path / "reference")
    for name, t in sd.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.split(".", 3)[-1] in PROJ):
            qsd[name] = refsd[name] = t
            continue
        w = t.float()
        if case.method == "gptq":
            # q/k/v (and gate/up) see the same inputs, so GPTQ's Hessian, hence its act-order, is theirs in common
            layer, mod = prefix.rsplit(".", 1)
            key = (layer, {"k": "q", "v": "q", "u": "g"}.get(mod[0], mod[0]))
            if case.act_order and key not in orders:
                orders[key] = torch.randperm(w.shape[1], generator=rng)
            parts, ref = _gptq(w, case, orders.get(key))
        elif case.method == "awq":
            parts, ref = _awq_gemv(w, case) if case.fmt == "gemv" else _awq(w, case)
        elif case.method == "fp8":
            parts, ref = _fp8_block(w)
        else:
            parts, ref = _ct(w, case)
        for leaf, v in parts.items():
            qsd[f"{prefix}.{leaf}"] = v.contiguous()
        refsd[name] = ref
        built.linears[name] = ref
    for folder, tensors in ((built.qdir, qsd), (built.refdir, refsd)):
        shutil.copytree(base, folder)
        save_file(tensors, str(folder / "model.safetensors"))
    cfg = json.loads((built.qdir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(case)
    (built.qdir / "config.json").write_text(json.dumps(cfg))
    return built
