"""Issue 21's crash shapes against a real `ironlm serve` process: inputs that overflowed the grammar compile thread's
stack (SIGSEGV) or raised RecursionError (500) get a 400 naming the field, and the process lives on; the deepest
shapes accepted still compile."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from ironlm.grpc import ironlm_pb2 as pb
from ironlm.grpc import ironlm_pb2_grpc as pb_grpc
from ironlm.structured import StructuredOutputsParams
from ironlm.structured.json_depth import MAX_JSON_DEPTH, check_depth, json_depth
from server_utils import tiny_model_path

# ---- the shapes ------------------------------------------------------------------------------------------------


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def required(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            "required": [f"p{i}" for i in range(n)]}


def lark_chain(n: int) -> str:
    """`start` and n + 1 rules, each naming the next: n + 2 deep."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def deep_json(n: int) -> str:
    return '{"a": ' * n + "1" + "}" * n


# ---- a real `ironlm serve` process -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """`ironlm serve` on the tiny model in a child process: a crash shows as its exit, not as this test's."""

    def __init__(self, model: Path, log: Path) -> None:
        self.port, self.grpc_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-c", "import sys; from ironlm.cli import main; sys.exit(main(sys.argv[1:]))",
               "serve", str(model), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
               "--block-size", "4", "--max-model-len", "256", "--port", str(self.port),
               "--grpc-port", str(self.grpc_port), "--served-model-name", "tiny"]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ironlm serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"the server died (rc {self.proc.returncode}):\n{self.log.read_text()[-3000:]}"
        assert self._healthy()

    def post(self, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    server = ServeProcess(tiny_model_path(tmp_path_factory), tmp_path_factory.mktemp("serve") / "serve.log")
    yield server
    server.stop()


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}


def _history(arguments: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


# Each used to kill the process (SIGSEGV on the compile thread's stack) or answer 500.
CRASHERS: list[tuple[str, str, dict[str, Any], str]] = [
    ("ref_chain_1000", "/v1/completions", _completion(structured_outputs={"json": ref_chain(1000)}),
     "structured_outputs.json"),
    ("ref_chain_500_response_format", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": ref_chain(500)}}),
     "response_format"),
    ("required_6000", "/v1/completions", _completion(structured_outputs={"json": required(6000)}),
     "structured_outputs.json"),
    ("lark_chain_10k", "/v1/completions", _completion(structured_outputs={"grammar": lark_chain(10_000)}),
     "structured_outputs.grammar"),
    ("tool_parameters_ref_chain", "/v1/chat/completions", _chat(**_tool(ref_chain(800))), "tools"),
    ("guided_json_string_1000_deep", "/v1/completions", _completion(guided_json=deep_json(1000)), "guided_json"),
    ("schema_string_1000_deep", "/v1/completions", _completion(structured_outputs={"json": deep_json(1000)}),
     "structured_outputs.json"),
    ("tool_call_arguments_1000_deep", "/v1/chat/completions",
     {"model": "tiny", "messages": _history(deep_json(1000)), "max_tokens": 2}, "messages"),
    ("tokenize_tool_call_arguments_1000_deep", "/tokenize", {"model": "tiny", "messages": _history(deep_json(1000))},
     "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in CRASHERS], ids=[c[0] for c in CRASHERS])
def test_crashing_shapes_get_a_400_naming_the_field(served: ServeProcess, path: str, body: dict[str, Any],
                                                    param: str) -> None:
    r = served.post(path, body)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == param or err["param"].startswith(f"{param}."), err  # messages.1: which message
    served.assert_alive()


# The deepest shapes accepted still compile, on the compile thread's sized stack.
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("required_5000", {"json": required(5000)}),
    ("ref_chain_250", {"json": ref_chain(250)}),
    ("lark_chain_990", {"grammar": lark_chain(990)}),
]


@pytest.mark.parametrize("constraint", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_deepest_accepted_shapes_compile(served: ServeProcess, constraint: dict[str, Any]) -> None:
    r = served.post("/v1/completions", _completion(structured_outputs=constraint))
    assert r.status_code == 200, r.text[:500]
    served.assert_alive()


def test_grpc_deep_schemas_are_invalid_argument(served: ServeProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        for schema in (deep_json(1000), json.dumps(ref_chain(1000))):
            req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=2),
                                     structured_outputs=pb.StructuredOutputs(json=schema))
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(req, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert "structured_outputs.json" in (info.value.details() or "")
    served.assert_alive()


# ---- deep JSON: one helper ------------------------------------------------------------------------------------


def test_json_depth_is_counted_without_recursion() -> None:
    deep: Any = 1
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert json_depth(deep, limit=10) == 11
    assert json_depth({"a": [1, {"b": 2}]}) == 3
    assert json_depth("text") == 0
    check_depth({"a": 1}, "p")
    with pytest.raises(ValueError, match="p is nested more than") as info:
        check_depth(deep, "p")
    assert getattr(info.value, "param", None) == "p"


def test_structured_outputs_params_bound_schema_depth() -> None:
    ok = json.loads(deep_json(MAX_JSON_DEPTH - 1))
    StructuredOutputsParams(json=ok).grammar_text()
    for schema in (deep_json(5000), json.loads(deep_json(MAX_JSON_DEPTH + 1))):
        with pytest.raises(ValueError) as info:
            StructuredOutputsParams(json=schema)
        assert getattr(info.value, "param", None) == "structured_outputs.json"
