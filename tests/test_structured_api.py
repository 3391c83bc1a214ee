"""Structured outputs through every front door: StructuredOutputsParams offline, response_format /
structured_outputs / guided_* over HTTP (the official openai client too), and gRPC.

The validity tests sample a random-weight tiny model at temperature 1 under each constraint: whatever it
"wants" to say, the grammar mask must make every completion valid, so 100% of them must validate.
"""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest

from ironlm import LLM, SamplingParams
from ironlm._core import GrammarCompiler, GrammarError
from ironlm.exceptions import InvalidArgumentError
from ironlm.grpc import ironlm_pb2 as pb
from ironlm.structured import StructuredOutputsParams
from ironlm.structured.params import regex_to_lark
from server_utils import GrpcServer, LiveServer, shared_server
from tiny_models import make_tiny_model

# Every string, array and number is bounded, so a random model cannot run a value past max_tokens: a
# completion that is cut short is invalid JSON, and that would be the test's fault, not the grammar's.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-f0-9]{4}-[A-Z]{2}$"},
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": -5, "maximum": 5},
        "kind": {"enum": ["cat", "dog", 3, None]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"active": {"type": "boolean"},
                           "level": {"type": "integer", "minimum": 1, "maximum": 9},
                           "code": {"$ref": "#/$defs/code"}},
            "required": ["active", "code"],
            "additionalProperties": False,
        },
        "choice": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]},
    },
    "required": ["id", "age", "kind", "owner", "tags"],
    "additionalProperties": False,
    "$defs": {"code": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}},
}
REGEXES = [r"\d{3}-[A-Z]{2}(x|yz)?", r"[a-z]{1,6}@[a-z]{2,4}\.(com|org)", r"(true|false) / [0-9a-f]{2,5}"]
CHOICES = ["red", "green", "blue", "ultra violet", "naïve \"quoted\""]
N_JSON, N_REGEX, N_CHOICE = 200, 204, 200


def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler([bytes([b]) for b in range(256)] + [None], eos_token_ids=[256], vocab_size=257)


# ---- StructuredOutputsParams -------------------------------------------------------------------------
def test_exactly_one_constraint_with_the_field_named():
    with pytest.raises(InvalidArgumentError) as exc:
        StructuredOutputsParams()
    assert exc.value.param == "structured_outputs"
    with pytest.raises(InvalidArgumentError) as exc:
        StructuredOutputsParams(regex="a", choice=["a"])
    assert exc.value.param == "structured_outputs"
    bad = [({"json": "{nope"}, "structured_outputs.json"), ({"json": [1]}, "structured_outputs.json"),
           ({"regex": ""}, "structured_outputs.regex"), ({"choice": []}, "structured_outputs.choice"),
           ({"choice": "ab"}, "structured_outputs.choice"), ({"choice": ["a", 1]}, "structured_outputs.choice"),
           ({"grammar": "  "}, "structured_outputs.grammar"), ({"json_object": 1}, "structured_outputs.json_object"),
           ({"regex": "a", "disable_any_whitespace": "no"}, "structured_outputs.disable_any_whitespace")]
    for kwargs, param in bad:
        with pytest.raises(InvalidArgumentError) as exc:
            StructuredOutputsParams(**kwargs)
        assert exc.value.param == param, kwargs
    with pytest.raises(InvalidArgumentError) as exc:
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    assert exc.value.param == "structured_outputs"
    so = StructuredOutputsParams(json='{"type": "integer"}')
    assert so.json == {"type": "integer"} and so.kind == "json" and so.param == "structured_outputs.json"
    assert StructuredOutputsParams(choice=["a", "b", "a"]).choice == ["a", "b"]


def test_regex_to_lark_escapes_what_would_end_the_terminal():
    assert regex_to_lark(r"^a/b$") == r"a\/b"
    assert regex_to_lark(r"a\/b\$") == r"a\/b\$"  # escaped: kept as they are, the `$` is a literal
    assert regex_to_lark("x\ny") == r"x\ny"
    # Rust's \d is Unicode (fullwidth digits...): a regex constraint means ASCII, negations and classes included
    assert regex_to_lark(r"\d[\w-]\S\\d") == r"[0-9][[0-9A-Za-z_]-][^ \t\n\r\f\v]\\d"


