"""What a MoE layer is, without torch (`ModelConfig` carries it): how it routes (`RouteSpec`, see route.py for each
knob) and how big its experts are (`MoeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from ironlm.exceptions import UnsupportedModelError

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class RouteSpec:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    renorm_eps: float = 0.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise UnsupportedModelError(f"unsupported MoE scoring {self.scoring!r}; supported: {', '.join(SCORINGS)}")
        if self.group_score not in GROUP_SCORES:
            raise UnsupportedModelError(f"unsupported MoE group score {self.group_score!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise UnsupportedModelError(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
        if self.grouped and not (0 < self.topk_group <= self.n_group
                                 and self.top_k <= self.topk_group * (self.num_experts // self.n_group)):
            raise UnsupportedModelError(f"topk_group={self.topk_group} of n_group={self.n_group} leaves fewer "
                                        f"than num_experts_per_tok={self.top_k} experts to choose from")

    @property
    def grouped(self) -> bool:
        return self.n_group > 1


@dataclass(frozen=True)
class MoeConfig:
    route: RouteSpec
    intermediate_size: int  # of each routed expert (moe_intermediate_size)
    sparse_layers: tuple[bool, ...]  # per layer: True = a MoE block, False = the dense MLP (intermediate_size)
    shared_intermediate_size: int = 0  # a shared expert every token runs (0 = none)
    shared_gate: bool = False  # the shared expert's output times sigmoid(x @ w) (Qwen2-MoE), w [hidden, 1]
    router_bias: bool = False  # the router has a bias (gpt-oss)
    correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (selection only)
    expert_bias: bool = False  # each expert's gate_up and down carry biases (gpt-oss)
    # expert parallelism: the routed experts [start, stop) this rank holds (None = all of them)
    local_experts: tuple[int, int] | None = None

    @property
    def num_experts(self) -> int:
        return self.route.num_experts

    @property
    def expert_range(self) -> range:
        """The routed experts this rank holds and runs."""
        return range(*self.local_experts) if self.local_experts is not None else range(self.num_experts)


def sparse_layers(num_layers: int, step: int = 1, dense: tuple[int, ...] | list[int] = (),
                  first_dense: int = 0) -> tuple[bool, ...]:
    """Which layers are MoE: every `step`-th (Qwen's decoder_sparse_step: layer i when (i + 1) % step == 0), none
    listed in `dense` (mlp_only_layers), none of the first `first_dense` (DeepSeek's first_k_dense_replace)."""
    step = max(int(step or 1), 1)
    return tuple((i + 1) % step == 0 and i not in set(dense) and i >= first_dense for i in range(num_layers))
