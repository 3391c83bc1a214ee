"""Structured outputs in the core: the tokenizer bridge, masks through Scheduler.schedule/take_bitmask/update
(forks, preemption, finishing), the sampler applying them, and compile errors. The API half (HTTP, tools, the
large validity runs) is tested elsewhere."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch

from core_utils import make_scheduler
from ironlm import LLM, GrammarError, SamplingParams, _core
from ironlm.sampler import Sampler
from ironlm.sampler.bitmask import apply_token_bitmask, unpack_bitmask
from ironlm.structured import StructuredOutputsParams
from ironlm.structured.compiler import GrammarCache
from ironlm.structured.vocab import token_vocab
from tiny_models import EOS_ID, IM_END_ID, make_tiny_model, make_tiny_tokenizer

EOS = [EOS_ID, IM_END_ID]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return token_vocab(tok)


@pytest.fixture(scope="module")
def compiler(vocab):
    # 8 columns of LM-head padding past the tokenizer: never allowed.
    return _core.GrammarCompiler(vocab.token_bytes, eos_token_ids=EOS, vocab_size=len(vocab.token_bytes) + 8,
                                 special_token_ids=vocab.special_token_ids)


def _allowed(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    return unpack_bitmask(torch.from_numpy(bits), vocab_size).numpy()


def _text(vocab, ids: list[int]) -> str:
    return b"".join(vocab.token_bytes[t] for t in ids if t not in EOS).decode()


def _drive(sched: _core.Scheduler, vocab_size: int, rng: np.random.Generator) -> dict[int, tuple[list[int], str]]:
    """schedule -> take_bitmask -> sample uniformly among each row's allowed tokens -> update, until done."""
    done: dict[int, tuple[list[int], str]] = {}
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        sampled = rng.integers(6, 256, size=plan.num_samples)  # plain rows: any byte token
        got = sched.take_bitmask()
        if len(plan.mask_rows):
            assert got is not None
            rows, bits = got
            np.testing.assert_array_equal(rows, plan.mask_rows)
            allowed = _allowed(bits, vocab_size)
            for i, r in enumerate(rows):
                choices = np.flatnonzero(allowed[i])
                assert len(choices) and choices.max() < vocab_size - 8, "padding ids are never allowed"
                sampled[r] = rng.choice(choices)
        else:
            assert got is None
        for _, slot, reason, _ in sched.update(sampled):
            done[slot] = (sched.output_token_ids(slot), reason)
    assert not sched.has_unfinished()
    return done


# ---- the tokenizer bridge -------------------------------------------------------------------------

def test_byte_level_vocab_matches_decode(tok, vocab):
    assert vocab.byte_level
    assert set(vocab.special_token_ids) >= {0, 1, 2, 3, 4, 5}
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(6, len(vocab.token_bytes), size=int(rng.integers(1, 12))).tolist()
        text = b"".join(vocab.token_bytes[i] for i in ids)
        assert text.decode("utf-8", "replace") == tok.decode(ids)


def _sentencepiece_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁the", "▁cat", "a", "b", "c", "ab", "▁yes", "▁no", "é", "1", "2"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True,
                               unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"), pieces


def test_sentencepiece_vocab_and_masks():
    tok, pieces = _sentencepiece_tokenizer()
    v = token_vocab(tok)
    assert not v.byte_level
    assert v.token_bytes[pieces.index("<0x41>")] == b"A"
    assert v.token_bytes[pieces.index("▁the")] == b" the"
    assert v.token_bytes[pieces.index("é")] == "é".encode()
    assert {0, 1, 2} <= set(v.special_token_ids)
    c = _core.GrammarCompiler(v.token_bytes, eos_token_ids=[2], vocab_size=len(pieces),
                              special_token_ids=v.special_token_ids)
    sched = make_scheduler(64)
    g = c.compile('{"grammars": [{"lark_grammar": "start: \\" the\\" | \\" yes\\" | \\"A\\""}]}')
    slots = [sched.add_request(f"r{i}", [1, 5], 8, eos_token_ids=[2], grammar=g)[0] for i in range(12)]
    # Driven here rather than by _drive: this vocabulary has no padding columns.
    rng = np.random.default_rng(1)
    texts: dict[int, bytes] = {}
    while sched.has_unfinished():
        sched.schedule()
        rows, bits = sched.take_bitmask()
        allowed = _allowed(bits, len(pieces))
        sampled = np.array([rng.choice(np.flatnonzero(allowed[i])) for i in range(len(rows))])
        for _, slot, reason, _ in sched.update(sampled):
            assert reason == "stop"
            texts[slot] = b"".join(v.token_bytes[t] for t in sched.output_token_ids(slot) if t != 2)
    assert set(texts) == set(slots)
    assert set(texts.values()) <= {b" the", b" yes", b"A"}
    assert len(set(texts.values())) > 1, "the masks allow every option"


