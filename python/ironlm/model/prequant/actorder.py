"""GPTQ act-order (`desc_act`): a checkpoint whose `g_idx` visits the groups out of column order.

The core's blocks need each 32 consecutive columns to share one scale, so the columns are stored sorted by group
(stable) and the activations are permuted the same way before the matmul: `x @ W^T = x[:, perm] @ W[:, perm]^T`.
For `down_proj` the permutation is folded into the rows of `gate_proj` / `up_proj` instead (their outputs,
through SiLU-and-mul elementwise, are `down`'s input; permuting output rows is exact and free). q|k|v and
gate|up read the normed residual stream and o the attention output (head-structured), neither of which can be
reordered upstream, so they take an `index_select` per call (a copy of `x`: `[tokens, hidden]` floats)."""

from __future__ import annotations

import numpy as np
import torch

from ironlm import _core
from ironlm.model.linear import QuantLinear


class ActOrderLinear(QuantLinear):
    """A `QuantLinear` whose stored column `j` is input column `perm[j]`."""

    def __init__(self, matrix: _core.QuantMatrix, perm: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(matrix, bias)
        self.perm = perm.to(torch.int64).contiguous()

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes + self.perm.numel() * self.perm.element_size()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return super().__call__(x.index_select(1, self.perm), residual)

    def into(self, x: torch.Tensor, out: torch.Tensor, x_np: np.ndarray | None = None,
             out_np: np.ndarray | None = None) -> torch.Tensor:
        return super().into(x.index_select(1, self.perm), out, None, out_np)

    def accumulate(self, x: torch.Tensor, out: torch.Tensor, x_np: np.ndarray | None = None,
                   out_np: np.ndarray | None = None) -> torch.Tensor:
        return super().accumulate(x.index_select(1, self.perm), out, None, out_np)

    def embed(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise TypeError("an act-order matrix is a projection, not an embedding table")
