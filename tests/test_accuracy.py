"""The accuracy gate (issue 10): perplexity of each weight mode on the first 512 tokens of benches/data/ppl_text.txt.

Each bound sits at a modest margin over the value measured on a 2-core AVX-512 (VNNI, BF16) machine, stated next to
it; the full-text figures are in BENCHMARKS.md ("Accuracy"). A bound that fails means a kernel or loader change
moved the numerics, not noise: every path here is deterministic on one machine.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ironlm.bench import perplexity as pp
from ironlm.bench.llama_cpp import find_binary
from ironlm.exceptions import LlamaCppNotBuilt
from ironlm.model.linear import dense_prefill_pays
from tiny_models import load_hf_gguf_reference, make_tiny_gguf, make_tiny_model, make_tiny_tokenizer

N_TOKENS = 512
CHUNK = 128  # 4 chunks: every chunk after the first attends to earlier ones through the paged cache


@pytest.fixture(scope="module")
def models():
    """Each mode's model loaded once for the module (loading, not scoring, is most of this file's time)."""
    cache: dict[str, object] = {}

    def get(mode: str):
        if mode not in cache:
            cache[mode] = pp.load(None, mode)
        return cache[mode]
    return get


@pytest.fixture(scope="module")
def reference(models):
    """The fp32 (`none`) model, the slice's token ids and their logprobs."""
    loaded = models("none")
    tokens = pp.text_token_ids(loaded.tokenizer)[:N_TOKENS]
    assert len(tokens) == N_TOKENS
    return loaded, tokens, pp.token_logprobs(loaded, tokens, chunk_size=CHUNK)


def _rel_to_fp32(mode: str, models, reference) -> float:
    _, tokens, ref_lp = reference
    return pp.perplexity(pp.token_logprobs(models(mode), tokens, chunk_size=CHUNK)) / pp.perplexity(ref_lp) - 1


def test_fp32_matches_transformers(reference):
    loaded, tokens, lp = reference
    hf_lp = pp.hf_token_logprobs(load_hf_gguf_reference(loaded.path), tokens)
    # measured: 1.1e-7 relative perplexity, 1.6e-5 largest per-token logprob difference
    assert abs(pp.perplexity(lp) / pp.perplexity(hf_lp) - 1) < 1e-3
    assert np.abs(lp - hf_lp).max() < 1e-3


def _auto_bound() -> float:
    """`auto`'s bound for the path a 128-row chunk takes on this CPU (the measured values are beside its case)."""
    return 0.004 if dense_prefill_pays() else 0.008


@pytest.mark.parametrize(("mode", "bound"), [
    # The file's own Q4_1 blocks kept quantized, over the 16-bit KV cache kv_cache_dtype auto gives them (as the
    # engine serves them: bf16 on CPUs with native bf16, whose chunks then attend on the core's bf16 tiles). A
    # 128-token chunk is a "large batch": on CPUs with AMX it runs a dense bf16 GEMM over the dequantized blocks,
    # measured +0.160% on a Xeon (full text +0.13%; on a Zen 4 before it kept the int8 kernels, +0.299% over a bf16
    # cache); elsewhere the int8 kernels with activations rounded per 32-block, measured -0.287% on a Zen 4 with
    # AVX-512 BF16 over its bf16 cache (full text +0.21%) and -0.545% on an AVX2-only AMD EPYC (Zen 3), where the
    # windowed protocol gives 2.8919 against llama.cpp's 2.8970 on the same CPU (-0.18%). See _auto_bound.
    ("auto", None),
    # int8, one scale per output channel, requantized from the Q4_1-dequantized weights: a row's largest weight sets
    # its step, which is coarser than Q4_1's per-32 step on rows with outliers: measured +0.315% (full text +1.07%);
    # over its bf16 cache +0.121% on a Zen 4 (+0.197% over f16, +0.027% over f32 there).
    ("int8", 0.006),
    # int4 round-to-nearest in groups of 32 from the dequantized Q4_1 weights: a second 4-bit rounding on top of the
    # file's own, with a symmetric grid instead of Q4_1's min+scale: measured +4.18% (full text +4.26%); over its
    # bf16 cache +4.17% on a Zen 4.
    ("int4", 0.06),
    # the same dense weights in bfloat16 (8-bit mantissa), fp32 accumulation: measured +0.078% (full text +0.11%).
    ("bf16", 0.0025),
])
def test_mode_perplexity_within_bound(mode, bound, models, reference):
    bound = _auto_bound() if bound is None else bound
    rel = _rel_to_fp32(mode, models, reference)
    assert abs(rel) < bound, f"{mode}: perplexity {100 * rel:+.3f}% vs fp32, bound {100 * bound}%"


