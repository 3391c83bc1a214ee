"""The fused lean step (`_core.LeanStack`: every layer of a decode step in one core call): it is taken where every
layer is a plain pre-norm block over block-quantized weights (MoE blocks included) or over dense weights with the
core's packed copies, and there it equals both the per-layer lean step (`lean_layer`, the same kernels called one by
one) and the ordinary forward bit for bit: logits and every cache row, under float32 and bfloat16 caches, over
biases (Qwen2), per-head qk-norm (Qwen3), NoPE and sliding layers (SmolLM3). Models it does not implement
(post-norms, shared experts) keep the per-layer step; bad arguments are ValueErrors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ironlm import _core
from ironlm.attention import CpuAttention
from ironlm.model import lean, linear, load_model
from ironlm.model.linear import CORE_MAX_ROWS, PACKED_F32_MAX_ROWS
from lean_batch import assert_same_step, decode_batch
from tiny_families import FAMILY_VARIANTS, make_family_model
from tiny_models import make_tiny_model

CASES = {  # name -> (maker, quantization)
    "llama-int4": (lambda p: make_tiny_model(p, arch="llama"), "int4"),
    "qwen2-int8": (lambda p: make_tiny_model(p, arch="qwen2"), "int8"),
    "qwen3-int8": (lambda p: make_tiny_model(p, arch="qwen3"), "int8"),
    "smollm3-int4": (lambda p: make_family_model(p, "smollm3", **FAMILY_VARIANTS["smollm3"][1]), "int4"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def quantized(request, tmp_path_factory):
    make, quant = CASES[request.param]
    path = make(tmp_path_factory.mktemp(request.param))
    return request.param, load_model(path, dtype="float32", quantization=quant, device="cpu",
                                     attn_backend=CpuAttention()).model


def _spy(monkeypatch: pytest.MonkeyPatch, model) -> list[int]:
    """Counts the fused stack's runs (the stack is built on the first step)."""
    runs: list[int] = []
    model._lean_stack = None
    real = lean._build

    class Counting:
        def __init__(self, inner: _core.LeanStack) -> None:
            self.inner = inner

        def run(self, *args) -> list[int]:
            runs.append(1)
            return self.inner.run(*args)

        @property
        def dtype(self) -> str:
            return self.inner.dtype

    def build(m):
        built = real(m)
        if built is None:
            return None
        return lean.Stack(Counting(built.core), built.moe, built.max_rows, built.dense)  # type: ignore[arg-type]

    monkeypatch.setattr(lean, "_build", build)
    return runs


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_the_fused_step_equals_the_per_layer_step_and_the_forward(quantized, cache, monkeypatch) -> None:
    name, model = quantized
    runs = _spy(monkeypatch, model)
    got = decode_batch(model, cache, True, monkeypatch)
    assert runs == [1], f"{name}: the fused stack did not run"
    monkeypatch.setattr(lean, "FUSE_LAYERS", False)
    per_layer = decode_batch(model, cache, True, monkeypatch)
    assert runs == [1]
    assert_same_step(got, per_layer)
    assert_same_step(got, decode_batch(model, cache, False, monkeypatch))


@pytest.mark.skipif(not _core.PackedBf16.available(), reason="the packed bf16 kernel needs AVX-512 BF16")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_bf16_layers_run_on_their_packed_copies(arch, tmp_path, monkeypatch) -> None:
    """An HF checkpoint in bf16: every linear on the core's packed copy (DenseLinear.core_packed), the same bits as
    the per-layer step and the ordinary forward."""
    model = load_model(make_tiny_model(tmp_path, arch=arch), dtype="bfloat16", quantization="none", device="cpu",
                       attn_backend=CpuAttention()).model
    runs = _spy(monkeypatch, model)
    got = decode_batch(model, torch.bfloat16, True, monkeypatch)
    assert runs == [1]
    built = lean.stack(model)
    assert built is not None and built.dense and built.core.inner.dtype == "bfloat16"
    monkeypatch.setattr(lean, "FUSE_LAYERS", False)
    assert_same_step(got, decode_batch(model, torch.bfloat16, True, monkeypatch))
    assert_same_step(got, decode_batch(model, torch.bfloat16, False, monkeypatch))


