"""The decoder's linear layers: `y = x @ W^T (+ bias) (+ residual)`, dense (torch) or block-quantized (the core).

A layer holds one `Linear` per projection (fused qkv, o, fused gate|up, down, the LM head), so the decoder does not
care how the weights are stored. Dense weights keep ironlm's `[in, out]` parameter layout (a GEMM with the residual
as `addmm`'s input); quantized ones are an `ironlm._core.QuantMatrix` (`[out, in]`, 4- or 8-bit blocks of 32) whose
kernel quantizes the activations to int8 and adds into the residual in place.

bf16 CPU batches of up to PACKED_MAX_ROWS rows (decode) run on the core's vdpbf16ps tiles over a pair-ordered copy
of the weight (`_core.PackedBf16`, on CPUs with AVX-512 BF16), f32 calls of up to `packed_f32_rows()` rows on a copy
in 16-column groups (`_core.PackedF32`); one- and two-row calls into narrow f32 / bf16 / f16 weights otherwise run on the core's
dense kernels (`_core.dense_matmul`), which read the weights where torch keeps them and stream them once per call,
where they measured faster than torch's GEMM; larger bf16 CPU batches run oneDNN on a prepacked copy of the weight
(PACK_MAX_BYTES); everything else keeps torch's.

`into` / `accumulate` serve the lean decode step, which keeps preallocated buffers and their numpy views: passing
the views saves a tensor-to-numpy conversion per call (4 matmuls x 30 layers a token).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ironlm import _core, invariant
from ironlm.core_views import CORE_DTYPES, as_numpy
from ironlm.model.layers import cpu_has_fast_bf16
from ironlm.model.linear_gpu import Fp8Linear, TritonQuantLinear

# From this many rows a dense bf16 GEMM on a dequantized copy beats the int8 kernels on CPUs with AMX tiles.
# Measured per call on a 2-core Sapphire Rapids (benches/bench_quant_matmul.py): int8 400-470 GFLOP/s at M = 64
# against bf16 mm 495-583, and 385-430 against 1080-1430 at M = 512; dequantizing costs ~0.35 ms per gate_up, ~0.7 ms
# a layer, which a 64-row batch does not earn back (int8 ~1.0 ms a layer, bf16 ~0.9 + 0.7) and a 128-row one does.
# Without AMX (AVX512_BF16 alone) the int8 tiles win at every size: on a 2-core Zen 4, one SmolLM2-135M layer's four
# Q4 matmuls took 1.59 / 6.32 / 27.2 ms at M = 128 / 512 / 2,048 against 3.74 / 10.45 / 38.2 for the dense path
# (dequantization and f32 <-> bf16 copies included), so there the dense path is not taken (`dense_prefill_pays`).
DENSE_MIN_ROWS = 128

# The core's dense kernels beat torch's GEMM on dense weights only at one or two rows and narrow outputs. Measured on
# a quiet 2-core Sapphire Rapids (benches/bench_dense_decode.py, bf16, SmolLM2-135M shapes): at M = 1 / 2 the core
# is 1.13 / 1.12x torch on qkv (N = 960), 1.39 / 1.32x on o and 1.16 / 1.14x on down (N = 576), but 0.88 / 0.79x on
# gate_up (N = 3072) and 0.69 / 0.81x on the LM head (N = 49152); from M = 3 torch wins every shape (0.39-0.95x).
# With the kernels' software prefetch down a column block (2026-12-04, 2-core Zen 4, AVX-512 BF16, weights read
# from memory, M = 1): qkv 49 vs torch 63 us, o 31 vs 45, gate_up 140 vs 162, down 82 vs 103; the head still
# 3.3 vs 2.6-3.0 ms. So gate_up's 3,072 columns come here too, the head's 49,152 do not.
CORE_MAX_ROWS = 2
CORE_MAX_COLS = 4096

# bf16 GEMMs above CORE_MAX_ROWS rows go through oneDNN on a copy of the weight prepacked once in its blocked
# layout (as vLLM-CPU's onednn_mm does) instead of torch.mm, which reorders the whole weight on every call: measured
# on a loaded 2-core Sapphire Rapids, one thread (benches/profile_w.py's notes in BENCHMARKS.md), SmolLM2-135M's
# 30 layers + LM head took 84 vs 142 ms at M = 8, 74 vs 142 at 16, 109 vs 181 at 64 and 480 vs 528 at 512. The copy
# doubles the weights' memory, so only the first PACK_MAX_BYTES of them (process-wide) are packed; the rest keep
# torch.mm.
PACK_MAX_BYTES = 2 << 30
_packed_bytes = 0
# bf16 batches of up to PACKED_MAX_ROWS rows (decode steps, speculative verification) run on the core's vdpbf16ps
# tiles over a copy of the weight repacked once in pair order (`_core.PackedBf16`, AVX-512 BF16), where the CPU has
# them; the bits are the `dense_matmul` bf16 kernel's, so a decode row gets the same result in any batch. On a 2-core
# Zen 4 without AMX (SmolLM2-135M's shapes, weights from memory): at M = 1-2 0.43-0.67x the time of that kernel
# (29-38 GB/s of weights against 13-20: one contiguous stream a column group instead of a strided row slice per
# step), the tied LM head too (1.5-2.0 against torch's 2.6-3.0 ms); against oneDNN's prepacked GEMM 0.53-0.78x at
# 8 rows, 0.74-0.92x at 34, 0.82-0.99x at 64, plus the torch dispatch saved (10-35 us a call in the lean step).
# Larger batches keep oneDNN (1.0-1.35x the time from 128 rows on narrow outputs). f32 weights (dtype auto on CPUs
# without native bf16) take the same idea for one- and two-row calls (`_core.PackedF32`, 16-column groups, AVX2 +
# FMA; the bits of `dense_matmul`'s f32 path): on the same Zen 4, M = 1, 31-40 GB/s against the Kn kernel's 14-21
# and torch's 12-22, a token's matmuls 30.7 -> 14.7 ms. The copies have PACK_MAX_BYTES of their own.
PACKED_MAX_ROWS = 64
_packed_core_bytes = 0


# f32 calls of up to this many rows run on the core's packed copy where its kernel runs on 256-bit vectors (AVX2 +
# FMA, no AVX-512F): its 6-row x 16-column tiles hold every value in a register. Measured on a 2-core AMD EPYC
# (Zen 1, KVM), SmolLM2-135M's shapes, 2 threads: one call at M = 19 / 34 / 64 1.65-2.4x / 1.46-2.0x / 1.3-1.7x
# faster than torch.mm (MKL), the LM head 2.0-3.0x; a layer's four GEMMs (three alternating rounds, medians) 1.59x
# at M = 65, 1.34x at 128, 1.15x at 256, 1.04x at 512, 0.98x at 1,024 and 0.96x at 2,048, where MKL runs at
# ~90 % of the FMA peak. On AVX-512 CPUs only the one- and two-row calls were measured (CORE_MAX_ROWS).
PACKED_F32_MAX_ROWS = 512


@functools.cache
def packed_f32_rows() -> int:
    """The most rows an f32 call sends to the core's packed copy (see PACKED_F32_MAX_ROWS)."""
    return CORE_MAX_ROWS if "avx512f" in _core.cpu_features() else PACKED_F32_MAX_ROWS


