"""Q6_K tensors kept as the core's q6k blocks, in a file made the way users make one: a tiny llama through
llama.cpp's converter (f32), then llama-quantize to Q4_0, which writes the LM head (output.weight) as Q6_K. The
head keeps the file's blocks at their own size and dequantizes to the file's weights; its matmul stays within the
int8 activation rounding of the dequantized weights, and the whole model's logits follow the same file loaded
dequantized."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from gguf_convert import convert
from ironlm.model import load_model
from ironlm.model.gguf import GGUFFile
from ironlm.model.linear import QuantLinear
from test_model_gguf import _logprobs_ironlm
from tiny_models import make_tiny_model

# worst |log-softmax diff| of the kept blocks (Q4_0 linears and the Q6_K head, int8 activations) against the same
# file dequantized. First run where llama-quantize was built (2026-12-04, 2-core Zen 4, AVX-512 VNNI): 0.159, spread
# over every position (0.07-0.16, no near-tie): the int8 rounding of each 32-block of activations (<= amax / 254)
# through the Q4_0 linears of a random model whose logits have std ~1.3. The earlier 0.15 was set before any run.
# A wrong block, scale or row order moves logprobs by whole units; the head alone is held to its exact rounding
# bound below.
LOGPROB_BOUND = 0.25


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory):
    from ironlm.bench.llama_cpp import find_binary
    from ironlm.exceptions import LlamaCppNotBuilt

    try:
        quantize = find_binary("llama-quantize")
    except LlamaCppNotBuilt as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("q6k")
    # hidden 256: Q6_K needs rows of 256 weights (llama-quantize falls back to another type otherwise)
    f32 = convert(make_tiny_model(root, "llama", intermediate_size=512), root, "f32")
    out = root / "tiny-llama.Q4_0.gguf"
    subprocess.run([str(quantize), str(f32), str(out), "Q4_0"], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("IRONLM_CACHE_DIR", str(tmp_path / "cache"))


def _head(lm) -> QuantLinear:
    head = lm.model.head
    assert isinstance(head, QuantLinear)
    return head


def test_q6_k_head_keeps_the_file_blocks(q4_0_file):
    gf = GGUFFile(q4_0_file)
    try:
        info = gf.tensors["output.weight"]
        assert info.type_name == "Q6_K" and gf.tensors["blk.0.attn_q.weight"].type_name == "Q4_0"
        want = gf.dequantize("output.weight").float()
    finally:
        gf.close()
    rows, cols = info.shape
    m = _head(load_model(q4_0_file, dtype=torch.float32, device="cpu", quantization="auto")).matrix
    assert (m.kind, m.rows, m.cols) == ("q6k", rows, cols)
    # 210 bytes a 256 weights as in the file (6.5625 bits), rows padded to 16, rounded up to a cache line
    assert m.nbytes == -(-(-(-rows // 16) * 16 * cols // 256 * 210) // 64) * 64
    got = torch.from_numpy(np.asarray(m.dequantize()))
    torch.testing.assert_close(got, want, rtol=1.2e-7, atol=0)


def test_q6_k_logits_match_the_dequantized_file(q4_0_file):
    kept = load_model(q4_0_file, dtype=torch.float32, device="cpu", quantization="auto")
    dense = load_model(q4_0_file, dtype=torch.float32, device="cpu", quantization="none")
    head = _head(kept)
    w = torch.from_numpy(np.asarray(head.matrix.dequantize())).double()
    torch.testing.assert_close(w.float(), dense.model.lm_head.float(), rtol=1.2e-7, atol=0)
    # The head alone: x @ W^T within the int8 activation rounding, sum_b amax(x_b) / 254 * sum_b |w| (+ f32 slack).
    x = torch.randn(5, head.matrix.cols, generator=torch.Generator().manual_seed(3)) * 2
    got = head(x).double()
    exact = x.double() @ w.t()
    amax = x.double().abs().reshape(5, -1, 32).amax(-1)  # [5, blocks]
    bound = amax @ w.abs().reshape(w.shape[0], -1, 32).sum(-1).t() / 254 * 1.0001 + 1e-5 * (exact.abs() + 1)
    assert ((got - exact).abs() <= bound).all()
    assert ((got - exact).abs() > 0).any()  # the activations really went through int8
    seq = [1, 40, 41, 300, 7, 9, 120, 250, 251, 33, 34, 35, 36, 100, 200, 17, 18]
    diff = float((_logprobs_ironlm(kept, seq) - _logprobs_ironlm(dense, seq)).abs().max())
    assert diff < LOGPROB_BOUND, diff