@pytest.mark.skipif(not _core.PackedF32.available(), reason="the packed f32 kernel needs AVX2 and FMA")
@pytest.mark.parametrize("limit", [CORE_MAX_ROWS, PACKED_F32_MAX_ROWS])
def test_dense_f32_layers_take_the_stack_up_to_their_packed_rows(tmp_path, monkeypatch, limit: int) -> None:
    """float32 dense weights: their packed copies serve 1 to `packed_f32_rows()` rows (CORE_MAX_ROWS on AVX-512
    CPUs, PACKED_F32_MAX_ROWS on AVX2 ones: both limits here), the stack's row limit; a 3-row step takes the stack within
    it, with the bits of the per-layer step and the ordinary forward, and stays per layer past it; a one-stream
    generation gives the same tokens and logprobs with the stack as without."""
    from ironlm import LLM, SamplingParams

    monkeypatch.setattr(linear, "packed_f32_rows", lambda: limit)
    llm = LLM(str(make_tiny_model(tmp_path, arch="llama")), dtype="float32", quantization="none",
              kv_cache_memory="64MiB", max_model_len=256, enable_prefix_caching=False)
    model = llm.engine.runner.model
    runs, max_tokens = _spy(monkeypatch, model), lean.LEAN_MAX_TOKENS
    got = decode_batch(model, torch.float32, True, monkeypatch)
    assert len(runs) == (limit >= 3) and lean.stack(model) is not None and lean.stack(model).max_rows == limit
    monkeypatch.setattr(lean, "FUSE_LAYERS", False)
    assert_same_step(got, decode_batch(model, torch.float32, True, monkeypatch))
    assert_same_step(got, decode_batch(model, torch.float32, False, monkeypatch))
    monkeypatch.setattr(lean, "FUSE_LAYERS", True)
    monkeypatch.setattr(lean, "LEAN_MAX_TOKENS", max_tokens)

    def one() -> tuple[list[int], list[float]]:
        out = llm.generate([{"prompt_token_ids": [5, 9, 14, 3, 7]}],
                           SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [next(iter(d.values())).logprob for d in out.logprobs]

    fused = one()
    assert len(runs) >= 11
    monkeypatch.setattr(lean, "FUSE_LAYERS", False)
    assert one() == fused


def test_models_it_does_not_implement_keep_the_per_layer_step(tmp_path) -> None:
    olmo2 = make_family_model(tmp_path / "o", "olmo2", **FAMILY_VARIANTS["olmo2"][1])
    post_norms = load_model(olmo2, dtype="float32", quantization="int8", device="cpu",
                            attn_backend=CpuAttention()).model
    assert lean.stack(post_norms) is None  # post-norms, no pre-norms: the adds are not fused


def test_bad_arguments_are_value_errors(quantized) -> None:
    _, model = quantized
    layer = model.layers[0]
    norm = layer.input_norm.data.numpy()
    mats = {"qkv": layer.qkv.matrix, "o": layer.o.matrix, "gate_up": layer.gate_up.matrix,
            "down": layer.down.matrix}
    args = dict(input_norm=norm, post_norm=norm, scale=0.1, num_heads=layer.num_heads, eps=1e-5, **mats)
    with pytest.raises(ValueError, match="activation"):
        _core.LeanLayer(**args, activation="relu")
    with pytest.raises(ValueError, match="input_norm"):
        _core.LeanLayer(**{**args, "input_norm": norm.astype(np.float64)})
    cfg = model.config
    stack = _core.LeanStack([_core.LeanLayer(**args)], cfg.hidden_size)
    cache = np.zeros((4, 4, cfg.num_kv_heads, cfg.head_dim), np.float32)
    one = (np.zeros((1, 1), np.int32), np.ones(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64), [])
    for h, caches, param in [(np.zeros((1, cfg.hidden_size), np.float32), [], "caches"),
                             (np.zeros((1, cfg.hidden_size + 1), np.float32), [(cache, cache.copy())], "h")]:
        with pytest.raises(ValueError) as err:
            stack.run(h, caches, *one)
        assert err.value.param == param
    bad = _core.LeanStack([_core.LeanLayer(**{**args, "o": layer.qkv.matrix})], cfg.hidden_size)
    k, v = cache.copy(), cache.copy()
    with pytest.raises(ValueError) as err:
        bad.run(np.ones((1, cfg.hidden_size), np.float32), [(k, v)], *one)
    assert err.value.param == "o"
    assert not k.any() and not v.any(), "a rejected step wrote the cache"


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "topk_softmax"])
@pytest.mark.parametrize(("renormalize", "scaling"), [(False, 1.0), (True, 1.0), (True, 2.5)])
def test_the_core_router_chooses_as_route_py(scoring, renormalize, scaling) -> None:
    from ironlm.model.moe.route import RouteSpec, route

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 48, generator=gen), torch.randn(48, 16, generator=gen) * 0.5
    bias = torch.randn(16, generator=gen)
    spec = RouteSpec(num_experts=16, top_k=4, scoring=scoring, renormalize=renormalize, scaling=scaling)
    want_w, want_ids = route(x @ w, spec, bias)
    got_w, got_ids = _core.moe_route(x.numpy(), w.numpy(), 4, scoring, renormalize, 0.0, scaling, bias.numpy())
    assert np.array_equal(got_ids, want_ids.numpy())
    np.testing.assert_allclose(got_w, want_w.numpy(), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError) as err:
        _core.moe_route(x.numpy(), w.numpy(), 4, "relu")
    assert err.value.param == "scoring"


