"""The core's `residual_add` (a branch's post-norm, residual multiplier and add in one pass) and the lean decode
step that uses it: the binding has the bits of the torch ops it replaces, and the lean step of the families whose
residual adds it carries (OLMo 2's post-norms without pre-norms, Granite's residual multiplier) equals the ordinary
forward bit for bit, in fp32 and bf16. Gemma's post-norms are covered by test_family_gemma's lean-step test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ironlm import _core
from ironlm.core_views import CORE_DTYPES, as_numpy
from ironlm.model import load_model
from ironlm.model.layers import rms_norm
from lean_batch import assert_same_step, decode_batch
from tiny_families import FAMILY_VARIANTS, make_family_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("normed", "weighted", "scale"), [(True, True, None), (True, False, 0.22),
                                                           (True, True, 1.7), (False, False, 0.22)])
def test_residual_add_has_the_bits_of_the_torch_ops(dtype, normed, weighted, scale) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 640, generator=gen) * 4).to(dtype)
    h = torch.randn(3, 640, generator=gen).to(dtype)
    w = (1 + torch.randn(640, generator=gen)).to(dtype) if weighted else None
    branch = rms_norm(x, w, 1e-6) if normed else x
    want = h + (branch * scale if scale is not None else branch)
    _core.residual_add(as_numpy(x), as_numpy(h), norm=normed, weight=None if w is None else as_numpy(w), eps=1e-6,
                       scale=scale, dtype=CORE_DTYPES[dtype], threads=2)
    assert torch.equal(h, want)


def test_residual_add_rejects_bad_arguments() -> None:
    x, h = np.ones((2, 8), np.float32), np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="weight"):
        _core.residual_add(x, h, norm=False, weight=np.ones(8, np.float32))
    with pytest.raises(ValueError, match="weight"):
        _core.residual_add(x, h, norm=True, weight=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="h"):
        _core.residual_add(x, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        _core.residual_add(x, h, dtype="int8")


@pytest.fixture(scope="module", params=["olmo2", "granite"])
def family(request, tmp_path_factory):
    fam, over = FAMILY_VARIANTS[request.param]
    return request.param, make_family_model(tmp_path_factory.mktemp(request.param), fam, **over)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_step_equals_the_ordinary_forward(family, dtype, monkeypatch) -> None:
    from ironlm.attention import CpuAttention

    name, path = family
    model = load_model(path, dtype=dtype, device="cpu", attn_backend=CpuAttention()).model
    cfg = model.config
    assert cfg.lean_supported
    layer = model.layers[0]
    if name == "olmo2":  # post-norms on both branches and no pre-norms: both adds go through residual_add
        assert layer.input_norm is None and layer.attn_out_norm is not None and layer.residual_scale is None
    else:
        assert layer.residual_scale == pytest.approx(0.22) and layer.attn_out_norm is None
    assert not layer.fuse_attn_residual and not layer.fuse_mlp_residual
    calls: list[int] = []
    real = _core.residual_add

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_core, "residual_add", spy)
    model._lean.clear()
    got = decode_batch(model, dtype, True, monkeypatch)
    assert 3 in model._lean and len(calls) == 2 * cfg.num_layers, "the lean step's residual adds were not taken"
    want = decode_batch(model, dtype, False, monkeypatch)
    assert len(calls) == 2 * cfg.num_layers, "the ordinary forward took the lean step"
    assert_same_step(got, want)