def test_compiler_rejects_bad_vocab_arguments(vocab):
    with pytest.raises(_core.InvalidArgumentError) as e:
        _core.GrammarCompiler(vocab.token_bytes, eos_token_ids=[], vocab_size=len(vocab.token_bytes))
    assert e.value.param == "eos_token_ids"
    with pytest.raises(_core.InvalidArgumentError) as e:
        _core.GrammarCompiler(vocab.token_bytes, eos_token_ids=EOS, vocab_size=10)
    assert e.value.param == "vocab_size"


# ---- masks in the scheduler -------------------------------------------------------------------------

def test_choice_forced_exactly_with_forks_and_plain_neighbours(compiler, vocab):
    g = compiler.compile('start: "hello world" | "the model" | "token"')
    sched = make_scheduler(256)
    constrained = []
    for i in range(6):
        constrained += sched.add_request(f"g{i}", [1, 40, 41], 32, n=1 + i % 3, eos_token_ids=EOS, grammar=g)
        sched.add_request(f"p{i}", [1, 50, 51], 4, eos_token_ids=EOS)
    done = _drive(sched, compiler.vocab_size, np.random.default_rng(2))
    texts = {_text(vocab, done[s][0]) for s in constrained}
    assert texts <= {"hello world", "the model", "token"}
    assert all(done[s][1] == "stop" for s in constrained)
    stats = sched.mask_stats()
    assert stats["steps"] > 0 and stats["rows"] >= stats["steps"]
    assert stats["compute_s"] > 0 and stats["wait_s"] >= 0


def test_regex_valid_under_preemption_with_a_tiny_kv_pool(compiler, vocab):
    g = compiler.compile(r'start: /[a-e]{10,16}-[0-9]{3}/')
    # 10 blocks of 16 tokens for 8 requests of up to 44 tokens each: they cannot all run at once.
    sched = make_scheduler(10)
    slots = []
    for i in range(8):
        prompt = [1] + list(range(10 + 3 * i, 30 + 3 * i))
        slots += sched.add_request(f"r{i}", prompt, 24, eos_token_ids=EOS, grammar=g)
    done = _drive(sched, compiler.vocab_size, np.random.default_rng(3))
    assert sched.stats()["num_preemptions"] > 0
    for s in slots:
        text = _text(vocab, done[s][0])
        assert re.fullmatch(r"[a-e]{10,16}-[0-9]{3}", text), text
        assert done[s][1] == "stop"


def test_eos_allowed_only_once_the_grammar_accepts(compiler):
    g = compiler.compile("start: /ab+/")
    sched = make_scheduler(64)
    slot = sched.add_request("r", [1, 2], 10, eos_token_ids=EOS, grammar=g)[0]
    a, b = vocab_id(compiler, "a"), vocab_id(compiler, "b")
    sched.schedule()
    _, bits = sched.take_bitmask()
    allowed = _allowed(bits, compiler.vocab_size)[0]
    assert allowed[a] and not allowed[EOS].any()
    sched.update([a])
    sched.schedule()
    sched.update([b])
    sched.schedule()
    _, bits = sched.take_bitmask()
    allowed = _allowed(bits, compiler.vocab_size)[0]
    assert allowed[b] and allowed[EOS].all() and not allowed[a]
    (_, fslot, reason, stop_tok), = sched.update([EOS_ID])
    assert (fslot, reason, stop_tok) == (slot, "stop", None)


def vocab_id(compiler, ch: str) -> int:
    return make_tiny_tokenizer().convert_tokens_to_ids(ch)


def test_plain_batches_compute_no_masks():
    sched = make_scheduler(64)
    sched.add_request("r", [1, 2, 3], 2, eos_token_ids=EOS)
    plan = sched.schedule()
    assert len(plan.mask_rows) == 0 and sched.take_bitmask() is None
    sched.update([7])
    assert sched.mask_stats()["steps"] == 0


# ---- the sampler ------------------------------------------------------------------------------------

