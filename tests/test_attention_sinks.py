"""Attention sinks (gpt-oss): a learned logit per query head that joins the softmax denominator with no value row.

The torch and CPU backends against a dense fp64 reference written as transformers' eager gpt-oss attention does
it (the sink as one more logit column, dropped after the softmax): decode rows, fresh prompts, chunks over cached
context, with and without a window, f32 and bf16, under batch-invariant numerics, and a decode step whose
sequences share cached blocks (where plain layers cascade). The Triton kernels' sinks are tested in
test_kernels.py, the core kernel's in rust/src/cpu/attention_tests.rs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ironlm import _core, invariant
from ironlm.attention import get_backend
from test_attention_torch import make_case
from test_sliding_window import WINDOW_CASE


def sink_values(hq: int) -> torch.Tensor:
    """Sinks across the logits' range (one far above them, which leaves its head almost no weight for keys)."""
    return torch.tensor([1.5 * h - 2.0 for h in range(hq)], dtype=torch.float32) + 25.0 * (torch.arange(hq) == 1)


def sink_reference(case: dict, sinks: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Each query row (absolute position p) over its history's keys (p - window, p], fp64, softmax over the keys
    and the head's sink, the sink's column dropped (transformers' eager_attention_forward)."""
    q = case["q"].double()
    hq = q.shape[1]
    out = torch.zeros_like(q)
    start = 0
    for hk, hv, c, n in zip(case["hist_k"], case["hist_v"], case["ctx_lens"], case["q_lens"]):
        grp = hq // hk.shape[1]
        kk, vv = hk.double().repeat_interleave(grp, dim=1), hv.double().repeat_interleave(grp, dim=1)
        for j in range(n):
            hi = c + j + 1
            lo = 0 if window is None else max(0, hi - window)
            s = torch.einsum("hd,shd->hs", q[start + j], kk[lo:hi]) * case["scale"]
            probs = torch.softmax(torch.cat([s, sinks.double()[:, None]], dim=1), dim=1)[:, :-1]
            out[start + j] = torch.einsum("hs,shd->hd", probs, vv[lo:hi])
        start += n
    return out


def run(backend: str, case: dict, sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    return get_backend(backend).forward(case["q"], case["k"], case["v"], case["k_cache"].clone(),
                                        case["v_cache"].clone(), case["meta"], case["scale"], window=window,
                                        sinks=sinks)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backends_match_the_sink_reference(backend: str, window: int | None, dtype: torch.dtype,
                                           tol: float) -> None:
    case = make_case(*WINDOW_CASE, hq=6, hkv=2, d=64, block_size=8, dtype=dtype, seed=3)
    case["scale"] = 0.3  # logits of a few units, the sinks' own range
    sinks = sink_values(6)
    out = run(backend, case, sinks.to(dtype), window)
    want = sink_reference(case, sinks.to(dtype).float(), window)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    # the sinks matter: without them the output moves far beyond the tolerance
    assert (run(backend, case, None, window).double() - want).abs().max() > 50 * tol


def test_cpu_backend_under_batch_invariance_takes_sinks() -> None:
    case = make_case([0, 5, 17], [9, 1, 4], hq=4, hkv=2, d=32, block_size=4, dtype=torch.float32, seed=8)
    sinks = sink_values(4)
    with invariant.scope(True):
        out = run("cpu", case, sinks, 6)
    torch.testing.assert_close(out.double(), sink_reference(case, sinks, 6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_shared_prefix_decode_with_sinks_does_not_cascade_them_away(backend: str) -> None:
    """Decode rows sharing their first blocks: plain layers take the torch path's cascade; with sinks each row
    still gets exactly one sink term (not one per log-sum-exp partition, nor none)."""
    bs, hq, hkv, d = 4, 4, 2, 32
    case = make_case([20, 20, 20], [1, 1, 1], hq=hq, hkv=hkv, d=d, block_size=bs, dtype=torch.float32, seed=4)
    # every sequence's first 4 blocks are sequence 0's, its keys copied into the other histories
    bt = case["block_tables"]
    bt[1:, :4] = bt[0, :4]
    for hist in (case["hist_k"], case["hist_v"]):
        for h in hist[1:]:
            h[:16] = hist[0][:16]
    case["meta"].block_tables = torch.from_numpy(np.ascontiguousarray(bt))
    case["scale"] = 0.3
    sinks = sink_values(hq)
    torch.testing.assert_close(run(backend, case, sinks, None).double(), sink_reference(case, sinks),
                               atol=1e-5, rtol=1e-5)


def test_core_kernel_checks_the_sinks() -> None:
    case = make_case([6], [1], hq=4, hkv=2, d=16, block_size=4, dtype=torch.float32, seed=1)
    m = case["meta"]
    out = torch.empty_like(case["q"])
    args = (case["q"].numpy(), case["k_cache"].numpy(), case["v_cache"].numpy(), m.block_tables.numpy(),
            m.seq_lens.numpy(), 0.25, out.numpy())
    with pytest.raises(ValueError, match="sinks"):
        _core.paged_decode_attention(*args, sinks=np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="sinks"):
        _core.paged_decode_attention(*args, sinks=np.array([0, np.inf, 0, 0], dtype=np.float32))