def test_every_kind_compiles_and_bad_ones_name_their_field():
    compiler = byte_compiler()
    for so in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True),
               StructuredOutputsParams(regex=REGEXES[0]), StructuredOutputsParams(regex=r"^a/b\d+$"),
               StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar='start: "a" b\nb: /[0-9]+/'),
               StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?"),
               StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False)):
        assert compiler.compile(so.grammar_text(), param=so.param).mask_words == 9
    for so in (StructuredOutputsParams(json={"type": "nope"}), StructuredOutputsParams(regex="a(b"),
               StructuredOutputsParams(grammar="start: missing_rule"),
               StructuredOutputsParams(json={"$ref": "#/$defs/absent"})):
        with pytest.raises(GrammarError) as exc:
            compiler.compile(so.grammar_text(), param=so.param)
        assert exc.value.param == so.param


# ---- offline: 100% valid under a constraint ------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = make_tiny_model(tmp_path_factory.mktemp("structured"), arch="llama")
    # every validity request runs in one wave: the test's time is one completion's length in steps
    return LLM(str(path), max_model_len=512, max_num_seqs=640, dtype="float32")


def test_random_model_output_is_always_valid(llm: LLM):
    """JSON schema, regexes and choices in one generate call (≥200 completions each, temperature 1, each
    request its own seed)."""
    cases: list[tuple[str, object, SamplingParams]] = []
    for i in range(N_JSON):
        so = StructuredOutputsParams(json=SCHEMA)
        cases.append(("json", SCHEMA, SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=so)))
    for i in range(N_REGEX):
        rx = REGEXES[i % len(REGEXES)]
        cases.append(("regex", rx, SamplingParams(temperature=1.0, seed=10_000 + i, max_tokens=64,
                                                  structured_outputs=StructuredOutputsParams(regex=rx))))
    for i in range(N_CHOICE // 4):
        # n > 1: the forks share the prompt and clone the grammar state
        cases.append(("choice", CHOICES, SamplingParams(n=4, temperature=1.0, seed=20_000 + i, max_tokens=32,
                                                        structured_outputs=StructuredOutputsParams(choice=CHOICES))))
    prompts = [f"request {i}: say something" for i in range(len(cases))]
    outs = llm.generate(prompts, [c[2] for c in cases], use_tqdm=False)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    counts = {"json": 0, "regex": 0, "choice": 0}
    for (kind, spec, _), out in zip(cases, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text, c.finish_reason)
            if kind == "json":
                validator.validate(json.loads(c.text))
            elif kind == "regex":
                assert re.fullmatch(spec, c.text), (spec, c.text)  # type: ignore[arg-type]
            else:
                assert c.text in CHOICES, c.text
            counts[kind] += 1
    assert counts == {"json": N_JSON, "regex": N_REGEX, "choice": N_CHOICE}
    # not one constant answer: the constraint shapes the output, the sampling still varies it
    assert len({out.outputs[0].text for (kind, _, _), out in zip(cases, outs) if kind == "json"}) > N_JSON // 2


def test_grammar_and_json_object_offline(llm: LLM):
    lark = 'start: greeting " " NAME\ngreeting: "hi" | "hello"\nNAME: /[a-z]{1,5}/'
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(grammar=lark)) for s in range(20)]
    # a free object: its strings are unbounded, so a random model may be cut short by max_tokens; what it wrote
    # is then the start of an object, and a finished one parses
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                              structured_outputs=StructuredOutputsParams(json_object=True)) for s in range(8)]
    outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    for out in outs[:20]:
        assert re.fullmatch(r"(hi|hello) [a-z]{1,5}", out.outputs[0].text), out.outputs[0].text
    for out in outs[20:]:
        c = out.outputs[0]
        assert c.text.startswith("{"), c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_bad_grammar_fails_its_request_before_queueing(llm: LLM):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(InvalidArgumentError) as exc:
        llm.generate("x", bad, use_tqdm=False)
    assert exc.value.param == "structured_outputs.regex"
    assert llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished  # the engine goes on


# ---- HTTP ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    age: int = pydantic.Field(ge=0, le=30)
    vaccinated: bool


def test_openai_client_parse_returns_the_object(client: openai.OpenAI):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "describe a pet"}], response_format=Pet,
            max_tokens=120, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        pet = choice.message.parsed
        assert isinstance(pet, Pet) and 0 <= pet.age <= 30 and pet.kind in ("cat", "dog")


