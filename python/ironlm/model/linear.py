"""The decoder's linear layers: `y = x @ W^T (+ bias) (+ residual)`, dense (torch) or block-quantized (the core).

A layer holds one `Linear` per projection (fused qkv, o, fused gate|up, down, the LM head), so the decoder does not
care how the weights are stored. Dense weights keep ironlm's `[in, out]` parameter layout (a GEMM with the residual
as `addmm`'s input); quantized ones are an `ironlm._core.QuantMatrix` (`[out, in]`, 4- or 8-bit blocks of 32) whose
kernel quantizes the activations to int8 and adds into the residual in place.
"""

from __future__ import annotations

import torch

from ironlm import _core


class DenseLinear:
    """`x @ weight (+ bias)`, `weight` an `[in, out]` tensor (usually a view of a model parameter)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:  # the residual add fused into the GEMM
            out = torch.addmm(residual, x, self.weight)
            return out if self.bias is None else out.add_(self.bias)
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight)
        return torch.mm(x, self.weight)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out = x @ W (+ bias)` into a preallocated buffer."""
        if self.bias is not None:
            torch.addmm(self.bias, x, self.weight, out=out)
        else:
            torch.mm(x, self.weight, out=out)

    def accumulate(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out += x @ W (+ bias)`: the residual add."""
        out.addmm_(x, self.weight)
        if self.bias is not None:
            out += self.bias


class QuantLinear:
    """A block-quantized `[out, in]` matrix run by the core's int8 kernels (AVX-512 VNNI / AVX2) on CPU.

    Activations are float32 whatever the model dtype (the kernel quantizes them to int8 per block of 32 itself); a
    bf16 model converts at the boundary, which at decode sizes costs nothing next to the weight stream.
    """

    def __init__(self, matrix: _core.QuantMatrix, bias: torch.Tensor | None = None) -> None:
        self.matrix = matrix
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._bias_np = None if self.bias is None else self.bias.numpy()

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes + (0 if self.bias is None else self.bias.numel() * 4)

    @property
    def out_features(self) -> int:
        return self.matrix.rows

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        xf = x if dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        threads = torch.get_num_threads()
        if residual is not None and residual.dtype == torch.float32 and residual.is_contiguous():
            # in place: the caller's residual stream is a fresh tensor it no longer needs
            self.matrix.matmul(xf.numpy(), residual.numpy(), True, self._bias_np, threads)
            return residual
        out = torch.empty(xf.shape[0], self.matrix.rows, dtype=torch.float32)
        self.matrix.matmul(xf.numpy(), out.numpy(), False, self._bias_np, threads)
        if residual is not None:
            out += residual
        return out if dtype == torch.float32 else out.to(dtype)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if out.dtype == torch.float32 and x.dtype == torch.float32:
            self.matrix.matmul(x.numpy(), out.numpy(), False, self._bias_np, torch.get_num_threads())
        else:
            out.copy_(self(x))

    def accumulate(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if out.dtype == torch.float32 and x.dtype == torch.float32:
            self.matrix.matmul(x.numpy(), out.numpy(), True, self._bias_np, torch.get_num_threads())
        else:
            out += self(x)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the matrix, dequantized (the tied embedding table read from the LM head's blocks)."""
        out = torch.empty(ids.shape[0], self.matrix.cols, dtype=torch.float32)
        self.matrix.gather(ids.to(torch.int64).numpy(), out.numpy())
        return out


Linear = DenseLinear | QuantLinear
