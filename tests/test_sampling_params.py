"""SamplingParams: vLLM defaults, validation that names the bad field, helpers."""

from __future__ import annotations

import pytest

from ironlm.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.logprobs is None and p.seed is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert p.stop is None and p.stop_token_ids is None and p.logit_bias is None
    assert not p.greedy and p.stop_strings == []


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
    ({"detokenize": 1}, "detokenize"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {3: "big"}}, "logit_bias"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias"),
    ({"detokenize": False, "stop": "x"}, "stop"),
])
def test_invalid_field_raises_value_error_naming_it(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_error_message_shows_the_value() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"temperature": 0}, {"top_k": 0}, {"top_k": -1}, {"top_k": 1}, {"top_p": 1.0},
    {"min_p": 1.0}, {"repetition_penalty": 2.0}, {"presence_penalty": -2.0}, {"frequency_penalty": 2},
    {"seed": -5}, {"seed": 2**70}, {"stop": "x"}, {"stop": ("a", "b")}, {"stop_token_ids": (1, 2)},
    {"max_tokens": None, "min_tokens": 10**6}, {"min_tokens": 16, "max_tokens": 16}, {"logprobs": 0},
    {"logprobs": 20}, {"logit_bias": {}},
])
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_stop_strings_helper() -> None:
    assert SamplingParams(stop="END").stop_strings == ["END"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop=("a",)).stop_strings == ["a"]
    assert SamplingParams().stop_strings == []


def test_logit_bias_is_clamped_and_json_keys_are_token_ids() -> None:
    p = SamplingParams(logit_bias={"5": 250, 7: -1000.0, 9: 0.5})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}


def test_stop_token_ids_become_a_list() -> None:
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