def test_response_format_and_structured_outputs_on_both_routes(server: LiveServer):
    c = httpx.Client(base_url=server.base_url, timeout=120)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 230, "n": 4,
            "temperature": 1.0, "seed": 7}
    r = c.post("/chat/completions", json={**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    r = c.post("/chat/completions", json={**chat, "structured_outputs": {"choice": CHOICES}})
    assert {ch["message"]["content"] for ch in r.json()["choices"]} <= set(CHOICES)
    comp = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 64, "n": 3, "temperature": 1.0, "seed": 3}
    r = c.post("/completions", json={**comp, "structured_outputs": {"regex": REGEXES[1]}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 6
    for choice in r.json()["choices"]:
        assert re.fullmatch(REGEXES[1], choice["text"]), choice["text"]
    r = c.post("/completions", json={**comp, "guided_choice": ["yes", "no"]})
    assert {ch["text"] for ch in r.json()["choices"]} <= {"yes", "no"}
    # streamed: the deltas add up to a valid document
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    with c.stream("POST", "/completions", json={**comp, "prompt": "s", "n": 1, "max_tokens": 240, "stream": True,
                                                "response_format": fmt}) as resp:
        chunks = [json.loads(line[6:])["choices"][0] for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["finish_reason"] == "stop"
    jsonschema.validate(json.loads("".join(ch["text"] for ch in chunks)), SCHEMA)


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nah"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("completion", {"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
    ("completion", {"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar"),
    ("completion", {"structured_outputs": {"json": {"type": "object", "minProperties": "x"}}},
     "structured_outputs.json"),
    ("completion", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("completion", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("completion", {"guided_regex": "(("}, "guided_regex"),
    ("completion", {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
])
def test_bad_constraints_are_400_naming_the_field(server: LiveServer, route: str, extra: dict, param: str):
    body = ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} if route == "chat"
            else {"model": "tiny", "prompt": "hi"})
    path = "/chat/completions" if route == "chat" else "/completions"
    r = httpx.post(server.base_url + path, json={**body, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.engine is not None and server.engine.stats()["num_requests_waiting"] == 0


# ---- gRPC ---------------------------------------------------------------------------------------------
def test_grpc_structured_outputs(server: LiveServer):
    assert server.engine is not None
    rpc = GrpcServer(server.engine)
    try:
        so = pb.StructuredOutputs(json=json.dumps(SCHEMA))
        req = pb.GenerateRequest(text="hi", structured_outputs=so,
                                 sampling=pb.SamplingParameters(n=4, max_tokens=240, temperature=1.0, seed=1))
        resp = rpc.stub.Generate(req, timeout=120)
        assert len(resp.completions) == 4
        for c in resp.completions:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        req = pb.GenerateRequest(text="hi", structured_outputs=pb.StructuredOutputs(
            choice=pb.Choices(values=CHOICES)), sampling=pb.SamplingParameters(max_tokens=20, seed=2))
        texts = "".join(c.text for msg in rpc.stub.StreamGenerate(req, timeout=60) for c in msg.completions)
        assert texts in CHOICES
        with pytest.raises(grpc.RpcError) as exc:
            rpc.stub.Generate(pb.GenerateRequest(text="hi", structured_outputs=pb.StructuredOutputs(regex="(")),
                              timeout=60)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.regex" in (exc.value.details() or "")
    finally:
        rpc.stop()


# ---- the built-in default model (a real GGUF vocabulary) ----------------------------------------------
@pytest.fixture(scope="module")
def default_server():
    from ironlm.config import EngineConfig
    from ironlm.engine import AsyncLLMEngine
    from ironlm.server.api import build_app

    engine = AsyncLLMEngine.from_config(EngineConfig(kv_cache_memory="128MiB", max_model_len=1024))
    server = LiveServer(build_app(engine, served_model_name="default"), engine)
    yield server
    server.stop()


def test_default_model_json_schema_and_forced_tool_call(default_server: LiveServer):
    c = openai.OpenAI(base_url=default_server.base_url, api_key="unused", max_retries=0, timeout=300)
    r = c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe a made-up person as JSON."}], n=4,
        temperature=1.0, seed=0, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    # A strict tool (no properties beyond its own, as OpenAI's strict mode requires): with an open object the
    # grammar lets a 135M model ramble through made-up keys until max_tokens, a coin toss on its greedy path.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
    r = c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[tool],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=100)
    (call,) = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