@functools.cache
def dense_prefill_pays() -> bool:
    """Whether large batches of a quantized linear run faster as a dense bf16 GEMM over dequantized weights than on
    the core's int8 kernels: on CPUs whose AMX tiles torch can use (see DENSE_MIN_ROWS; a VM may list AMX in its
    flags without enabling it, which torch's check sees)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return cpu_has_fast_bf16() and amx is not None and bool(amx())


def _core_weight(weight: torch.Tensor) -> np.ndarray | None:
    """A numpy view the core's dense kernels take (`[in, out]` C-contiguous, or the transpose of a C-contiguous
    `[out, in]`, as the LM head over the embedding table), or None when the weight is not one."""
    if weight.device.type != "cpu" or weight.dtype not in CORE_DTYPES or weight.dim() != 2:
        return None
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        return None
    return as_numpy(weight.detach())


_PACKED_KINDS: dict[torch.dtype, type[_core.PackedBf16 | _core.PackedF32]] = {
    torch.bfloat16: _core.PackedBf16, torch.float32: _core.PackedF32}


def _pack_core(weight: torch.Tensor) -> _core.PackedBf16 | _core.PackedF32 | None:
    """The core's packed copy of a bf16 or f32 `[in, out]` CPU weight, or None (other dtypes, a CPU without the
    kernel's instructions, or the budget spent)."""
    global _packed_core_bytes
    kind = _PACKED_KINDS.get(weight.dtype)
    if weight.device.type != "cpu" or kind is None or weight.dim() != 2 or not kind.available():
        return None
    size = weight.numel() * weight.element_size()
    if _packed_core_bytes + size > PACK_MAX_BYTES:
        return None
    packed = kind(as_numpy(weight.detach().contiguous()))
    _packed_core_bytes += size
    return packed


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a bf16 `[in, out]` CPU weight, or None (other dtypes, no native bf16, the
    PACK_MAX_BYTES budget spent, or a torch without the op)."""
    global _packed_bytes
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or not cpu_has_fast_bf16():
        return None
    size = weight.numel() * weight.element_size()
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or _packed_bytes + size > PACK_MAX_BYTES:
        return None
    with torch.inference_mode(False), torch.no_grad():  # reused in and out of inference mode
        packed = reorder(weight.detach().t(), 64)  # [out, in], blocked for batches around 64 (fine at any M)
    _packed_bytes += size
    return packed


class DenseLinear:
    """`x @ weight (+ bias)`, `weight` an `[in, out]` tensor (usually a view of a model parameter)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self._np: tuple[int, np.ndarray, np.ndarray | None] | None = None  # (data_ptr, weight, f32 bias) for the core
        self._packed: tuple[int, torch.Tensor | None] | None = None  # (data_ptr, oneDNN-packed weight or None)
        # (data_ptr, the core's packed copy, f32 bias)
        self._pairs: tuple[int, _core.PackedBf16 | _core.PackedF32 | None, np.ndarray | None] | None = None

    def _bias_f32(self) -> np.ndarray | None:
        """The bias as the core's kernels take it (contiguous f32), made once per weight storage with its views."""
        return None if self.bias is None else self.bias.detach().float().contiguous().numpy()

    def _paired(self, x: torch.Tensor) -> _core.PackedBf16 | _core.PackedF32 | None:
        """The core's packed weight when this call goes to its packed tiles: a CPU batch outside batch-invariant mode
        of 1 to `packed_rows()` rows, see PACKED_MAX_ROWS."""
        if x.device.type != "cpu" or x.dtype != self.weight.dtype or invariant.enabled():
            return None
        if not 0 < x.shape[0] <= self.packed_rows():
            return None
        return self.core_packed()

    def packed_rows(self) -> int:
        """The most rows a call sends to the core's packed copy (see PACKED_MAX_ROWS); 0 for other dtypes."""
        dtype = self.weight.dtype
        return PACKED_MAX_ROWS if dtype == torch.bfloat16 else packed_f32_rows() if dtype == torch.float32 else 0

    def core_packed(self) -> _core.PackedBf16 | _core.PackedF32 | None:
        """The core's packed copy of the weight (built on first use, again if the parameter's storage was swapped),
        or None where `_pack_core` makes none; its f32 bias is `packed_bias()`."""
        ptr = self.weight.data_ptr()
        if self._pairs is None or self._pairs[0] != ptr:
            self._pairs = (ptr, _pack_core(self.weight), self._bias_f32())
        return self._pairs[1]

    def packed_bias(self) -> np.ndarray | None:
        """The f32 bias the packed calls take (after `core_packed`)."""
        return None if self._pairs is None else self._pairs[2]

    def _run_paired(self, packed: _core.PackedBf16 | _core.PackedF32, x: torch.Tensor, out: torch.Tensor,
                    accumulate: bool, x_np: np.ndarray | None = None, out_np: np.ndarray | None = None
                    ) -> torch.Tensor:
        assert self._pairs is not None  # `_paired` built it
        packed.matmul(as_numpy(x.contiguous()) if x_np is None else x_np, as_numpy(out) if out_np is None else out_np,
                      accumulate, self._pairs[2], torch.get_num_threads())
        return out

    def _onednn(self, x: torch.Tensor) -> torch.Tensor | None:
        """The prepacked weight when this call goes to oneDNN's packed GEMM (a bf16 CPU batch of more than
        CORE_MAX_ROWS rows outside batch-invariant mode), else None."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.shape[0] <= CORE_MAX_ROWS or invariant.enabled():
            return None
        ptr = self.weight.data_ptr()
        if self._packed is None or self._packed[0] != ptr:  # (re)built if the parameter's storage was swapped
            self._packed = (ptr, _pack(self.weight))
        return self._packed[1]

    def _run_packed(self, packed: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        # the residual added to the f32 accumulator and rounded once, as addmm does
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), packed, self.bias, "add")

    def _core(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The weight's and bias's numpy views when this call goes to the core's dense kernels: a CPU batch of at
        most CORE_MAX_ROWS rows into at most CORE_MAX_COLS outputs, where they beat torch. Batch-invariant mode keeps
        the fixed torch tiles at every size (`_tiled`): the kernels are row-invariant too, but far slower at
        prefill sizes."""
        if x.device.type != "cpu" or x.dtype != self.weight.dtype or invariant.enabled():
            return None
        if x.shape[0] > CORE_MAX_ROWS or self.weight.shape[1] > CORE_MAX_COLS:
            return None
        ptr = self.weight.data_ptr()
        if self._np is None or self._np[0] != ptr:  # (re)built if the parameter's storage was swapped
            w = _core_weight(self.weight)
            if w is None:
                return None
            self._np = (ptr, w, self._bias_f32())
        return self._np[1], self._np[2]

    def _run_core(self, views: tuple[np.ndarray, np.ndarray | None], x_np: np.ndarray, out_np: np.ndarray,
                  accumulate: bool) -> None:
        _core.dense_matmul(x_np, views[0], out_np, accumulate, views[1], CORE_DTYPES[self.weight.dtype],
                           torch.get_num_threads())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        pairs = self._paired(x)
        if pairs is not None:
            if residual is not None and residual.dtype == x.dtype:
                return self._run_paired(pairs, x, residual.contiguous().clone(), True)
            out = self._run_paired(pairs, x, torch.empty(x.shape[0], self.weight.shape[1], dtype=x.dtype), False)
            return out if residual is None else out.add_(residual)
        views = self._core(x)
        if views is not None:
            x = x.contiguous()
            if residual is not None and residual.dtype == x.dtype:
                out = residual.contiguous().clone()  # the residual added in f32 and rounded once, in the kernel
                self._run_core(views, as_numpy(x), as_numpy(out), True)
                return out
            out = torch.empty(x.shape[0], self.weight.shape[1], dtype=x.dtype)
            self._run_core(views, as_numpy(x), as_numpy(out), False)
            return out if residual is None else out.add_(residual)
        packed = self._onednn(x)
        if packed is not None and (residual is None or residual.dtype == x.dtype):
            return self._run_packed(packed, x, residual)
        if invariant.enabled() and x.device.type == "cpu":
            return self._tiled(x, residual)
        if residual is not None:  # the residual add fused into the GEMM
            out = torch.addmm(residual, x, self.weight)
            return out if self.bias is None else out.add_(self.bias)
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight)
        return torch.mm(x, self.weight)

    def _tiled(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """`__call__` in fixed tiles of `invariant.TILE` rows (the last one zero-padded), then bias and residual as
        separate adds: a row's bits no longer depend on how many rows share the call (see ironlm.invariant)."""
        t, m = invariant.TILE, x.shape[0]
        pad = -m % t
        xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x.contiguous()
        out = torch.empty(m + pad, self.weight.shape[1], dtype=x.dtype)
        for i in range(0, m + pad, t):
            torch.mm(xp[i : i + t], self.weight, out=out[i : i + t])
        out = out[:m]
        if self.bias is not None:
            out += self.bias
        if residual is not None:
            out += residual
        return out

    def into(self, x: torch.Tensor, out: torch.Tensor, x_np: np.ndarray | None = None,
             out_np: np.ndarray | None = None) -> torch.Tensor:
        """`x @ W (+ bias)` into the preallocated `out`, or where the GEMM cannot write into a given buffer
        (oneDNN's packed weights, the fixed tiles) a fresh tensor: returns the one holding the product. The lean
        step makes ~120 such calls a decode step; copying each product into its buffer cost it ~4 % of W."""
        pairs = self._paired(x)
        if pairs is not None and out.is_contiguous() and out.dtype == x.dtype:
            return self._run_paired(pairs, x, out, False, x_np, out_np)
        views = self._core(x)
        if views is not None and out.is_contiguous() and out.dtype == x.dtype:
            self._run_core(views, as_numpy(x.contiguous()) if x_np is None else x_np,
                           as_numpy(out) if out_np is None else out_np, False)
            return out
        packed = self._onednn(x)
        if packed is not None and out.dtype == x.dtype:
            return self._run_packed(packed, x, None)
        if invariant.enabled():
            return self._tiled(x, None)
        if self.bias is not None:
            torch.addmm(self.bias, x, self.weight, out=out)
        else:
            torch.mm(x, self.weight, out=out)
        return out

    def accumulate(self, x: torch.Tensor, out: torch.Tensor, x_np: np.ndarray | None = None,
                   out_np: np.ndarray | None = None) -> torch.Tensor:
        """`out + x @ W (+ bias)`, the residual add: in `out` itself, or a fresh tensor (see `into`); returns
        the one holding the sum."""
        pairs = self._paired(x)
        if pairs is not None and out.is_contiguous() and out.dtype == x.dtype:
            return self._run_paired(pairs, x, out, True, x_np, out_np)
        views = self._core(x)
        if views is not None and out.is_contiguous() and out.dtype == x.dtype:
            self._run_core(views, as_numpy(x.contiguous()) if x_np is None else x_np,
                           as_numpy(out) if out_np is None else out_np, True)
            return out
        packed = self._onednn(x)
        if packed is not None and out.dtype == x.dtype:
            return self._run_packed(packed, x, out)
        if invariant.enabled():
            return self._tiled(x, out)
        out.addmm_(x, self.weight)
        if self.bias is not None:
            out += self.bias
        return out


class QuantLinear:
    """A block-quantized `[out, in]` matrix run by the core's int8 kernels (AVX-512 VNNI / AVX2) on CPU.

    Activations are float32 whatever the model dtype (the kernel quantizes them to int8 per block of 32 itself); a
    bf16 model converts at the boundary. Large batches (prefill) on CPUs with native bf16 take a dense bf16 GEMM over
    a dequantized copy in a scratch buffer shared by every linear of the process instead (see DENSE_MIN_ROWS).
    """

    _scratch: torch.Tensor | None = None  # bf16 weights of the matrix being multiplied, grown on demand

    def __init__(self, matrix: _core.QuantMatrix, bias: torch.Tensor | None = None) -> None:
        self.matrix = matrix
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._bias_np = None if self.bias is None else self.bias.numpy()

    @property
    def nbytes(self) -> int:
        """The packed matrix; a bias is the layer's parameter and counted with the parameters."""
        return self.matrix.nbytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        if x.shape[0] >= DENSE_MIN_ROWS and dense_prefill_pays() and not invariant.enabled():
            out = self._dense(x)
            if residual is not None:
                out += residual
            return out if dtype == torch.float32 else out.to(dtype)
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

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = self.matrix.rows, self.matrix.cols
        scratch = QuantLinear._scratch
        if scratch is None or scratch.numel() < rows * cols:
            with torch.inference_mode(False):  # reused in and out of inference mode (see torch_backend._Workspace)
                scratch = QuantLinear._scratch = torch.empty(rows * cols, dtype=torch.bfloat16)
        w = scratch[: rows * cols].view(rows, cols)
        self.matrix.dequantize(w.view(torch.int16).numpy(), torch.get_num_threads())
        out = torch.mm(x.to(torch.bfloat16), w.t()).float()
        return out if self.bias is None else out.add_(self.bias)

    def into(self, x: torch.Tensor, out: torch.Tensor, x_np: np.ndarray | None = None,
             out_np: np.ndarray | None = None) -> torch.Tensor:
        """As `DenseLinear.into`: returns the tensor holding the product (`out`, or a fresh one)."""
        return self._write(x, out, x_np, out_np, accumulate=False)

    def accumulate(self, x: torch.Tensor, out: torch.Tensor, x_np: np.ndarray | None = None,
                   out_np: np.ndarray | None = None) -> torch.Tensor:
        """As `DenseLinear.accumulate`: returns the tensor holding the sum (`out`, or a fresh one)."""
        return self._write(x, out, x_np, out_np, accumulate=True)

    def _write(self, x: torch.Tensor, out: torch.Tensor, x_np: np.ndarray | None, out_np: np.ndarray | None,
               accumulate: bool) -> torch.Tensor:
        if out.dtype != torch.float32 or x.dtype != torch.float32:  # a half-precision model: convert at the edge
            # The residual added in f32 and rounded once, as `__call__(x, residual)` does on the full path: adding
            # the rounded product in bf16 would give a decode row other bits than the same row in a prefill.
            return self(x, residual=out) if accumulate else self(x)
        self.matrix.matmul(x.numpy() if x_np is None else x_np, out.numpy() if out_np is None else out_np,
                           accumulate, self._bias_np, torch.get_num_threads())
        return out

    def embed(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` of the matrix, dequantized (the tied embedding table read from the LM head's blocks), into
        `out` (float32 [len(ids), cols]) when given."""
        if out is None:
            out = torch.empty(ids.shape[0], self.matrix.cols, dtype=torch.float32)
        self.matrix.gather(ids.to(torch.int64).numpy(), out.numpy())
        return out


Linear = DenseLinear | QuantLinear | TritonQuantLinear | Fp8Linear
QuantizedLinear = QuantLinear | TritonQuantLinear | Fp8Linear
QUANTIZED_LINEARS = (QuantLinear, TritonQuantLinear, Fp8Linear)
