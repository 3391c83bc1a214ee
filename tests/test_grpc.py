"""gRPC Generate / StreamGenerate on the shared tiny-model engine, validation, auth, shipped .proto."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pb2

from ironlm.grpc import ironlm_pb2 as pb
from server_utils import GrpcServer, LiveServer, shared_server

KEY = "grpc-secret"


@pytest.fixture(scope="module")
def http_server(tmp_path_factory) -> LiveServer:
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def rpc(http_server: LiveServer):
    server = GrpcServer(http_server.engine)
    yield server
    server.stop()


def greedy(prompt: str = "hello grpc", max_tokens: int = 6, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingParameters(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, **sampling))


def test_unary_matches_http(rpc: GrpcServer, http_server: LiveServer):
    resp = rpc.stub.Generate(greedy(), timeout=60)
    assert resp.finished and len(resp.completions) == 1
    c = resp.completions[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6
    prompt_ids = http_server.engine.tokenizer.encode("hello grpc")
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens == len(prompt_ids)
    body = {"model": "tiny", "prompt": "hello grpc", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{http_server.base_url}/completions", json=body).json()["choices"][0]["text"] == c.text


def test_stream_deltas_add_up_to_unary(rpc: GrpcServer):
    full = rpc.stub.Generate(greedy(max_tokens=8), timeout=60).completions[0]
    msgs = list(rpc.stub.StreamGenerate(greedy(max_tokens=8), timeout=60))
    assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 8
    assert not any(m.finished for m in msgs[:-1])
    parts = [c for m in msgs for c in m.completions]
    assert "".join(p.text for p in parts) == full.text
    assert [t for p in parts for t in p.token_ids] == list(full.token_ids)
    assert parts[-1].finish_reason == "length"


def test_token_prompt_n_and_logprobs(rpc: GrpcServer):
    ids = rpc.stub.Generate(greedy(max_tokens=3), timeout=60).completions[0].token_ids
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(ids) + [1]), sampling=pb.SamplingParameters(
        max_tokens=3, temperature=1.0, seed=7, n=2, logprobs=2, ignore_eos=True))
    resp = rpc.stub.Generate(req, timeout=60)
    assert sorted(c.index for c in resp.completions) == [0, 1]
    for c in resp.completions:
        assert len(c.logprobs) == 3 and all(2 <= len(lp.top) <= 3 for lp in c.logprobs)


@pytest.mark.parametrize(("request_", "code"), [
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(top_p=3)), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(text="hi " * 400), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(text="hi", model="other"), grpc.StatusCode.NOT_FOUND),
])
def test_validation_errors(rpc: GrpcServer, request_, code):
    for call in (rpc.stub.Generate, lambda r, **kw: list(rpc.stub.StreamGenerate(r, **kw))):
        with pytest.raises(grpc.RpcError) as exc:
            call(request_, timeout=30)
        assert exc.value.code() == code


def test_text_prompts_are_bounded_and_tokenized_off_the_engine_thread(rpc: GrpcServer, http_server: LiveServer,
                                                                      monkeypatch):
    """As over HTTP: a text past the character bound is refused before any tokenization, and the engine is
    handed token ids (tokenized in a worker thread), so a huge prompt never stalls the engine loop."""
    import threading

    from ironlm.server.prompt_limits import char_limit

    engine = http_server.engine
    tokenizer = engine.tokenizer
    encode = tokenizer.encode
    threads: list[str] = []

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    with pytest.raises(grpc.RpcError) as exc:
        rpc.stub.Generate(pb.GenerateRequest(text="x" * (char_limit(engine) + 1)), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in exc.value.details()
    assert threads == []  # refused by length alone
    resp = rpc.stub.Generate(pb.GenerateRequest(text="hello world", sampling=pb.SamplingParameters(max_tokens=2)),
                             timeout=60)
    assert len(resp.completions) == 1 and threads
    loop_thread = rpc.thread.name  # the gRPC server's event loop
    assert all(name not in ("ironlm-engine", loop_thread) for name in threads), threads


def test_auth(http_server: LiveServer):
    server = GrpcServer(http_server.engine, api_key=KEY)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            server.stub.Generate(greedy(max_tokens=1), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = server.stub.Generate(greedy(max_tokens=1), timeout=30, metadata=[("authorization", f"Bearer {KEY}")])
        assert ok.finished
    finally:
        server.stop()


def test_proto_ships_and_generated_code_is_current(tmp_path: Path):
    from grpc_tools import protoc

    proto = importlib.resources.files("ironlm.grpc") / "ironlm.proto"
    assert proto.is_file()
    root = Path(str(proto)).parents[2]  # the directory holding the `ironlm` package
    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{root}", f"--descriptor_set_out={out}", "ironlm/grpc/ironlm.proto"]) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _strip_json_names(fresh.message_type)  # the embedded descriptor omits the derived json_name
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "regenerate: see the command in ironlm.proto"


def test_message_type_stub_is_current(tmp_path: Path):
    """ironlm_pb2.pyi (what mypy checks the service against) is what protoc --pyi_out makes of the .proto."""
    from grpc_tools import protoc

    proto = importlib.resources.files("ironlm.grpc") / "ironlm.proto"
    root = Path(str(proto)).parents[2]
    assert protoc.main(["protoc", f"-I{root}", f"--pyi_out={tmp_path}", "ironlm/grpc/ironlm.proto"]) == 0
    fresh = (tmp_path / "ironlm" / "grpc" / "ironlm_pb2.pyi").read_text()
    assert fresh == (root / "ironlm" / "grpc" / "ironlm_pb2.pyi").read_text(), "regenerate: see ironlm.proto"


def _strip_json_names(messages) -> None:
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _strip_json_names(m.nested_type)
