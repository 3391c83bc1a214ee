"""Typed errors across the boundary: one home for every exception, `.param` on every argument error, and the
server's error bodies built from types and attributes, never from messages."""

from __future__ import annotations

import ast
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError, model_validator

import ironlm
from core_utils import make_scheduler
from ironlm import _core, exceptions
from ironlm.sampling_params import SamplingParams
from ironlm.server.errors import APIError, validation_error
from ironlm.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from ironlm.server.serving_common import engine_error, sampling_params

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "ironlm"
CORE_EXCEPTIONS = ("CoreError", "QueueFullError", "RequestTooLargeError", "DuplicateRequestError",
                   "InvalidArgumentError")
# The HTTP layer's own carrier of a status code and an OpenAI error body; nothing outside the server sees it.
SERVER_ONLY = {("server/errors.py", "APIError")}


def _exception_classes(tree: ast.AST) -> list[str]:
    """Classes whose base is named like an exception (`ValueError`, `_core.CoreError`, `EngineDeadError`, ...)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in node.bases]
            if any(n.endswith(("Error", "Exception", "Warning")) for n in names):
                found.append(node.name)
    return found


def test_every_exception_is_defined_in_ironlm_exceptions() -> None:
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "exceptions.py" or rel.startswith("grpc/"):
            continue
        for name in _exception_classes(ast.parse(path.read_text())):
            if (rel, name) not in SERVER_ONLY:
                elsewhere.append(f"{rel}: {name}")
    assert not elsewhere, "define exceptions in ironlm/exceptions.py: " + ", ".join(elsewhere)
    # The scan itself must see classes, or the assertion above proves nothing.
    assert set(_exception_classes(ast.parse((PACKAGE / "exceptions.py").read_text()))) >= {
        "EngineDeadError", "EngineOverloadedError", "EngineStepError", "UnsupportedModelError"}


def test_exceptions_are_exported_from_ironlm_and_core_ones_are_the_cores() -> None:
    for name in exceptions.__all__:
        assert getattr(ironlm, name) is getattr(exceptions, name), name
        assert name in ironlm.__all__, name
        assert issubclass(getattr(exceptions, name), BaseException), name
    for name in CORE_EXCEPTIONS:
        assert getattr(exceptions, name) is getattr(_core, name), name
    # The modules that raise them still offer them under their old names.
    from ironlm.bench.llama_cpp import LlamaCppNotBuilt
    from ironlm.model import DefaultModelNotInstalled, UnsupportedModelError

    assert LlamaCppNotBuilt is ironlm.LlamaCppNotBuilt
    assert UnsupportedModelError is ironlm.UnsupportedModelError
    assert DefaultModelNotInstalled is ironlm.DefaultModelNotInstalled


def test_invalid_argument_error_shape() -> None:
    e = ironlm.InvalidArgumentError("top_p must be in (0, 1], got 2", param="top_p")
    assert isinstance(e, ValueError) and not isinstance(e, ironlm.CoreError)
    assert e.param == "top_p" and str(e) == "top_p must be in (0, 1], got 2"
    assert ironlm.InvalidArgumentError("no parameter").param is None
    # Pickling keeps the parameter (exceptions otherwise pickle as type(*args) and would lose it).
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is ironlm.InvalidArgumentError and back.param == "top_p" and str(back) == str(e)
    try:
        make_scheduler(0)
    except ironlm.InvalidArgumentError as raised:
        back = pickle.loads(pickle.dumps(raised))
        assert back.param == "num_blocks" and str(back) == str(raised)
    else:
        pytest.fail("Scheduler(0) did not raise")


def _attention_call(**override: Any) -> Callable[[], Any]:
    q = np.zeros((1, 2, 4), np.float32)
    cache = np.zeros((2, 2, 1, 4), np.float32)
    args = {"q": q, "k_cache": cache, "v_cache": cache.copy(), "block_tables": np.zeros((1, 1), np.int32),
            "seq_lens": np.ones(1, np.int32), "scale": 1.0, "out": np.zeros_like(q)} | override
    return lambda: _core.paged_decode_attention(**args)


def _pending_scheduler() -> _core.Scheduler:
    s = make_scheduler(64, block_size=4)
    s.add_request("a", [1, 2, 3], 4)
    s.schedule()
    return s


def _allocator_holding_one() -> _core.BlockAllocator:
    a = _core.BlockAllocator(3, block_size=2)
    a.allocate()
    return a


# (call, the parameter its InvalidArgumentError must name): every way the bindings reject a value.
CORE_BAD_VALUES: list[tuple[Callable[[], Any], str]] = [
    (lambda: make_scheduler(0), "num_blocks"),
    (lambda: make_scheduler(16, block_size=0), "block_size"),
    (lambda: make_scheduler(16, max_num_seqs=0), "max_num_seqs"),
    (lambda: make_scheduler(16, max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
    (lambda: make_scheduler(16, max_model_len=1), "max_model_len"),
    (lambda: make_scheduler(16, policy="lifo"), "policy"),
    (lambda: make_scheduler(16, max_queue_len=-1), "max_queue_len"),
    (lambda: make_scheduler(64).add_request("r", [], 4), "prompt_token_ids"),
    (lambda: make_scheduler(64).add_request("r", [1, -2], 4), "prompt_token_ids"),
    (lambda: make_scheduler(64).add_request("r", [2**70], 4), "prompt_token_ids"),
    (lambda: make_scheduler(64).add_request("r", [1], 0), "max_tokens"),
    (lambda: make_scheduler(64).add_request("r", [1], 4, n=0), "n"),
    (lambda: make_scheduler(64).add_request("r", [1], 4, min_tokens=9), "min_tokens"),
    (lambda: make_scheduler(64).add_request("r", [1], 4, eos_token_ids=[-1]), "eos_token_ids"),
    (lambda: make_scheduler(64).add_request("r", [1], 4, stop_token_ids=[2**70]), "stop_token_ids"),
    (lambda: make_scheduler(64).add_request("r", [1], 4, queue_timeout=-1.0), "queue_timeout"),
    (lambda: make_scheduler(64).add_request("r", [1], 4, deadline=float("inf")), "deadline"),
    (lambda: make_scheduler(64).add_request("r", [1], 4, arrival_time=float("nan")), "arrival_time"),
    (lambda: make_scheduler(64).schedule(now=float("nan")), "now"),
    (lambda: make_scheduler(64).update(np.array([1])), "sampled_token_ids"),
    (lambda: _pending_scheduler().update(np.array([1, 2])), "sampled_token_ids"),
    (lambda: _pending_scheduler().update(np.zeros((1, 1), np.int64)), "sampled_token_ids"),
    (lambda: make_scheduler(64).output_token_ids(99), "slot"),
    (lambda: make_scheduler(64).finish(-1), "slot"),
    (_attention_call(q=np.zeros((1, 2, 3), np.float32), out=np.zeros((1, 2, 3), np.float32)), "q"),
    (_attention_call(seq_lens=np.array([9], np.int32)), "seq_lens"),
    (_attention_call(block_tables=np.array([[5]], np.int32)), "block_tables"),
]
# The classes only the tests use exist with the cargo feature test-bindings (make install / develop build it).
TEST_BINDINGS_BAD_VALUES: list[tuple[Callable[[], Any], str]] = [
    (lambda: _core.RequestQueue("random"), "policy"),
    (lambda: _core.RequestQueue(max_len=-1), "max_len"),
    (lambda: _core.RequestQueue().push("x", queue_timeout=-1.0), "queue_timeout"),
    (lambda: _core.BlockAllocator(3).incref(7), "block"),
    (lambda: _core.BlockAllocator(3).decref(0), "block"),
    (lambda: _core.BlockAllocator(3).free_all([0]), "blocks"),
    (lambda: _core.BlockAllocator(3).fork([9]), "blocks"),
    (lambda: _allocator_holding_one().append_slot([0], 9), "num_tokens"),
    (lambda: _core.RadixCache(_core.BlockAllocator(3, block_size=2)).insert([1, 2, 3, 4], [1]), "blocks"),
    (lambda: _core.RadixCache(_core.BlockAllocator(3, block_size=2)).insert([1, 2], [99]), "blocks"),
    (lambda: _core.RadixCache(_core.BlockAllocator(3)).match_prefix([-1]), "tokens"),
]
needs_test_bindings = pytest.mark.skipif(not hasattr(_core, "BlockAllocator"),
                                         reason="built without the cargo feature test-bindings")


@pytest.mark.parametrize(("call", "param"), [
    *(pytest.param(c, p, id=f"{p}-{i}") for i, (c, p) in enumerate(CORE_BAD_VALUES)),
    *(pytest.param(c, p, id=f"test-bindings-{p}-{i}", marks=needs_test_bindings)
      for i, (c, p) in enumerate(TEST_BINDINGS_BAD_VALUES)),
])
def test_every_core_argument_error_carries_param(call: Callable[[], Any], param: str) -> None:
    with pytest.raises(ironlm.InvalidArgumentError) as info:
        call()
    assert info.value.param == param, info.value
    assert str(info.value).startswith(f"{param}: "), info.value
    assert type(info.value) is _core.InvalidArgumentError


def test_the_bindings_raise_value_errors_only_as_invalid_argument() -> None:
    """A bare PyValueError would reach Python without `.param`: bindings go through py.rs's value_error."""
    rust = PACKAGE.parent.parent / "rust" / "src"
    sources = sorted(rust.rglob("*.rs"))
    assert sources
    bare = [f"{p.relative_to(rust)}:{i}" for p in sources
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if "PyValueError::new_err" in line]
    assert not bare, f"raise InvalidArgumentError via value_error(name, reason) instead: {bare}"


