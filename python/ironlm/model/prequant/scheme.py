"""A checkpoint's `quantization_config` read into one `Scheme`, or an `UnsupportedModelError` naming the field.

Methods (`quant_method`, vLLM's names): `awq`, `gptq`, `compressed-tensors` (llm-compressor's output) and `fp8`
(serialized e4m3, per-tensor or per-block `weight_scale(_inv)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ironlm.exceptions import UnsupportedModelError

METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
# compressed-tensors formats ironlm runs; "float-quantized" is FP8 e4m3
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


@dataclass(frozen=True)
class Scheme:
    """`bits` of the stored integers (8 for fp8), `group` weights of a row per scale (0 = one per row);
    `sym`: zero point fixed at the middle of the range; `fmt`: AWQ's `version`, GPTQ's `checkpoint_format`,
    compressed-tensors' `format`; `act`: compressed-tensors input activations (None weight-only, "static",
    "dynamic"); `ignore`: module names left dense."""

    method: str
    bits: int
    group: int
    sym: bool = True
    fmt: str = ""
    act: str | None = None
    ignore: tuple[str, ...] = field(default_factory=tuple)

    @property
    def container(self) -> int:
        """The core's quant width that holds these integers losslessly: 4 for 1..4 bits, 8 for 5..8."""
        return 4 if self.bits <= 4 else 8


def _bad(fld: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantization_config.{fld}={value!r}: {why}")


def _group(fld: str, g: Any) -> int:
    g = -1 if g is None else int(g)
    if g == -1:
        return 0
    if g <= 0 or g % 32:
        raise _bad(fld, g, "ironlm needs -1 (per channel) or a multiple of 32 (its blocks are 32 weights)")
    return g


def _bits(fld: str, b: Any) -> int:
    if not isinstance(b, int) or not 1 <= b <= 8:
        raise _bad(fld, b, "ironlm runs 2..8-bit integer weights")
    return b


def parse(qcfg: dict[str, Any]) -> Scheme:
    method = str(qcfg.get("quant_method", "")).lower().replace("_", "-")
    if method == "awq":
        version = str(qcfg.get("version", "gemm")).lower()
        if version not in ("gemm", "gemv"):
            raise _bad("version", version, "ironlm reads AWQ's GEMM and GEMV layouts")
        if not qcfg.get("zero_point", True):
            raise _bad("zero_point", False, "ironlm reads AWQ checkpoints with zero points only")
        bits = _bits("bits", qcfg.get("bits", qcfg.get("w_bit", 4)))
        if bits != 4:
            raise _bad("bits", bits, "AWQ's GEMM layout is 4-bit")
        return Scheme("awq", bits, _group("group_size", qcfg.get("group_size", qcfg.get("q_group_size", 128))),
                      sym=False, fmt=version)
    if method == "gptq":
        fmt = str(qcfg.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise _bad("checkpoint_format", fmt, "ironlm reads gptq and gptq_v2")
        return Scheme("gptq", _bits("bits", qcfg.get("bits")), _group("group_size", qcfg.get("group_size", 128)),
                      sym=bool(qcfg.get("sym", True)), fmt=fmt)
    if method == "compressed-tensors":
        return _compressed(qcfg)
    if method == "fp8":
        if qcfg.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise _bad("activation_scheme", qcfg.get("activation_scheme"), "expected dynamic or static")
        return Scheme("fp8", 8, 0, fmt="e4m3", act=qcfg.get("activation_scheme", "dynamic"),
                      ignore=tuple(qcfg.get("modules_to_not_convert") or ()))
    raise _bad("quant_method", qcfg.get("quant_method"), f"ironlm reads {', '.join(METHODS)}")


def _compressed(qcfg: dict[str, Any]) -> Scheme:
    groups = qcfg.get("config_groups") or {}
    if not groups:
        raise _bad("config_groups", groups, "no quantization scheme")
    schemes = [(name, g) for name, g in groups.items()]
    weights = {repr(sorted((g.get("weights") or {}).items())) for _, g in schemes}
    if len(weights) > 1:
        raise _bad("config_groups", sorted(groups), "ironlm runs one weight scheme per checkpoint")
    name, g = schemes[0]
    fmt = str(g.get("format") or qcfg.get("format") or "")
    if fmt not in CT_FORMATS:
        raise _bad("format", fmt, f"ironlm runs {', '.join(CT_FORMATS)}")
    w = g.get("weights") or {}
    kind = w.get("type", "int")
    strategy = w.get("strategy", "tensor")
    if fmt == "float-quantized":
        if kind != "float" or w.get("num_bits") != 8:
            raise _bad(f"config_groups.{name}.weights", {"type": kind, "num_bits": w.get("num_bits")},
                       "float-quantized runs FP8 e4m3 (type float, 8 bits)")
    elif kind != "int":
        raise _bad(f"config_groups.{name}.weights.type", kind, f"{fmt} holds integer weights")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise _bad(f"config_groups.{name}.weights.strategy", strategy, "ironlm runs tensor, channel, group, block")
    if strategy == "block" and fmt != "float-quantized":
        raise _bad(f"config_groups.{name}.weights.strategy", strategy, "block scales are read for FP8 only")
    group = _group(f"config_groups.{name}.weights.group_size", w.get("group_size")) if strategy == "group" else 0
    acts = g.get("input_activations")
    act = None if not acts else ("dynamic" if acts.get("dynamic") else "static")
    return Scheme("compressed-tensors", _bits(f"config_groups.{name}.weights.num_bits", w.get("num_bits")), group,
                  sym=bool(w.get("symmetric", True)), fmt=fmt, act=act, ignore=tuple(qcfg.get("ignore") or ()))
