"""The SSE chunk template of streamed completions writes exactly the bytes `sse` writes for the same dict."""

from __future__ import annotations

import json

import pytest

from ironlm.server.serving_common import SSEChunks, sse

HEAD = {"id": 'cmpl-"x"', "object": "text_completion", "created": 123, "model": "mø/del"}
FIELDS = ("text", "logprobs", "finish_reason", "stop_reason")


@pytest.mark.parametrize("with_usage", [True, False])
@pytest.mark.parametrize(("values", "usage"), [
    (('hé "q"\n\\ \u2028 \x00', None, None, None), None),
    (("", None, "length", None), {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}),
    (("x", {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}]}, "stop", 13), None),
    (("🙂", None, "stop", "</s>"), None),
])
def test_template_chunk_is_byte_identical_to_sse(with_usage, values, usage):
    template = SSEChunks(HEAD, FIELDS, with_usage)
    obj = {**HEAD, "choices": [{"index": 7, **dict(zip(FIELDS, values))}]}
    if with_usage:
        obj["usage"] = usage
    got = template.chunk(7, values, usage)
    assert got == sse(obj)
    assert got.startswith("data: ") and got.endswith("\n\n")
    assert json.loads(got[len("data: "):]) == obj
