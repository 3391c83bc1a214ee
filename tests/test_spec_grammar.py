"""Speculative decoding of structured outputs: a constrained request's n-gram proposal is cut where its grammar
rejects it, each verification row is sampled under the grammar state after the proposals before it, and the
matcher advances by the accepted tokens only. The output must be the plain engine's token for token (greedy and
seeded), valid under the grammar, and the engine must have speculated and cut (asserted, so these tests cannot
pass vacuously). Real llguidance grammars on a tiny random model."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from core_utils import make_scheduler
from ironlm import LLM, GrammarError, SamplingParams, _core
from ironlm.server.metrics import _StatsCollector
from ironlm.structured import StructuredOutputsParams
from ironlm.structured.vocab import token_vocab
from server_utils import RealServer
from tiny_models import EOS_ID, IM_END_ID, make_tiny_model, make_tiny_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "max_batch_tokens": 4096, "cost_model": False}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}}
DOC = '{"name":"abcab","age":12}'
REGEX = r"[a-c]{2,6}-[0-9]{2,3}"
CHOICES = ["hello world", "the model", "token"]
# Prompts that hold text like the answer, so that lookup proposes it (and, past the answer's end or into the
# prompt's separators, what the grammar rejects).
CASES = [
    (StructuredOutputsParams(json=SCHEMA), f"Copy this: {DOC} {DOC} {DOC[:9]}"),
    (StructuredOutputsParams(regex=REGEX), "ab-12 abc-123 ab-12 abc-1"),
    (StructuredOutputsParams(choice=CHOICES), "the model the model hello wor"),
]
KEYS = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_grammar_cut_tokens")


KW = {"num_kv_blocks": 256, "block_size": 4, "seed": 0, "dtype": "float32"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("specgram"), arch="llama"))


@pytest.fixture(scope="module")
def engines(model):
    return LLM(model, **KW), LLM(model, speculative_config=NGRAM, **KW)


def _valid(so: StructuredOutputsParams, text: str) -> bool:
    if so.json is not None:
        doc = json.loads(text)
        return set(doc) == {"name", "age"} and isinstance(doc["name"], str) and len(doc["name"]) <= 8 \
            and type(doc["age"]) is int
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    return text in CHOICES


def _gen(llm: LLM, params: list[SamplingParams], prompts: list[str]) -> list[tuple[list[int], str, str]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason) for o in outs for c in o.outputs]


def _delta(llm: LLM, before: dict) -> dict:
    m = llm.get_metrics()
    return {k: m[k] - before[k] for k in KEYS}


def test_greedy_constrained_output_is_the_plain_engines(engines):
    plain, spec = engines
    before = spec.get_metrics()
    # Constrained and plain requests share the batch (one mask row per verification row, none for the plain).
    prompts = [p for _, p in CASES] + ["abc abc abc ab"]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so, _ in CASES]
    params.append(SamplingParams(temperature=0, max_tokens=12))
    want, got = _gen(plain, params, prompts), _gen(spec, params, prompts)
    assert got == want
    for (so, _), (_, text, reason) in zip(CASES, got, strict=False):
        assert _valid(so, text), (so, text)
        assert reason == "stop"
    d = _delta(spec, before)
    # Forced JSON punctuation is proposed from the prompt and accepted; the rest of the prompt after an answer
    # (or a separator mid-answer) is cut by the grammar.
    assert d["spec_decode_num_draft_tokens"] > 0 and d["spec_decode_num_accepted_tokens"] > 0, d
    assert d["spec_decode_grammar_cut_tokens"] > 0, d
    assert spec.engine.stats()["blocks_used"] == 0
    # /metrics exports the cut as a counter.
    registry = CollectorRegistry()
    registry.register(_StatsCollector(spec.engine.stats, lambda: True, "m"))
    text = generate_latest(registry).decode()
    cut = spec.get_metrics()["spec_decode_grammar_cut_tokens"]
    assert f'ironlm:spec_decode_grammar_cut_tokens_total{{model_name="m"}} {float(cut)}' in text


def test_seeded_sampling_is_the_plain_engines_and_repeats(engines):
    plain, spec = engines
    before = spec.get_metrics()
    prompts = [p for _, p in CASES] * 2
    params = [SamplingParams(temperature=0.8, top_k=40, seed=3 + i, max_tokens=40, n=1 + i % 2,
                             structured_outputs=so) for i, (so, _) in enumerate(CASES * 2)]
    first = _gen(spec, params, prompts)
    assert _gen(spec, params, prompts) == first
    assert _gen(plain, params, prompts) == first
    outs = spec.generate(prompts, params, use_tqdm=False)
    for (so, _), o in zip(CASES * 2, outs, strict=True):
        for c in o.outputs:
            assert _valid(so, c.text), (so, c.text)
    d = _delta(spec, before)
    assert d["spec_decode_num_draft_tokens"] > 0 and d["spec_decode_grammar_cut_tokens"] > 0, d
    assert spec.engine.stats()["blocks_used"] == 0


def test_preemption_keeps_constrained_speculation_exact(engines, model):
    """A KV pool too small for the batch: speculating constrained sequences are preempted and recomputed (their
    matchers keep the verified tokens only); the output is still the plain engine's and no block leaks."""
    plain, _ = engines
    small = LLM(model, speculative_config=NGRAM, **{**KW, "num_kv_blocks": 40})
    prompts = [p for _, p in CASES] * 3
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so, _ in CASES] * 3
    assert _gen(small, params, prompts) == _gen(plain, params, prompts)
    s = small.engine.stats()
    assert s["num_preemptions"] > 0 and s["spec_decode_num_accepted_tokens"] > 0, s
    assert s["blocks_used"] == 0


