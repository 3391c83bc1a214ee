"""python -m ironlm.bench.spec: the engines take turns prompt by prompt, and the report's figures come from them."""

from __future__ import annotations

import json
from pathlib import Path

from ironlm.bench import spec


def test_interleave_rotates_the_engines_and_keeps_each_result_in_its_place() -> None:
    calls: list[tuple[str, int]] = []

    def engine(name: str):  # type: ignore[no-untyped-def]
        def run(i: int) -> tuple[str, int]:
            calls.append((name, i))
            return name, i
        return run

    got = spec.interleave({"a": engine("a"), "b": engine("b"), "c": engine("c")}, n_prompts=2, rounds=2)
    # Each prompt is run by every engine before the next prompt; who goes first rotates.
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                     ("c", 0), ("a", 0), ("b", 0), ("a", 1), ("b", 1), ("c", 1)]
    assert got == {n: [[(n, 0), (n, 1)], [(n, 0), (n, 1)]] for n in "abc"}


def test_the_bench_reports_both_engines_per_round(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    spec.main(["--num-prompts", "2", "--max-tokens", "12", "--rounds", "2", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["rounds"] == 2 and len(r["speedup_per_round"]) == 2
    assert r["plain_decode_tok_s"] > 0 and r["spec_decode_tok_s"] > 0
    assert r["identical_outputs"] == "2/2"
    assert r["spec_decode_num_drafts"] > 0  # the copy prompts propose from their first decode steps
    assert len(r["output_tokens"]) == 2 and r["outputs_at_max_tokens"] == sum(n >= 12 for n in r["output_tokens"])
    assert 0 <= r["output_copied_frac"] + r["output_repeated_frac"] <= 1
    assert [p["output_tokens"] for p in r["per_prompt"]] == r["output_tokens"]
    assert all(p["speedup"] > 0 and p["copied"] + p["repeated"] <= p["output_tokens"] for p in r["per_prompt"])
    assert r["copying_prompts"] == sum(2 * p["copied"] >= p["output_tokens"] for p in r["per_prompt"])
    # 2 rounds x 2 prompts x 11 tokens after the first; each accepted token saved a step.
    assert r["free_verification_ceiling"] == 44 / (44 - r["spec_decode_num_accepted_tokens"])


def test_sources_tells_copying_from_repeating() -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    # 3-grams: [1 2 3] and [2 3 4] copy the prompt; [9 9 9] twice is the answer repeating itself.
    copied, repeated = spec.sources(prompt, [1, 2, 3, 4, 9, 9, 9, 9, 9, 7], n=3)
    assert (copied, repeated) == (2, 2)
    assert spec.sources(prompt, [7, 8], n=3) == (0, 0)


def test_the_copy_set_holds_16_passages_of_300_to_1000_tokens() -> None:
    from ironlm.bench.spec_prompts import chat_prompt, load_prompts
    from ironlm.model.default import default_model_path
    from ironlm.model.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(default_model_path())
    sizes = [len(chat_prompt(tok, t)) for t in load_prompts("copy")]
    assert len(sizes) == 16 and all(300 <= n <= 1000 for n in sizes), sizes
    assert len(load_prompts("tasks")) == 8
    assert all(t.startswith("Copy the following text word for word.") for t in load_prompts("copy"))