def test_sampler_applies_the_mask_before_sampling_and_keeps_raw_logprobs():
    V = 100
    s = Sampler(V, "cpu", max_slots=4, seed=0)
    # logprobs=0: the rows report their chosen token's logprob (the sampler skips it for rows that do not ask)
    s.add(0, SamplingParams(temperature=0.0, logprobs=0), [1])
    s.add(1, SamplingParams(temperature=1.0, top_k=5, seed=3, logprobs=0), [1])
    logits = torch.randn(2, V)
    logits[:, 7] = 50.0  # the unconstrained favourite, disallowed below
    words = np.zeros((2, (V + 31) // 32), np.uint32)
    for row, ids in enumerate(([3, 40], [64, 65, 95])):
        for t in ids:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    bits = words.view(np.int32)
    raw = torch.log_softmax(logits, -1)
    out = s.sample(logits.clone(), np.array([0, 1]), np.array([0, 0]), token_bitmask=(np.array([0, 1]), bits))
    assert out.token_ids[0] == (3 if logits[0, 3] > logits[0, 40] else 40)
    assert out.token_ids[1] in (64, 65, 95)
    np.testing.assert_allclose(out.logprobs, raw[[0, 1], out.token_ids].numpy(), rtol=1e-5, atol=1e-5)


def test_core_bitmask_kernel_matches_torch_unpack():
    rng = np.random.default_rng(4)
    V = 1000  # not a multiple of 32
    bits = rng.integers(-(2**31), 2**31 - 1, size=(5, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    bits[1] = 0
    bits[2] = -1
    rows = np.array([6, 0, 3, 2, 7])
    logits = torch.randn(8, V)
    expect = logits.clone()
    expect[torch.from_numpy(rows)] = expect[torch.from_numpy(rows)].masked_fill(
        ~unpack_bitmask(torch.from_numpy(bits), V), float("-inf"))
    apply_token_bitmask(logits, rows, bits)
    assert torch.equal(logits, expect)
    with pytest.raises(_core.InvalidArgumentError):
        _core.apply_token_bitmask(logits.numpy(), np.array([8, 0, 1, 2, 3]), bits)


# ---- compile errors, end to end ------------------------------------------------------------------------

def _slow_schema(n: int) -> dict:
    return {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{3,{4 + i % 50}}}$"} for i in range(n)}}


def test_bad_and_slow_grammars_fail_alone_in_bounded_time(tmp_path):
    path = make_tiny_model(tmp_path, arch="llama")
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_model_len=128, grammar_compile_timeout=0.05,
              warmup=False)
    engine = llm.engine
    with pytest.raises(GrammarError) as e:
        engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: (")))
    assert e.value.param == "structured_outputs.grammar" and isinstance(e.value, ValueError)

    # A plain request runs in the engine thread while a slow schema compiles (and fails) in another.
    engine.add_request("plain", "hello", SamplingParams(max_tokens=30, ignore_eos=True))
    failed: list[BaseException] = []

    def compile_slow() -> None:
        try:
            engine.compile_grammar(StructuredOutputsParams(json=_slow_schema(1500)))
        except GrammarError as exc:
            failed.append(exc)

    t0 = time.perf_counter()
    worker = threading.Thread(target=compile_slow)
    worker.start()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    worker.join(10)
    assert failed and "longer than" in str(failed[0]) and failed[0].param == "structured_outputs.json"
    assert time.perf_counter() - t0 < 10
    assert steps >= 30
    # Cached failure: the second try answers at once.
    t1 = time.perf_counter()
    with pytest.raises(GrammarError):
        engine.compile_grammar(StructuredOutputsParams(json=_slow_schema(1500)))
    assert time.perf_counter() - t1 < 0.1

    so = StructuredOutputsParams(regex=r"[a-c]{2,4}![0-9]")
    outs = llm.generate(["hi"] * 4, SamplingParams(temperature=1.0, max_tokens=20, structured_outputs=so),
                        use_tqdm=False)
    for o in outs:
        assert re.fullmatch(r"[a-c]{2,4}![0-9]", o.outputs[0].text), o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop"


def test_grammar_cache_is_an_lru_by_text(tok):
    cache = GrammarCache(tok, 337, EOS, cache_size=2, timeout=5.0)
    a = cache.compile('start: "a"')
    assert cache.compile('start: "a"') is a
    cache.compile('start: "b"')
    cache.compile('start: "c"')
    assert cache.compile('start: "a"') is not a  # evicted, compiled again
    assert (cache.hits, cache.misses) == (1, 4)
