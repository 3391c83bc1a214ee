"""Sliding-window attention against transformers: config parsing (Mistral, Qwen2 use_sliding_window /
max_window_layers, layer_types), paged steps through the torch and CPU backends (prefill chunks with and without
cached context, decode rows) and greedy generation through `LLM`, on tiny models with window 32, prompts of 100+
tokens and decoding well past the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ironlm import LLM, SamplingParams, _core
from ironlm.attention import get_backend
from ironlm.model import lean, load_model
from ironlm.model.config import ModelConfig
from tiny_models import PagedSequences, load_hf_reference, make_kv_caches, make_tiny_model, tiny_hf_config

WINDOW = 32
TOL = 1e-4  # fp32 log-softmax
MODELS = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    # layer 0 full, layer 1 sliding (transformers: layers >= max_window_layers slide)
    "qwen2-mixed": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
}


def test_config_mistral_window_on_every_layer():
    cfg = ModelConfig.from_hf(tiny_hf_config("mistral", sliding_window=WINDOW, num_hidden_layers=3))
    assert cfg.layer_windows == [WINDOW] * 3
    assert cfg.max_model_len == 512  # not capped at the window any more
    assert ModelConfig.from_hf(tiny_hf_config("mistral")).layer_windows == [None, None]


def test_config_qwen2_rules():
    on = tiny_hf_config("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                        num_hidden_layers=4)
    assert ModelConfig.from_hf(on).layer_windows == [None, None, WINDOW, WINDOW]
    off = tiny_hf_config("qwen2", use_sliding_window=False, sliding_window=WINDOW, max_window_layers=0)
    assert ModelConfig.from_hf(off).layer_windows == [None, None]
    # an explicit per-layer pattern wins over max_window_layers
    pattern = tiny_hf_config("qwen3", head_dim=128, use_sliding_window=True, sliding_window=WINDOW,
                             num_hidden_layers=4, max_window_layers=0,
                             layer_types=["sliding_attention", "full_attention"] * 2)
    cfg = ModelConfig.from_hf(pattern)
    assert cfg.layer_windows == [WINDOW, None, WINDOW, None]
    assert cfg.max_model_len == 512


def windowed_reference(case: dict, window: int) -> torch.Tensor:
    """Dense fp64 attention of each query row (absolute position p) over its history's keys (p - window, p]."""
    q = case["q"].double()
    hq = q.shape[1]
    out = torch.zeros_like(q)
    start = 0
    for hk, hv, c, n in zip(case["hist_k"], case["hist_v"], case["ctx_lens"], case["q_lens"]):
        grp = hq // hk.shape[1]
        kk, vv = hk.double().repeat_interleave(grp, dim=1), hv.double().repeat_interleave(grp, dim=1)
        for j in range(n):
            lo, hi = max(0, c + j + 1 - window), c + j + 1
            s = torch.einsum("hd,shd->hs", q[start + j], kk[lo:hi]) * case["scale"]
            out[start + j] = torch.einsum("hs,shd->hd", torch.softmax(s, -1), vv[lo:hi])
        start += n
    return out


# (context lengths, query lengths): decode rows around page edges and the window, fresh prompts longer than the
# window, chunks over cached context, one sequence shorter than the window
WINDOW_CASE = ([0, 0, 40, 9, 5, 17, 70], [1, 45, 12, 1, 3, 1, 1])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [1, 7, 16, 1000])
def test_backends_match_windowed_reference(backend, window):
    from test_attention_torch import make_case

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        case = make_case(*WINDOW_CASE, hq=6, hkv=2, d=64, block_size=8, dtype=dtype, seed=window)
        out = get_backend(backend).forward(case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"],
                                           case["meta"], case["scale"], window=window)
        torch.testing.assert_close(out.double(), windowed_reference(case, window), atol=tol, rtol=tol)


