"""A MoE layer's MLP: the router, the routed experts (only those some token of the step chose run), an optional
shared expert (every token; Qwen2-MoE gates it with a sigmoid, DeepSeek adds it as is).

Experts are stored stacked in ironlm's `[in, out]` layout (gate_up `[E, hidden, 2I]` gate|up, down `[E, I, hidden]`)
and each runs through a `Linear` over its slice, so load-time quantization or a GGUF file's blocks swap those for
the core's `QuantLinear` per expert without the block caring (quantized.py). A step's token-expert pairs are sorted
by expert: each routed expert multiplies one contiguous run of rows, and an expert no token chose is never read.

Under expert parallelism (`MoeConfig.local_experts`) the block holds only its rank's experts (local index i is
expert `first + i`): routing still scores all of them, and of the sorted pairs only the run of its own experts is
computed; the partial output (zero for tokens routed elsewhere) is summed over the ranks by the decoder's
all-reduce.

gpt-oss passes `clamp` (its SwiGLU's alpha and limit, on gate | up halves as its loader lays them out); another
gated activation can come as `act`: `[n, 2I]` gate_up output -> `[n, I]`.

On CPU with quantized experts (every expert's linears a `QuantLinear`) the routed experts run in one call of the
core's `MoeExperts` over the same `QuantMatrix` objects: it sorts the pairs, gathers the rows and runs every routed
expert's gate_up, activation and down on the int8 kernels, GIL released, threads splitting the experts' columns. It
computes what the loop below does with the same kernels in the same order (an f32 block gives the same bits either
way). It takes every CPU step, prefill chunks included: there the loop would hand an expert of DENSE_MIN_ROWS rows
to QuantLinear's dense bf16 GEMM (dequantize, then torch.mm), which on this 2-core Sapphire Rapids ran a 2048-token
chunk of an OLMoE-width layer (64 experts of 1024, ~300 rows each) 3.4-4.1x slower than the core's int8 tiles
(interleaved A/B, int4 g32). So a token's expert output no longer depends on how many rows its experts got in the
step. A custom `act` keeps the loop.

On CUDA the routed experts run on the Triton fused-MoE kernel instead (fused.py: dense or Triton-quantized experts,
two launches a step); `fused` switches it off, or on for CPU tensors under the Triton interpreter (tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ironlm import _core
from ironlm.model.layers import act_and_mul, clamped_swiglu
from ironlm.model.linear import DenseLinear, Linear, QuantLinear
from ironlm.model.moe import fused
from ironlm.model.moe.route import route
from ironlm.model.moe.spec import MoeConfig

Act = Callable[[torch.Tensor], torch.Tensor]
# (HF-named [out, in] pieces stacked into one linear, bias) -> the linear (quantized.py's builders)
Make = Callable[[list[tuple[str, torch.Tensor]], torch.Tensor | None], Linear]


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _empty(like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(like.new_empty((0,)), requires_grad=False)


class ExpertMLP:
    """One gated MLP: `down(act(gate_up(x)))`."""

    def __init__(self, gate_up: Linear, down: Linear, act: Act) -> None:
        self.gate_up = gate_up
        self.down = down
        self.act = act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


class MoeBlock(nn.Module):
    def __init__(self, hidden: int, cfg: MoeConfig, dtype: torch.dtype, device: torch.device,
                 activation: str = "silu", act: Act | None = None, clamp: tuple[float, float] | None = None) -> None:
        super().__init__()
        e, inter, shared = cfg.num_experts, cfg.intermediate_size, cfg.shared_intermediate_size
        self.cfg = cfg
        self.first, local = cfg.expert_range.start, len(cfg.expert_range)
        self.spec = cfg.route
        self.activation, self.clamp, self.custom_act = activation, clamp, act is not None
        if act is None:
            act = ((lambda gu: act_and_mul(gu, activation)) if clamp is None
                   else functools.partial(clamped_swiglu, *clamp))
        self.act: Act = act
        self.router_weight = _param((hidden, e), dtype, device)
        self.router_bias = _param((e,), dtype, device) if cfg.router_bias else None
        # selection-only, kept in fp32 as DeepSeek-V3 keeps it: bf16 would tie experts the bias tells apart
        self.correction = _param((e,), torch.float32, device) if cfg.correction_bias else None
        self.gate_up_weight = _param((local, hidden, 2 * inter), dtype, device)
        self.down_weight = _param((local, inter, hidden), dtype, device)
        self.gate_up_bias = _param((local, 2 * inter), dtype, device) if cfg.expert_bias else None
        self.down_bias = _param((local, hidden), dtype, device) if cfg.expert_bias else None
        self.shared_gate_up_weight = _param((hidden, 2 * shared), dtype, device) if shared else None
        self.shared_down_weight = _param((shared, hidden), dtype, device) if shared else None
        self.shared_gate_weight = _param((hidden, 1), dtype, device) if shared and cfg.shared_gate else None
        # built by finish_loading over the parameters unless a quantizing loader set them
        self.experts: list[ExpertMLP] | None = None
        self.shared: ExpertMLP | None = None
        self.core: _core.MoeExperts | None = None  # the routed experts on the core's kernel, when it takes them
        self.streamed = 0  # weight bytes the core's kernel has read, summed over calls (the benches' counter)
        # the routed experts on the Triton fused-MoE kernel (fused.py): None = when x is on CUDA, True = also on the
        # CPU (tests, under the Triton interpreter), False = never
        self.fused: bool | None = None
        self.fused_weights: fused.Pair | None = None  # its weight stacks, built on first use

    def finish_loading(self) -> None:
        if self.experts is None:
            self.experts = [ExpertMLP(DenseLinear(self.gate_up_weight[i], self._bias(self.gate_up_bias, i)),
                                      DenseLinear(self.down_weight[i], self._bias(self.down_bias, i)), self.act)
                            for i in range(len(self.cfg.expert_range))]
        if self.shared is None and self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
            self.shared = ExpertMLP(DenseLinear(self.shared_gate_up_weight), DenseLinear(self.shared_down_weight),
                                    self.act)

    def quantize_(self, make: Make) -> None:
        """Every expert's (and the shared expert's) linears built by `make` from their HF-named `[out, in]` pieces
        (gate and up, or down) and bias; the dense expert weights are dropped. The router stays dense: it is a
        [hidden, E] matrix every token multiplies, small beside one expert."""
        inter, shared = self.cfg.intermediate_size, self.cfg.shared_intermediate_size

        def mlp(prefix: str, gu: torch.Tensor, down: torch.Tensor, size: int, gu_bias: torch.Tensor | None,
                down_bias: torch.Tensor | None) -> ExpertMLP:
            gate_up = make([(prefix + "gate_proj.weight", gu[:size]), (prefix + "up_proj.weight", gu[size:])], gu_bias)
            return ExpertMLP(gate_up, make([(prefix + "down_proj.weight", down)], down_bias), self.act)

        self.experts = [mlp(f"mlp.experts.{self.first + i}.", self.gate_up_weight[i].t(), self.down_weight[i].t(),
                            inter, self._bias(self.gate_up_bias, i), self._bias(self.down_bias, i))
                        for i in range(len(self.cfg.expert_range))]
        if self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
            self.shared = mlp("mlp.shared_expert.", self.shared_gate_up_weight.t(), self.shared_down_weight.t(),
                              shared, None, None)
            self.shared_gate_up_weight = self.shared_down_weight = _empty(self.router_weight)
        self.gate_up_weight = self.down_weight = _empty(self.router_weight)
        self.fused_weights = None
        self.core = self._core_experts()

    def _core_experts(self) -> _core.MoeExperts | None:
        """The core's kernel over the experts' own matrices, when every expert is a QuantLinear pair (CPU) and the
        activation is one it has."""
        mlps = self.experts or []
        quant = [(m.gate_up, m.down) for m in mlps if isinstance(m.gate_up, QuantLinear)
                 and isinstance(m.down, QuantLinear)]
        if not mlps or len(quant) != len(mlps) or self.custom_act or self.activation not in ("silu", "gelu_tanh"):
            return None

        def biases(lins: list[QuantLinear]) -> torch.Tensor | None:
            present = [lin.bias for lin in lins if lin.bias is not None]
            return torch.stack(present) if len(present) == len(lins) and present else None

        gub, db = biases([g for g, _ in quant]), biases([d for _, d in quant])
        return _core.MoeExperts([g.matrix for g, _ in quant], [d.matrix for _, d in quant], self.activation,
                                self.clamp, None if gub is None else gub.numpy(), None if db is None else db.numpy(),
                                self.first, self.cfg.num_experts)

    def linears(self) -> list[Linear]:
        """Every expert's (and the shared expert's) linears, as built."""
        mlps = (self.experts or []) + ([self.shared] if self.shared is not None else [])
        return [lin for mlp in mlps for lin in (mlp.gate_up, mlp.down)]

    @staticmethod
    def _bias(bias: torch.Tensor | None, i: int) -> torch.Tensor | None:
        return None if bias is None else bias[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (normed) -> the MLP branch [T, hidden] (the caller adds the residual)."""
        if self.routes_on_core(x.device, x.dtype):
            weights, ids = self._core_route(x)
        else:
            logits = torch.mm(x, self.router_weight)
            weights, ids = route(logits, self.spec, self.router_bias, self.correction)
        out = self.run_experts(x, weights, ids)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate_weight is not None:
                s = s * torch.sigmoid(torch.mm(x, self.shared_gate_weight))
            out += s
        return out

    def routes_on_core(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the router runs on the core (`_core.moe_route`, cpu/route.rs): where the routed experts run on
        the core's kernel in float32 and the routing has no expert groups or correction bias. The fused lean step
        (lean.stack) calls the same routine inside its one call, so a row routes alike whichever path its step
        takes; route.py stays the reference (the tests hold the two together) and runs everywhere else."""
        return (self.core is not None and device.type == "cpu" and dtype == torch.float32
                and self.router_weight.dtype == torch.float32 and not self.spec.grouped and self.correction is None)

    def _core_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        bias = None if self.router_bias is None else self.router_bias.detach().numpy()
        weights, ids = _core.moe_route(x.contiguous().numpy(), self.router_weight.detach().numpy(), s.top_k,
                                       s.scoring, s.renormalize, s.renorm_eps, s.scaling, bias)
        return torch.from_numpy(weights), torch.from_numpy(ids)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert[ids[t, j]](x[t]) for each token t, over this block's experts only (all of
        them unless expert parallel), touching only the chosen ones."""
        if self.core is not None and x.device.type == "cpu":
            return self._run_core(x, weights, ids)
        if fused.takes(self, x):
            return fused.run(self, x, weights, ids)
        assert self.experts is not None
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        mine = self.cfg.expert_range
        lo = sum(counts[:mine.start])  # this block's experts' pairs: one contiguous run of the sorted order
        order = order[lo:lo + sum(counts[mine.start:mine.stop])]
        rows = order // k  # the token of each (token, choice) pair, in expert order
        xs = x.index_select(0, rows)
        ys = torch.empty_like(xs)
        start = 0
        for i, n in enumerate(counts[mine.start:mine.stop]):
            if n:
                ys[start:start + n] = self.experts[i](xs[start:start + n])
                start += n
        ys.mul_(weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype))
        out = torch.zeros_like(x)
        out.index_add_(0, rows, ys)
        return out

    def _run_core(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        assert self.core is not None
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        out = torch.zeros(xf.shape, dtype=torch.float32)
        self.streamed += self.core.run(xf.numpy(), ids.contiguous().numpy(), weights.float().contiguous().numpy(),
                                       out.numpy(), torch.get_num_threads())
        return out if x.dtype == torch.float32 else out.to(x.dtype)
