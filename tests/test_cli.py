"""`ironlm` CLI: flags, generate, chat, and `serve` (startup log, SIGTERM drain, return 0)."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import typing
from dataclasses import fields

import grpc
import httpx
import pytest

from ironlm.cli import build_parser, main
from ironlm.cli_args import config_from_args, flag_name, model_from_args
from ironlm.config import EngineConfig
from ironlm.grpc import ironlm_pb2 as pb
from ironlm.grpc import ironlm_pb2_grpc as pb_grpc

ENGINE_FLAGS = ["--num-kv-blocks", "128", "--block-size", "4", "--max-model-len", "256", "--device", "cpu"]
SERVE_FLAGS = ["--host", "--port", "--served-model-name", "--api-key", "--dtype", "--device", "--block-size",
               "--kv-cache-memory", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
               "--enable-prefix-caching", "--no-enable-prefix-caching", "--scheduling-policy",
               "--max-queue-len", "--queue-timeout", "--grpc-port"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("cli"), arch="llama"))


def test_help_lists_commands_and_vllm_named_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("serve", "generate", "chat", "bench"))
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert all(flag in out for flag in SERVE_FLAGS)


def test_serve_defaults_and_config_mapping():
    args = build_parser(["serve"]).parse_args(["serve"])
    assert (args.host, args.port, args.model_pos, args.grpc_port) == ("127.0.0.1", 8000, None, None)
    assert config_from_args(args, model_from_args(args)) == EngineConfig()  # every default from one place
    args = build_parser(["serve"]).parse_args(
        ["serve", "m.gguf", "--no-enable-prefix-caching", "--scheduling-policy", "priority", "--kv-cache-memory",
         "1GiB", "--max-queue-len", "7", "--queue-timeout", "2.5", "--served-model-name", "a", "b"])
    config = config_from_args(args, model_from_args(args))
    assert config.model == "m.gguf" and not config.enable_prefix_caching
    assert (config.scheduling_policy, config.kv_cache_memory, config.max_queue_len) == ("priority", "1GiB", 7)
    assert config.queue_timeout == 2.5 and config.served_model_name == "a"
    assert args.served_model_name == ["a", "b"]
    args = build_parser(["serve"]).parse_args(["serve", "pos.gguf", "--model", "opt.gguf"])
    assert model_from_args(args) == "opt.gguf"


def test_request_timeout_is_a_deprecated_alias_of_queue_timeout(capsys):
    args = build_parser(["serve"]).parse_args(["serve", "--request-timeout", "2.5"])
    assert config_from_args(args, None).queue_timeout == 2.5
    assert "--request-timeout is deprecated, use --queue-timeout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--request-timeout" not in capsys.readouterr().out


# String fields with a syntax of their own: a valid non-default value each.
_STRUCTURED_STRINGS = {"tenant_weights": "a=2,b=1", "score_template": "Q: {query} D: {document}",
                       "score_tokens": "1,2", "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'}


def _non_default(f, annotation) -> tuple[list[str], object]:
    """Command-line words that set field `f` to a value other than its default, and that value."""
    flag = flag_name(f.name)
    if annotation is bool:
        return ([flag] if not f.default else ["--no-" + flag[2:]]), not f.default
    if "choices" in f.metadata:
        value = next(c for c in f.metadata["choices"] if c != f.default)
        return [flag, str(value)], value
    if f.name in _STRUCTURED_STRINGS:
        return [flag, _STRUCTURED_STRINGS[f.name]], _STRUCTURED_STRINGS[f.name]
    if typing.get_origin(annotation) is tuple:  # nargs: argparse hands the values over as a list
        return [flag, "8"], ["8"]
    kinds = typing.get_args(annotation) or (annotation,)
    if str in kinds:  # "8" is a valid model path, device string, name and KV size (8 bytes) alike
        return [flag, "8"], "8"
    if int in kinds:
        return [flag, "8"], 8
    return [flag, "0.5"], 0.5


def test_every_engine_config_field_is_a_flag_of_every_engine_command(capsys):
    """Adding a field to EngineConfig is enough: serve, generate and chat list it and pass it to the config."""
    hints = typing.get_type_hints(EngineConfig)
    for command in ("serve", "generate", "chat"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = capsys.readouterr().out
        for f in fields(EngineConfig):
            assert f.metadata.get("help"), f"EngineConfig.{f.name} has no help text"
            assert flag_name(f.name) in help_text, (command, f.name)
    for f in fields(EngineConfig):
        words, value = _non_default(f, hints[f.name])
        assert value != f.default
        args = build_parser(["serve"]).parse_args(["serve", *words])
        config = config_from_args(args, model_from_args(args))
        assert getattr(config, f.name) == value, f.name
        args = build_parser(["generate"]).parse_args(["generate", "a prompt", *words])
        assert getattr(config_from_args(args, model_from_args(args)), f.name) == value, f.name


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_bench_engine_flags_are_engine_config_fields(command, monkeypatch, capsys):
    """`ironlm bench` generates its engine flags from EngineConfig too: each reaches LLM(**engine_args)."""
    import importlib

    from ironlm.bench.cli import main as bench_main

    bench = importlib.import_module(f"ironlm.bench.{command}")

    class Captured(Exception):
        pass

    def capture(config):
        raise Captured(config)

    monkeypatch.setattr(bench, "run", capture)
    with pytest.raises(SystemExit):
        bench_main([command, "--help"])
    help_text = capsys.readouterr().out
    # MODEL is positional; --seed and --warmup are the workload's own; an offline run has no served name.
    not_flags = {"model", "served_model_name", "seed", "warmup"}
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        words, value = _non_default(f, hints[f.name])
        if f.name in not_flags:
            words = ["--seed", "5"] if f.name == "seed" else []
        else:
            assert flag_name(f.name) in help_text, (command, f.name)
        with pytest.raises(Captured) as got:
            bench_main([command, *words])
        config = got.value.args[0]
        if f.name in not_flags:
            assert f.name not in config.engine_args, f.name
        elif command == "throughput" and f.name == "enable_prefix_caching":  # its config runs on and/or off
            assert config.enable_prefix_caching is value and f.name not in config.engine_args
        else:
            assert config.engine_args[f.name] == value, f.name


def test_bench_is_wired():
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0


def test_generate_streams_to_stdout(tiny: str, capsys):
    from ironlm import LLM, SamplingParams

    assert main(["generate", tiny, "hello there", "--max-tokens", "6", "--temperature", "0", *ENGINE_FLAGS]) == 0
    streamed = capsys.readouterr().out
    llm = LLM(tiny, num_kv_blocks=128, block_size=4, max_model_len=256, device="cpu")
    expected = llm.generate("hello there", SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert streamed == expected.outputs[0].text + "\n"  # the greedy completion, streamed piece by piece


def test_chat_session_from_stdin(tiny: str, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/reset\nagain\n/exit\n"))
    assert main(["chat", tiny, "--max-tokens", "4", "--temperature", "0", *ENGINE_FLAGS]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.strip()]) >= 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_logs_phases_and_drains_on_sigterm(tiny: str, caplog):
    """`ironlm serve` in this process (imports are the slow part of a subprocess): a real SIGTERM mid-stream
    must let the stream finish, then main() returns 0 without re-raising the signal."""
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    grpc_ok: list[bool] = []
    events: list[str] = []
    after: list[object] = []
    signalled = threading.Event()

    def client() -> None:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # --grpc-port: same engine
                reply = pb_grpc.GenerationStub(channel).Generate(
                    pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=2)), timeout=30)
                grpc_ok.append(reply.finished)
            body = {"model": "tiny", "prompt": "drain me", "max_tokens": 60, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line:
                        events.append(line)
                    if not signalled.is_set():
                        signalled.set()
                        os.kill(os.getpid(), signal.SIGTERM)
                        try:  # a new client during the drain is turned away
                            after.append(httpx.get(f"{url}/health", timeout=2).status_code)
                        except httpx.TransportError as exc:
                            after.append(exc)
        finally:
            if not signalled.is_set():  # never leave the server running
                signalled.set()
                os.kill(os.getpid(), signal.SIGTERM)

    reraised: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, _: reraised.append(sig))
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.INFO):
            rc = main(["serve", tiny, "--port", str(port), "--grpc-port", str(grpc_port), "--served-model-name",
                       "tiny", "--drain-timeout", "20", *ENGINE_FLAGS])
    finally:
        signal.signal(signal.SIGTERM, previous)
    thread.join(30)
    assert rc == 0 and reraised == [] and grpc_ok == [True]
    log = caplog.text
    assert "phase load_model" in log and "phase warmup" in log and "ready: serving tiny" in log, log
    assert "draining" in log
    assert after and after[0] != 200
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the in-flight request ran to the end
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 1