def test_grammar_errors_still_fail_the_request(engines):
    _, spec = engines
    with pytest.raises(GrammarError) as e:
        spec.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: (")),
                      use_tqdm=False)
    assert isinstance(e.value, ValueError) and e.value.param == "structured_outputs.grammar"
    out = spec.generate([CASES[1][1]], SamplingParams(temperature=0, max_tokens=20,
                                                      structured_outputs=CASES[1][0]), use_tqdm=False)
    assert re.fullmatch(REGEX, out[0].outputs[0].text)


def test_a_draft_model_proposes_under_the_grammar(engines, model):
    """The draft samples its proposals under each sequence's grammar state after its proposals so far
    (`Scheduler.draft_masks`): a self-draft's proposals are then the target's own choices, so they are
    accepted (unmasked, it proposed mostly invalid tokens and nearly all were rejected). Greedy output is the
    plain engine's; seeded sampling is valid and repeats."""
    plain, _ = engines
    spec = LLM(model, speculative_config={"model": model, "num_speculative_tokens": 3, "cost_model": False}, **KW)
    prompts = [p for _, p in CASES]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so, _ in CASES]
    assert _gen(spec, params, prompts) == _gen(plain, params, prompts)
    m = spec.get_metrics()
    # Only proposals past the grammar's end (the rows reserved after an EOS) are rejected.
    assert m["spec_decode_num_draft_tokens"] >= 20 and m["spec_decode_acceptance_rate"] >= 0.75, m
    seeded = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=40, structured_outputs=so)
              for i, (so, _) in enumerate(CASES)]
    first = _gen(spec, seeded, prompts)
    assert _gen(spec, seeded, prompts) == first
    for (so, _), (_, text, reason) in zip(CASES, first, strict=True):
        assert _valid(so, text) and reason == "stop", (so, text)
    assert spec.engine.stats()["blocks_used"] == 0


