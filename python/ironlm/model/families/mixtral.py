"""Mixtral: a Mistral block whose MLP is top-2 of 8 experts (softmax over all, then the two renormalised)."""

from __future__ import annotations

import re
from typing import Any

from ironlm.model.families.moe_common import hf_moe
from ironlm.model.registry import Family, register

# Mixtral's checkpoints name the MoE block block_sparse_moe and the expert projections w1 (gate), w3 (up), w2 (down)
_EXPERT = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")
_PROJ = {"1": "gate", "3": "up", "2": "down"}


def _hf(hf_config: Any) -> dict[str, Any]:
    window = getattr(hf_config, "sliding_window", None)
    return {"moe": hf_moe(hf_config, renormalize=True, expert_size=hf_config.intermediate_size),
            **({"sliding_window": int(window)} if window else {})}


def _rename(cfg: Any, name: str, tensor: Any) -> list[tuple[str, Any]] | None:
    m = _EXPERT.match(name)
    if m is None:
        return None
    return [(f"{m.group(1)}mlp.experts.{m.group(2)}.{_PROJ[m.group(3)]}_proj.weight", tensor)]


MIXTRAL = register(Family(
    name="mixtral",
    hf_classes=("MixtralForCausalLM",),
    model_types=("mixtral",),
    features=("mixture of experts: softmax top-k, renormalised", "sliding window"),
    hf_fields=_hf,
    hf_renames={"block_sparse_moe.gate.weight": "mlp.gate.weight"},
    split=_rename,
))