SAMPLING_BAD_VALUES: list[dict[str, Any]] = [
    {"n": 0}, {"n": True}, {"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0}, {"top_p": "x"},
    {"top_k": -2}, {"min_p": 2}, {"repetition_penalty": 0}, {"presence_penalty": 3}, {"frequency_penalty": -3},
    {"seed": 1.5}, {"stop": 5}, {"stop": [""]}, {"stop": ["a", 1]}, {"stop_token_ids": "12"},
    {"stop_token_ids": [-1]}, {"ignore_eos": 1}, {"detokenize": "yes"}, {"max_tokens": 0}, {"min_tokens": -1},
    {"min_tokens": 5, "max_tokens": 2}, {"logprobs": 21}, {"logprobs": -1}, {"logit_bias": [1]},
    {"logit_bias": {"x": 1}}, {"logit_bias": {1: "a"}},
]


@pytest.mark.parametrize("kwargs", SAMPLING_BAD_VALUES, ids=[repr(k) for k in SAMPLING_BAD_VALUES])
def test_sampling_params_errors_name_the_field(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ironlm.InvalidArgumentError) as info:
        SamplingParams(**kwargs)
    param = info.value.param
    # The field that is wrong: the only one given, or the later of min_tokens/max_tokens.
    assert param == ("min_tokens" if "min_tokens" in kwargs else next(iter(kwargs))), info.value
    assert str(info.value).startswith(param)


def test_stop_strings_without_detokenize_name_stop() -> None:
    with pytest.raises(ironlm.InvalidArgumentError) as info:
        SamplingParams(stop=["x"], detokenize=False)
    assert info.value.param == "stop"


def test_engine_error_maps_by_type_and_param_never_by_message() -> None:
    # A message that reads like "<param>: ..." is not parsed: without .param the prompt field is blamed.
    err = engine_error(ValueError("top_p: looks like a parameter"))
    assert (err.status, err.param) == (400, "prompt")
    err = engine_error(ironlm.InvalidArgumentError("anything at all", param="top_p"), prompt_param="messages")
    assert (err.status, err.param, err.message) == (400, "top_p", "anything at all")
    err = engine_error(ironlm.InvalidArgumentError("prompt must not be empty", param="prompt"), "messages")
    assert err.param == "messages"
    # Context length is the type, not the words "max_model_len".
    err = engine_error(_core.RequestTooLargeError("too big"), prompt_param="messages")
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    err = engine_error(ironlm.InvalidArgumentError("max_model_len: mentioned", param="max_tokens"))
    assert (err.param, err.code) == ("max_tokens", 400)
    err = engine_error(_core.DuplicateRequestError("request id 'a' is already in use"))
    assert (err.status, err.param) == (400, "request_id")
    assert (engine_error(_core.QueueFullError("full")).status, engine_error(_core.QueueFullError("x")).code) == \
        (503, "queue_full")
    assert engine_error(ironlm.EngineDeadError("dead")).status == 503
    assert engine_error(ironlm.EngineOverloadedError("draining")).code == "engine_unavailable"
    assert engine_error(RuntimeError("top_p: boom")).status == 500


def test_sampling_params_helper_takes_param_from_the_exception() -> None:
    with pytest.raises(APIError) as info:
        sampling_params({"top_k": -7})
    assert (info.value.status, info.value.param) == (400, "top_k")
    with pytest.raises(APIError) as info:
        sampling_params({"no_such_field": 1})  # a TypeError: no parameter to name
    assert (info.value.status, info.value.param) == (400, None)


@pytest.mark.parametrize(("model", "body", "param"), [
    (CompletionRequest, {"prompt": ""}, "prompt"),
    (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of"),
    (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0"),  # the element, as logit_bias.5
    (CompletionRequest, {"prompt": "x", "priority": 2**63}, "priority"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 2**64}, "max_tokens"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    (TokenizeRequest, {}, "prompt"),
])
def test_validation_errors_name_the_param(model: type[BaseModel], body: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = validation_error(info.value)
    assert (err.status, err.param) == (400, param), err.message
    assert err.message.startswith(f"{param}: ") and "Value error" not in err.message


def test_validation_error_does_not_parse_messages() -> None:
    class Plain(BaseModel):
        x: int = 0

        @model_validator(mode="after")
        def _check(self) -> Plain:
            raise ValueError("prompt: reads like a parameter but names none")

    with pytest.raises(ValidationError) as info:
        Plain.model_validate({})
    err = validation_error(info.value)
    assert err.param is None and err.message == "prompt: reads like a parameter but names none"
