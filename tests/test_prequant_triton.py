"""Symmetric pre-quantized checkpoints on the GPU's Triton dequant-GEMM (kernels/quant_matmul.py), run here through
the Triton interpreter as tests/test_kernels.py does (TRITON_INTERPRET=1 before triton is imported; a subprocess
when triton was already imported compiled), on a CUDA device for real.

GPTQ sym 4-bit (zero point 8) and compressed-tensors sym W8A16 map exactly onto its signed int4 / int8 weights with
one scale per group; the whole tiny model then differs from transformers on the dequantized weights only by
rounding (the kernel keeps fp32 activations: no int8 activation rounding here). Zero points and act-order are
refused on this path, naming what.
"""

from __future__ import annotations

from triton_mode import DEVICE, IN_PROCESS, ON_GPU, subprocess_test  # first: it sets TRITON_INTERPRET

# isort: split
from types import SimpleNamespace

import pytest
import torch

from ironlm.exceptions import UnsupportedModelError
from prequant_ckpt import Case, make_prequant

# Worst |log-softmax diff| vs transformers on the dequantized weights: fp32 rounding in another summation order
# (measured 1e-5 in the interpreter, the same as dense fp32); a wrong nibble order or scale would be ~1.
EXACT_BOUND = 1e-3


def _triton_model(qdir):
    from ironlm.model import prequant
    from ironlm.model.linear_gpu import TritonQuantLinear
    from ironlm.model.llama import DecoderLM
    from ironlm.model.loader import load_hf_config

    config = load_hf_config(qdir)
    scheme = prequant.detect(qdir, "auto")
    assert scheme is not None
    net = DecoderLM(config, dtype=torch.float32, device=DEVICE)
    prequant.load(net, qdir, scheme, keep=True, backend="triton")
    assert all(isinstance(lin, TritonQuantLinear) for layer in net.layers
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return SimpleNamespace(model=net, config=config)


@pytest.mark.parametrize("case", [Case("gptq", 4, 128, sym=True), Case("ct-pack", 8, 0, sym=True)],
                         ids=["gptq4-sym-g128", "ct-w8a16-channel"])
def test_symmetric_checkpoint_on_triton_dequant_gemm(tmp_path, case):
    import ironlm.kernels.decode_attention as da
    from test_model_hf import _run_and_compare
    from tiny_models import load_hf_reference

    assert ON_GPU or da.interpreted(), "kernels were built without TRITON_INTERPRET=1"
    b = make_prequant(tmp_path, case)
    lm = _triton_model(b.qdir)
    assert lm.model.layers[0].qkv.bits == (4 if case.bits == 4 else 8)
    assert lm.model.layers[0].qkv.group == case.group
    worst = _run_and_compare(lm, load_hf_reference(b.refdir), 4)
    assert worst < EXACT_BOUND, worst


def test_zero_points_and_act_order_are_refused_on_the_gpu_path(tmp_path):
    from ironlm.model import prequant

    asym = make_prequant(tmp_path / "asym", Case("awq"))
    with pytest.raises(UnsupportedModelError, match="asymmetric"):
        prequant.spec_for(prequant.detect(asym.qdir, "auto"), "auto", torch.device("cuda"), None)
    act = make_prequant(tmp_path / "act", Case("gptq", 4, 128, sym=True, act_order=True))
    with pytest.raises(UnsupportedModelError, match="act-order"):
        _triton_model(act.qdir)


if not IN_PROCESS:  # triton was imported in compiled mode before this module
    for _name in [n for n in globals() if n.startswith("test_")]:
        del globals()[_name]
    test_in_interpreter_subprocess = subprocess_test(__file__)