def test_gguf_q4_matches_llama_cpp(models, reference):
    """ironlm's `auto` (Q4_1 kept) against llama-perplexity on the same GGUF, text and protocol (4 windows of 128)."""
    try:
        find_binary("llama-perplexity")
    except LlamaCppNotBuilt:
        pytest.skip("llama-perplexity is not built (make llama-cpp)")
    loaded = models("auto")
    _, tokens, _ = reference
    ours = pp.perplexity(pp.window_logprobs(lambda w: pp.token_logprobs(loaded, w), tokens, 128,
                                            pp.added_bos(loaded.tokenizer)))
    theirs = pp.llama_cpp_perplexity(None, pp.TEXT_PATH.read_text(encoding="utf-8"), ctx=128, threads=2, chunks=4)
    assert theirs["windows"] == 4
    # measured: ironlm 2.8965, llama.cpp 2.8942, +0.08% (full text, -c 512: +0.22%) on AVX-512; 2.8919 vs 2.8970, -0.18%,
    # on an AVX2-only AMD EPYC (ironlm takes its int8 kernels there, see _auto_bound); both quantize activations to
    # int8 per 32-block but round and accumulate in a different order. The issue allows +-2%; 1% is our margin.
    assert abs(ours / theirs["ppl_windows"] - 1) < 0.01, (ours, theirs["ppl_windows"])


def test_window_protocol_scores_second_halves_with_bos():
    seen: list[list[int]] = []

    def score(window):
        seen.append(list(window))
        return np.log(np.arange(1, len(window), dtype=np.float64) / 100)  # logprob of target i+1 encodes i

    lp = pp.window_logprobs(score, list(range(10, 30)), ctx=8, bos=1)
    assert seen == [[1, *range(11, 18)], [1, *range(19, 26)]]  # whole windows only; the 4 tail tokens unused
    # as llama-perplexity: the logits of positions first = ctx/2 .. ctx-2, i.e. the targets at 5, 6, 7
    np.testing.assert_allclose(np.exp(lp) * 100, [5, 6, 7] * 2)
    pp.window_logprobs(score, list(range(10, 18)), ctx=8, bos=None)
    assert seen[-1] == list(range(10, 18))  # no BOS: the window's own first token stays
    with pytest.raises(pp.PerplexityArgumentError) as err:
        pp.window_logprobs(score, [1, 2, 3], ctx=8, bos=None)
    assert err.value.param == "ctx"


def test_perplexity_and_argument_errors():
    assert pp.perplexity(np.log(np.array([0.5, 0.25]))) == pytest.approx(math.sqrt(8))
    assert pp.parse_modes("int4, bf16") == ("int4", "bf16")
    with pytest.raises(pp.PerplexityArgumentError) as err:
        pp.parse_modes("none,q5")
    assert err.value.param == "modes" and isinstance(err.value, ValueError)


def test_parse_llama_cpp_output():
    out = "[1]1.5629,[2]2.4952,\n0.17.758 I Final estimate: PPL = 2.5330 +/- 0.09572\n"
    assert pp.parse_llama_cpp_output(out) == (2.533, 0.09572)
    with pytest.raises(RuntimeError, match="no 'Final estimate'"):
        pp.parse_llama_cpp_output("llama_model_load: error loading model")
    cmd = pp.llama_cpp_command("bin/llama-perplexity", "m.gguf", "t.txt", ctx=256, threads=2, chunks=3)
    assert cmd[cmd.index("--ctx-size") + 1] == "256" and cmd[-2:] == ["--chunks", "3"]


def test_added_bos_follows_the_tokenizer():
    assert pp.added_bos(make_tiny_tokenizer(add_bos=True)) == make_tiny_tokenizer().bos_token_id
    assert pp.added_bos(make_tiny_tokenizer(add_bos=False)) is None


def test_cli_table_and_json_on_a_tiny_q4_gguf(tmp_path, capsys):
    from ironlm.bench.cli import main

    gguf = make_tiny_gguf(tmp_path, make_tiny_model(tmp_path), "Q4_1")
    text = tmp_path / "text.txt"
    text.write_text(pp.TEXT_PATH.read_text(encoding="utf-8")[:600], encoding="utf-8")
    out = tmp_path / "ppl.json"
    assert main(["perplexity", "--model", str(gguf), "--text", str(text), "--max-tokens", "80", "--chunk-size", "16",
                 "--window", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert list(rows) == list(pp.MODES) and report["config"]["text_tokens"] == 80
    assert rows["none"]["ppl_rel"] == 0 and rows["none"]["dtype"] == "float32"
    assert rows["bf16"]["dtype"] == "bfloat16" and rows["bf16"]["weight_bytes"] < rows["none"]["weight_bytes"]
    assert rows["auto"]["weight_bytes"] < rows["int8"]["weight_bytes"] < rows["none"]["weight_bytes"]
    for r in rows.values():
        assert r["scored_tokens"] == 79 and r["scored_tokens_windows"] == 2 * 15  # 2 windows of 32, 15 targets each
        assert 1 < r["ppl"] < 1e6 and math.isfinite(r["ppl_windows"])
    assert "int4 g32" in capsys.readouterr().out
    assert main(["perplexity", "--modes", "none,q5"]) == 2