@pytest.fixture(scope="module", params=["mixtral", "olmoe", "qwen3_moe"])
def moe(request, tmp_path_factory):
    from tiny_moe import make_moe_model

    path = make_moe_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, load_model(path, dtype="float32", quantization="int8", device="cpu",
                                     attn_backend=CpuAttention()).model


def test_moe_layers_run_in_the_stack(moe, monkeypatch) -> None:
    """MoE layers in the fused step: logits and cache rows equal the per-layer step's and the ordinary forward's bit
    for bit (every path routes on the core), and the experts' streamed bytes are counted on their blocks as the
    per-layer step counts them."""
    name, model = moe
    blocks = [layer.moe for layer in model.layers if layer.moe is not None]
    assert blocks and all(b.core is not None for b in blocks)
    runs = _spy(monkeypatch, model)
    before = [b.streamed for b in blocks]
    got = decode_batch(model, torch.float32, True, monkeypatch)
    assert runs == [1], f"{name}: the fused stack did not run"
    fused_bytes = [b.streamed - s for b, s in zip(blocks, before, strict=True)]
    monkeypatch.setattr(lean, "FUSE_LAYERS", False)
    want = decode_batch(model, torch.float32, True, monkeypatch)
    assert [b.streamed - s - f for b, s, f in zip(blocks, before, fused_bytes, strict=True)] == fused_bytes
    assert all(f > 0 for f in fused_bytes)
    assert_same_step(got, want)
    assert_same_step(got, decode_batch(model, torch.float32, False, monkeypatch))


def test_moe_blocks_it_does_not_implement_keep_the_per_layer_step(tmp_path) -> None:
    from tiny_moe import make_moe_model

    shared = load_model(make_moe_model(tmp_path, "qwen2_moe"), dtype="float32", quantization="int8", device="cpu",
                        attn_backend=CpuAttention()).model
    assert any(layer.moe is not None and layer.moe.shared is not None for layer in shared.layers)
    assert lean.stack(shared) is None
