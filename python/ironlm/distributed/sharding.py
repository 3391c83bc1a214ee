"""Which slice of each HF-named weight one tensor-parallel rank holds (Megatron layout).

Column-parallel (output rows split): q/k/v and gate/up, the vocab rows of the embedding and the LM head. Row-parallel
(input columns split): o and down, whose partial products one all-reduce sums. Query heads split evenly; KV heads
split too when there are at least as many as ranks, else each rank keeps the one KV head its query heads read
(replicated, as vLLM does). The vocabulary is padded to a multiple of the ranks with zero rows, whose logits are
cut off after the gather. Everything else (norms) is replicated, but for a qk-norm over the whole q / k projection
(OLMo 2), whose weights split with q's and k's rows.

MoE layers run only under expert parallelism (`expert_parallel`): rank r holds the routed experts
[r*E/N, (r+1)*E/N) whole and runs them for every token routed to them; the router is replicated (every rank routes
the same tokens the same way) and a shared expert splits like the dense MLP, so the layer's output is a partial sum
the MLP's one all-reduce completes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from ironlm.exceptions import InvalidArgumentError, UnsupportedModelError
from ironlm.model.config import ModelConfig

_LAYER_RE = re.compile(r"^model\.layers\.\d+\.(.+)$")


@dataclass(frozen=True)
class Cut:
    """Take [start, stop) along `dim` of the full tensor (rows past the full size are zero padding); `zero`: the
    tensor is held as zeros (a row-parallel bias, added once by rank 0)."""

    dim: int = 0
    start: int = 0
    stop: int = -1
    zero: bool = False


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    world: int
    config: ModelConfig  # the whole model's
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        cfg, w = self.config, self.world
        if cfg.moe is not None and any(cfg.moe.sparse_layers) and w > 1:
            self._check_experts()
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        problems = []
        if hq % w:
            problems.append(f"attention heads ({hq})")
        if hkv % w and w % hkv:
            problems.append(f"KV heads ({hkv}; or ranks a multiple of them)")
        if cfg.intermediate_size % w:
            problems.append(f"intermediate size ({cfg.intermediate_size})")
        if problems:
            raise InvalidArgumentError(
                f"tensor_parallel_size: {w} must divide the model's {', '.join(problems)}", "tensor_parallel_size")

    def _check_experts(self) -> None:
        moe, w = self.config.moe, self.world
        assert moe is not None
        if not self.splits_experts:
            raise UnsupportedModelError(
                "mixture-of-experts layers run across ranks only with expert parallelism: pass "
                "--enable-expert-parallel (enable_expert_parallel=True) with tensor_parallel_size > 1")
        if moe.num_experts % w or moe.shared_intermediate_size % w:
            raise InvalidArgumentError(
                f"tensor_parallel_size: {w} must divide the model's routed experts ({moe.num_experts}) and its "
                f"shared expert's size ({moe.shared_intermediate_size}) for expert parallelism", "tensor_parallel_size")

    @property
    def splits_experts(self) -> bool:
        return self.expert_parallel and self.config.moe is not None and self.world > 1

    # ---- the rank's sizes ------------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.world

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.world)

    @property
    def kv_head_start(self) -> int:
        hkv, w = self.config.num_kv_heads, self.world
        if hkv >= w:
            return self.rank * (hkv // w)
        return self.rank // (w // hkv)  # the KV head of this rank's query heads (their GQA group)

    @property
    def padded_vocab(self) -> int:
        return -(-self.config.vocab_size // self.world) * self.world

    @property
    def vocab_shard(self) -> int:
        return self.padded_vocab // self.world

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def local_config(self) -> ModelConfig:
        """The decoder this rank builds: its heads, its share of the MLP and of the vocabulary."""
        moe = self.config.moe
        if moe is not None and self.splits_experts:
            n = moe.num_experts // self.world
            moe = dataclasses.replace(moe, local_experts=(self.rank * n, (self.rank + 1) * n),
                                      shared_intermediate_size=moe.shared_intermediate_size // self.world)
        return dataclasses.replace(
            self.config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            intermediate_size=self.config.intermediate_size // self.world, vocab_size=self.vocab_shard, moe=moe)

    # ---- slices ----------------------------------------------------------------------------------------------
    def cut(self, name: str) -> Cut | None:
        """This rank's part of the HF weight `name`; None = the whole tensor."""
        d = self.config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Cut(0, self.vocab_start, self.vocab_start + self.vocab_shard)
        m = _LAYER_RE.match(name)
        if m is None:
            return None
        rest = m.group(1)
        q0 = self.rank * self.num_heads * d
        kv0 = self.kv_head_start * d
        inter = self.config.intermediate_size // self.world
        i0 = self.rank * inter
        cuts = {
            "self_attn.q_proj": Cut(0, q0, q0 + self.num_heads * d),
            "self_attn.k_proj": Cut(0, kv0, kv0 + self.num_kv_heads * d),
            "self_attn.v_proj": Cut(0, kv0, kv0 + self.num_kv_heads * d),
            "mlp.gate_proj": Cut(0, i0, i0 + inter),
            "mlp.up_proj": Cut(0, i0, i0 + inter),
        }
        if self.config.moe is not None and self.splits_experts:  # the shared expert splits as the dense MLP; routed experts stay whole
            shared = self.config.moe.shared_intermediate_size // self.world
            s0 = self.rank * shared
            cuts.update({"mlp.shared_expert.gate_proj": Cut(0, s0, s0 + shared),
                         "mlp.shared_expert.up_proj": Cut(0, s0, s0 + shared)})
            if rest == "mlp.shared_expert.down_proj.weight":
                return Cut(1, s0, s0 + shared)
        if self.config.qk_norm_full:  # OLMo 2's norm over the whole q / k projection: its weights split as they do
            cuts.update({"self_attn.q_norm": cuts["self_attn.q_proj"], "self_attn.k_norm": cuts["self_attn.k_proj"]})
        if self.config.mla:  # latent attention: the latent projections replicate, the per-head ones split
            cuts.update(self._mla_cuts())
        module = rest.rpartition(".")[0]
        if module in cuts:
            return cuts[module]
        if rest == "self_attn.o_proj.weight":
            v = self.config.v_head_dim if self.config.mla else d
            return Cut(1, self.rank * self.num_heads * v, (self.rank + 1) * self.num_heads * v)
        if rest == "mlp.down_proj.weight":
            return Cut(1, i0, i0 + inter)
        if rest == "self_attn.o_proj.bias":
            return None if self.rank == 0 else Cut(zero=True)
        return None

    def _mla_cuts(self) -> dict[str, Cut]:
        """Each rank's heads of q (q_proj or q_b_proj) and of kv_b_proj (their keys' and values' up-projections);
        kv_a_proj, q_a_proj and their norms make the latent every head reads: whole on every rank, and so is each
        rank's cache of it. GGUF files hold kv_b_proj as llama.cpp's per-head halves k_b [heads, rank, nope] and
        v_b [heads, v, rank]: the same heads, taken along their leading head axis."""
        cfg, n = self.config, self.num_heads
        qk, kv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
        q = Cut(0, self.rank * n * qk, (self.rank + 1) * n * qk)
        heads = Cut(0, self.rank * n, (self.rank + 1) * n)
        return {"self_attn.q_proj": q, "self_attn.q_b_proj": q,
                "self_attn.kv_b_proj": Cut(0, self.rank * n * kv, (self.rank + 1) * n * kv),
                "self_attn.k_b_proj": heads, "self_attn.v_b_proj": heads}

    def take(self, name: str, source: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's slice of weight `name` read from `source` (a tensor, or a safetensors slice: only the shard's
        bytes are read), whose full shape is `shape`."""
        cut = self.cut(name)
        if cut is None:
            return source if isinstance(source, torch.Tensor) else source[:]
        if cut.zero:
            full = source if isinstance(source, torch.Tensor) else source[:]
            return torch.zeros_like(full)
        size = shape[cut.dim]
        stop = min(cut.stop, size)
        index = (slice(cut.start, stop),) if cut.dim == 0 else (slice(None), slice(cut.start, stop))
        part = source[index]
        want = cut.stop - cut.start
        if part.shape[cut.dim] < want:  # vocab padding
            pad_shape = list(part.shape)
            pad_shape[cut.dim] = want - part.shape[cut.dim]
            part = torch.cat([part, part.new_zeros(pad_shape)], dim=cut.dim)
        return part
