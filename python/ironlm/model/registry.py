"""The architecture registry: HF ``model_type`` / GGUF ``general.architecture`` -> the `Family` that runs it.

Every family runs on the one decoder (`ironlm.model.llama.DecoderLM`); a `Family` says how its checkpoints
differ from Llama's, as `ModelConfig` fields the decoder honours (see config.py for each field's meaning):

- norms: ``norm_offset`` (Gemma's ``1 + w``, folded into the weights at load), which of the four norms a block has
  (``pre_attn_norm``, ``post_attn_norm``, ``pre_mlp_norm``, ``post_mlp_norm``), ``qk_norm``;
- ``activation``: ``silu`` or ``gelu_tanh`` (GeGLU with gelu_pytorch_tanh), always gated;
- attention: ``attn_scale`` (e.g. ``query_pre_attn_scalar ** -0.5``), ``attn_softcap``, per-layer windows
  (``sliding_window`` + ``sliding_layers``), ``local_rope`` (another RoPE base for the sliding layers),
  ``rotary_dim`` (partial rotary), ``rope_layers`` (False = a NoPE layer), biases;
- ``embed_scale``, ``residual_scale``, ``logit_scale``, ``final_softcap``, tied / untied head.

Adding a family (one file + its parity test):

1. ``python/ironlm/model/families/<name>.py``: build a ``Family`` and ``register()`` it. ``hf_fields(hf_config)``
   returns the `ModelConfig` fields that differ from what `ModelConfig.from_hf` reads for every family (sizes,
   heads, rope, eps, biases, eos); ``gguf_fields(meta, gf)`` the same from GGUF metadata (``meta(key, default)``
   reads ``<arch>.<key>``); ``hf_renames`` maps the family's HF layer-weight suffixes onto ironlm's names (the
   Llama ones plus ``post_attn_norm.weight`` / ``post_mlp_norm.weight``: see weights.py), ``split`` cuts a
   fused checkpoint tensor (``qkv_proj``, ``gate_up_proj``) into those names.
2. Add the module to ``FAMILY_MODULES`` in ``families/__init__.py``.
3. A tiny random model in ``tests/tiny_models.py`` and a greedy parity test against transformers.

A feature the decoder lacks is a new `ModelConfig` field, honoured in ``llama.py`` (and in weights.py if it brings
weights); the lean CPU decode step (lean.py) takes only the blocks it implements (`ModelConfig.lean_supported`),
so a new field must make ``lean_supported`` False unless lean.py implements it.

This module imports nothing of ironlm's model package: config.py validates against it, families register in it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ironlm.exceptions import UnsupportedModelError

# HF hidden_act names -> ironlm's activation
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _no_fields(*_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    name: str  # the family's ironlm name (its main model_type)
    hf_classes: tuple[str, ...]  # the transformers classes it stands for, e.g. ("Gemma2ForCausalLM",)
    model_types: tuple[str, ...]  # HF config model_type values
    gguf_archs: tuple[str, ...] = ()  # GGUF general.architecture values
    features: tuple[str, ...] = ()  # what it has beyond a plain Llama block (listed by `ironlm models`)
    activations: tuple[str, ...] = ("silu",)  # the ironlm activations its checkpoints may ask for
    hf_fields: Callable[[Any], dict[str, Any]] = _no_fields
    gguf_fields: Callable[[Callable[..., Any], Any], dict[str, Any]] = _no_fields
    hf_renames: Mapping[str, str] = field(default_factory=dict)
    # (config, ironlm name, tensor) -> [(name, tensor), ...] for fused checkpoint tensors; None = none fused
    split: Callable[[Any, str, Any], list[tuple[str, Any]] | None] | None = None
    # how its checkpoints stack routed experts in one tensor, if they do (a key of moe/stacked.py's LAYOUTS)
    experts_layout: str = "transformers"
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted Q/K rows (LlamaModel and its subclasses)
    # GGUF layer-tensor suffix -> ironlm's, where the architecture's slot means another weight than weights.py's
    gguf_renames: Mapping[str, str] = field(default_factory=dict)


_BY_MODEL_TYPE: dict[str, Family] = {}
_BY_GGUF: dict[str, Family] = {}
_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for key, table in [(t, _BY_MODEL_TYPE) for t in family.model_types] + [(a, _BY_GGUF) for a in family.gguf_archs]:
        if key in table and table[key] is not family:
            raise ValueError(f"{key!r} is already registered by family {table[key].name!r}")
        table[key] = family
    _FAMILIES[family.name] = family
    return family


def _load() -> None:
    import ironlm.model.families  # noqa: F401 - registers every family on import


def families() -> list[Family]:
    _load()
    return list(_FAMILIES.values())


def supported_model_types() -> dict[str, str]:
    """model_type -> HF class name, for every registered family."""
    _load()
    return {t: f.hf_classes[min(i, len(f.hf_classes) - 1)] for f in _FAMILIES.values()
            for i, t in enumerate(f.model_types)}


def summary(sep: str = "\n") -> str:
    """One entry per family: HF classes (model_type, GGUF architecture), features."""
    lines = []
    for f in families():
        gguf = f", GGUF {'/'.join(f.gguf_archs)}" if f.gguf_archs else ""
        feats = f": {', '.join(f.features)}" if f.features else ""
        lines.append(f"{'/'.join(f.hf_classes)} ({'/'.join(f.model_types)}{gguf}){feats}")
    return sep.join(lines)


def unsupported(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported model architecture {what}; ironlm supports: {summary('; ')}")


def by_model_type(model_type: str | None, what: str | None = None) -> Family:
    _load()
    fam = _BY_MODEL_TYPE.get(str(model_type))
    if fam is None:
        raise unsupported(what or f"model_type={model_type!r}")
    return fam


def by_gguf_arch(arch: str | None) -> Family:
    _load()
    fam = _BY_GGUF.get(str(arch))
    if fam is None:
        raise unsupported(f"{arch!r} (GGUF general.architecture)")
    return fam