def test_http_structured_outputs_speculate_and_bad_grammars_are_400(tmp_path_factory):
    server = RealServer(tmp_path_factory, speculative_config=NGRAM)
    try:
        c = httpx.Client(base_url=server.base_url, timeout=120)
        body = {"model": "tiny", "prompt": CASES[0][1], "max_tokens": 40, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
        r = c.post("/completions", json=body)
        assert r.status_code == 200, r.text
        assert _valid(CASES[0][0], r.json()["choices"][0]["text"]), r.text
        r = c.post("/completions", json={**body, "response_format": None, "structured_outputs": {"regex": "a(b"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
        metrics = c.get(server.url + "/metrics").text
        drafted = re.search(r'^ironlm:spec_decode_num_draft_tokens_total\{model_name="tiny"\} (\S+)', metrics,
                            re.MULTILINE)
        assert drafted is not None and float(drafted.group(1)) > 0, metrics
        assert server.idle()
    finally:
        server.stop()


# ---- in the core: each verification row's mask, and the matcher afterwards ---------------------------------

def _plain_mask(prompt: list[int], eos: list[int], grammar, output: list[int]) -> np.ndarray:
    """The mask a non-speculating scheduler gives the request's next row after it sampled `output`."""
    sched = make_scheduler(64)
    sched.add_request("r", prompt, 16, eos_token_ids=eos, grammar=grammar)
    for t in output:
        sched.schedule()
        sched.update([t])
    sched.schedule()
    return sched.take_bitmask()[1][0]


def test_each_verification_row_gets_the_mask_after_its_proposals():
    """Row j of a speculating constrained sequence gets the mask a plain sequence sees after taking the first j
    proposed tokens; after a partly accepted run the matcher stands after exactly the tokens taken."""
    tok = make_tiny_tokenizer()
    vocab = token_vocab(tok)
    eos = [EOS_ID, IM_END_ID]
    compiler = _core.GrammarCompiler(vocab.token_bytes, eos_token_ids=eos, vocab_size=len(vocab.token_bytes),
                                     special_token_ids=vocab.special_token_ids)
    # Masks that differ row by row: after "a" only "b"; after "ab" "c" or any letter; after "abc" "-" too.
    g = compiler.compile(r"start: /(abc)+-[0-9]+|ab[a-z]+/")
    a, b, c, x = tok.convert_tokens_to_ids(["a", "b", "c", "x"])
    prompt = [1, a, b, c, a, b, c]

    def plain_mask(output: list[int]) -> np.ndarray:
        return _plain_mask(prompt, eos, g, output)

    spec = make_scheduler(64)
    spec.set_speculation(3, prompt_lookup_max=2, prompt_lookup_min=1, max_batch_tokens=64)
    spec.add_request("r", prompt, 16, eos_token_ids=eos, grammar=g)
    spec.schedule()
    spec.update([a])  # the output starts like the prompt: lookup proposes "b c a"
    plan = spec.schedule()
    draft = plan.sample_draft[plan.sample_draft >= 0].tolist()
    assert draft == [b, c, a], draft
    rows, bits = spec.take_bitmask()
    assert rows.tolist() == [0, 1, 2, 3]
    for j in range(4):
        np.testing.assert_array_equal(bits[j], plain_mask([a] + draft[:j]), err_msg=f"row {j}")
    assert len({bits[j].tobytes() for j in range(4)}) == 4
    # "b" accepted, then "x" instead of "c": the matcher is after "a b x".
    spec.update([b, x, a, a])
    spec.schedule()
    np.testing.assert_array_equal(spec.take_bitmask()[1][0], plain_mask([a, b, x]))
    s = spec.spec_stats()
    assert (s["num_draft_tokens"], s["num_accepted_tokens"]) == (3, 1)
    assert spec.output_token_ids(0) == [a, b, x]


def test_proposals_are_cut_where_the_grammar_rejects_them():
    tok = make_tiny_tokenizer()
    vocab = token_vocab(tok)
    eos = [EOS_ID, IM_END_ID]
    compiler = _core.GrammarCompiler(vocab.token_bytes, eos_token_ids=eos, vocab_size=len(vocab.token_bytes),
                                     special_token_ids=vocab.special_token_ids)
    g = compiler.compile(r"start: /ab[a-c]/")
    a, b, c, d, e = tok.convert_tokens_to_ids(["a", "b", "c", "d", "e"])
    sched = make_scheduler(64)
    sched.set_speculation(4, prompt_lookup_max=2, prompt_lookup_min=1, max_batch_tokens=64)
    # Lookup matches "e a" and proposes "b c d e" (a 1-token match would propose one token only): the grammar
    # ends after "a b c", so only "b c" are verified.
    sched.add_request("r", [1, e, a, b, c, d, e], 16, eos_token_ids=eos, grammar=g)
    sched.schedule()
    sched.update([a])
    plan = sched.schedule()
    assert plan.sample_draft.tolist() == [b, c, -1]
    assert sched.spec_stats()["grammar_cut_tokens"] == 2
    rows, _ = sched.take_bitmask()
    assert rows.tolist() == [0, 1, 2]
    (_, _, reason, _), = sched.update([b, c, EOS_ID])
    assert reason == "stop" and sched.output_token_ids(0) == [a, b, c]


def test_draft_masks_walk_the_matcher_and_set_proposals_rolls_it_back():
    tok = make_tiny_tokenizer()
    vocab = token_vocab(tok)
    eos = [EOS_ID, IM_END_ID]
    compiler = _core.GrammarCompiler(vocab.token_bytes, eos_token_ids=eos, vocab_size=len(vocab.token_bytes),
                                     special_token_ids=vocab.special_token_ids)
    g = compiler.compile(r"start: /(abc)+-[0-9]+|ab[a-z]+/")
    a, b, c = tok.convert_tokens_to_ids(["a", "b", "c"])
    prompt = [1, a, b, c]

    def plain_mask(output: list[int]) -> np.ndarray:
        return _plain_mask(prompt, eos, g, output)

    sched = make_scheduler(64)
    sched.set_speculation(2, max_batch_tokens=64, external=True)
    sched.add_request("r", prompt, 16, eos_token_ids=eos, grammar=g)
    sched.schedule()
    sched.update([a])
    plan = sched.schedule()
    assert plan.sample_draft.tolist()[2] == -1 and (plan.sample_draft[:2] >= 0).all()
    idx, bits = sched.draft_masks(np.array([0]), np.array([-1]))
    assert idx.tolist() == [0]
    np.testing.assert_array_equal(bits[0], plain_mask([a]))
    _, bits = sched.draft_masks(np.array([1]), np.array([b]))
    np.testing.assert_array_equal(bits[0], plain_mask([a, b]))
    sched.set_proposals(plan, np.array([b, c]))
    rows, bits = sched.take_bitmask()
    assert rows.tolist() == [0, 1, 2]
    for j, out in enumerate(([a], [a, b], [a, b, c])):
        np.testing.assert_array_equal(bits[j], plain_mask(out), err_msg=f"row {j}")
    sched.update([b, c, a])
    assert sched.output_token_ids(0) == [a, b, c, a]
    # Masks taken before the proposals came were the placeholders': the proposals are refused then.
    plan = sched.schedule()
    assert (plan.sample_draft >= 0).any()
    sched.take_bitmask()
    with pytest.raises(ValueError, match="before its proposals"):
        sched.set_proposals(plan, np.array([b] * int((plan.sample_draft >= 0).sum())))