def test_cascade_prefix_is_not_used_under_a_window():
    """Decode rows sharing leading blocks (the torch path's cascade case) still attend only inside the window."""
    from test_attention_torch import make_case

    case = make_case([70, 70, 70], [1, 1, 1], hq=4, hkv=2, d=64, block_size=8, dtype=torch.float32, seed=3)
    bt = case["meta"].block_tables
    bt[1:, :6] = bt[0, :6]  # shared first 6 blocks: the histories must match there too
    for i in (1, 2):
        for key in ("hist_k", "hist_v"):
            case[key][i][:48] = case[key][0][:48]
    for backend in ("torch", "cpu"):
        out = get_backend(backend).forward(case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"],
                                           case["meta"], case["scale"], window=20)
        torch.testing.assert_close(out.double(), windowed_reference(case, 20), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return path, load_hf_reference(path)


def _hf_logprobs(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)


def _paged_worst(lm, hf, block_size: int = 16, decode_steps: int = 24) -> float:
    """Two sequences: A prefilled in chunks (the later ones over cached context), B in one 70-token chunk and
    then decoding next to A's chunks (mixed steps), then both decode side by side past the window; the worst
    |log-softmax diff| over every computed row."""
    rng = np.random.default_rng(0)
    vocab = lm.config.vocab_size
    lens = [120 + decode_steps, 72 + decode_steps]
    seqs = [rng.integers(6, vocab, size=n).tolist() for n in lens]
    ref = [_hf_logprobs(hf, s) for s in seqs]
    max_blocks = max(lens) // block_size + 2
    num_blocks = 2 * max_blocks + 1
    pager = PagedSequences(2, block_size, num_blocks, max_blocks)
    kv = make_kv_caches(lm.config, num_blocks, block_size)
    worst = 0.0
    steps = [{0: (0, 50), 1: (0, 70)}, {0: (50, 100), 1: (70, 71)}, {0: (100, 120), 1: (71, 72)}]
    steps += [{0: (120 + i, 121 + i), 1: (72 + i, 73 + i)} for i in range(decode_steps)]
    for chunks in steps:
        inp, pos, meta, _ = pager.step({i: seqs[i][a:b] for i, (a, b) in chunks.items()})
        got = torch.log_softmax(lm.model(inp, pos, kv, meta, torch.arange(inp.shape[0])), dim=-1)
        owner = np.repeat(list(chunks), [b - a for a, b in chunks.values()])
        for row in range(inp.shape[0]):
            worst = max(worst, float((got[row] - ref[owner[row]][int(pos[row])]).abs().max()))
    return worst


@pytest.mark.parametrize("backend", ["torch", "cpu", "cpu-no-lean"])
def test_paged_steps_match_transformers(model, backend, monkeypatch):
    """torch: masks in SDPA. cpu: the core kernel for decode rows of mixed steps (paged_decode_attention) and
    the lean decode step (decode_attention_qkv); cpu-no-lean: the kernel's all-decode call that also writes the
    step's K/V. Each path must see the window (spied on)."""
    path, hf = model
    lm = load_model(path, dtype=torch.float32, device="cpu", attn_backend=get_backend(backend.removesuffix("-no-lean")))
    assert any(w == WINDOW for w in lm.config.layer_windows)
    seen: dict[str, set] = {}

    def spy(name: str):
        real = getattr(_core, name)

        def call(*args, **kwargs):
            window = kwargs["window"] if "window" in kwargs else args[-1]  # decode_attention_qkv: last positional
            seen.setdefault(name, set()).add((window, "slot_mapping" in kwargs))
            return real(*args, **kwargs)
        return call

    for name in ("paged_decode_attention", "decode_attention_qkv"):
        monkeypatch.setattr(_core, name, spy(name))
    # The lean step layer by layer, where the spies see its calls (the fused stack passes each layer's window to
    # the same kernel inside one core call: tests/test_lean_stack.py, SmolLM3's sliding layer).
    monkeypatch.setattr(lean, "FUSE_LAYERS", False)
    if backend == "cpu-no-lean":
        monkeypatch.setattr(lean, "LEAN_MAX_TOKENS", 0)
    assert _paged_worst(lm, hf) < TOL
    expected_windows = set(lm.config.layer_windows)
    if backend == "torch":
        assert not seen
    elif backend == "cpu":
        assert {w for w, _ in seen["paged_decode_attention"]} == expected_windows
        assert {w for w, _ in seen["decode_attention_qkv"]} == expected_windows
    else:
        assert seen["paged_decode_attention"] >= {(w, True) for w in expected_windows}
        assert "decode_attention_qkv" not in seen


def test_window_changes_the_result(model):
    """Guard against a window that does nothing: full attention on the same weights is far from transformers."""
    path, hf = model
    lm = load_model(path, dtype=torch.float32, device="cpu")
    for layer in lm.model.layers:
        layer.window = None
    assert _paged_worst(lm, hf, decode_steps=4) > 1e-2


def _hf_greedy(hf, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    with torch.inference_mode():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new):
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            out = hf(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def test_greedy_generation_matches_transformers(model):
    path, hf = model
    rng = np.random.default_rng(1)
    vocab = hf.config.vocab_size
    prompts = [rng.integers(6, vocab, size=n).tolist() for n in (100, 131)]
    max_new = 40  # decode goes ~1.25 windows past the prompt
    llm = LLM(str(path), num_kv_blocks=64, block_size=16, seed=0, dtype="float32",
              max_num_batched_tokens=64, max_num_seqs=4)  # chunked prefill: later chunks over cached context
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want_tokens, want_lps = _hf_greedy(hf, prompt, max_new)
        got = out.outputs[0]
        assert list(got.token_ids) == want_tokens
        lps = [d[t].logprob for d, t in zip(got.logprobs, got.token_ids)]
        assert lps == pytest.approx(want_lps, abs=1e-4)
    # Blocks are released only where every layer slides (Mistral), never under a full-attention layer.
    every_layer = None not in llm.engine.model_config.layer_windows
    assert (llm.engine.scheduler.stats()["window_freed_blocks"] > 0) == every_layer


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    arch, overrides = MODELS["mistral"]
    path = make_tiny_model(tmp_path_factory.mktemp("mistral-pool"), arch, **overrides)
    return path, load_hf_reference(path)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_sequences_longer_than_the_pool_run_inside_the_window(mistral, backend):
    """Every layer slides, so blocks wholly before the window go back to the pool while their sequence runs: a
    271-token sequence (17 blocks of 16) runs on a 14-block pool (224 tokens) next to a 190-token one, and greedy
    outputs still match transformers. Released blocks are reused at once and the tables show block 0 in their
    place, so a backend that read outside the window unmasked would diverge."""
    path, hf = mistral
    rng = np.random.default_rng(2)
    vocab = hf.config.vocab_size
    lens, max_new = (150, 231), 40
    prompts = [rng.integers(6, vocab, size=n).tolist() for n in lens]
    # Chunks of 64: one sequence holds at most (32 + 64) / 16 + 1 = 7 blocks, 14 with prefix caching (a cached
    # path keeps its released blocks until the window has passed it).
    llm = LLM(str(path), num_kv_blocks=14, block_size=16, seed=0, dtype="float32", max_num_batched_tokens=64,
              max_num_seqs=2, attention_backend=backend)
    assert llm.engine.max_model_len >= max(lens) + max_new  # not capped at the pool's 224 tokens
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, prompt, max_new)[0]
    stats = llm.engine.scheduler.stats()
    # Each sequence's last query (position n + 38) still sees the window: (n + 39 - 32) // 16 blocks were
    # released before it (more if a preemption made it recompute).
    assert stats["window_freed_blocks"] >= sum((n + max_new - 1 - WINDOW) // 16 for n in lens)
    assert stats["blocks_used"] == 0
