"""`--config FILE.yaml` for `ironlm serve/generate/chat`: keys are the flag names, the command line wins, the seed
article's `scheduler:` block maps onto real settings, and a bad file is a usage error (exit 2) naming the key."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ironlm.cli import build_parser
from ironlm.cli_args import apply_config_file, config_from_args, model_from_args, server_config_from_args

# The block as the deployment article (shared/seeds/000_*.txt) shows it.
SEED_SCHEDULER = """\
scheduler:
  max_batch_size: 64
  timeout_ms: 5000
  policy: "fair_share"
  preemption: "aggressive"
"""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser(argv)
    return apply_config_file(parser, argv, parser.parse_args(argv))


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ironlm.yaml"
    path.write_text(text)
    return str(path)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_file_values_are_applied_typed_like_the_flags(tmp_path):
    path = _yaml(tmp_path, """\
model: /models/tiny
max-num-seqs: 12
block_size: 8
gpu_memory_utilization: 0.5
enable_prefix_caching: false
kv_cache_memory: 2GiB
served_model_name: [a, b]
tenant_weights: "x=2,y=1"
port: 9001
allowed_origins: ["https://a.example"]
""")
    args = _parse(["serve", "--config", path])
    config = config_from_args(args, model_from_args(args))
    assert (config.model, config.max_num_seqs, config.block_size) == ("/models/tiny", 12, 8)
    assert config.gpu_memory_utilization == 0.5 and config.enable_prefix_caching is False
    assert config.kv_cache_memory == "2GiB" and config.served_model_name == "a"
    assert config.tenant_weight_map() == {"x": 2.0, "y": 1.0}
    server = server_config_from_args(args)
    assert server.port == 9001 and server.allowed_origins == ("https://a.example",)
    assert args.served_model_name == ["a", "b"]


def test_the_command_line_wins_over_the_file(tmp_path):
    path = _yaml(tmp_path, "model: /from/file\nmax_num_seqs: 12\nenable_prefix_caching: true\nport: 9001\n")
    args = _parse(["serve", "/from/cli", "--max-num-seqs", "3", "--config", path, "--no-enable-prefix-caching"])
    config = config_from_args(args, model_from_args(args))
    assert config.model == "/from/cli"  # the positional MODEL too
    assert config.max_num_seqs == 3 and config.enable_prefix_caching is False
    assert server_config_from_args(args).port == 9001  # not on the command line: the file's


def test_generate_and_chat_take_the_same_file(tmp_path):
    path = _yaml(tmp_path, SEED_SCHEDULER + "max_model_len: 512\n")
    for argv in (["generate", "hello", "--config", path], ["chat", "--config", path]):
        config = config_from_args(args := _parse(argv), model_from_args(args))
        assert config.max_num_seqs == 64 and config.max_model_len == 512 and config.scheduling_policy == "fair"


def test_bench_commands_with_engine_flags_take_their_own_flags(tmp_path):
    """`ironlm bench throughput --config`: its keys are that command's flags, the workload's and the engine's."""
    from ironlm.bench import cli as bench_cli

    path = _yaml(tmp_path, "num_prompts: 5\ndataset: prefix\nmax_num_seqs: 3\nscheduler: {policy: fair_share}\n")
    args = _parse(["bench", "throughput", "--config", path, "--seed", "7"])
    assert (args.num_requests, args.dataset, args.seed, args.max_num_seqs) == (5, "prefix", 7, 3)
    assert args.scheduling_policy == "fair"
    # The standalone entry point (python -m ironlm.bench.cli) reads the file too: a bad key stops it before any run.
    with pytest.raises(SystemExit) as exc:
        bench_cli.main(["throughput", "--config", _yaml(tmp_path, "num_prompts: 5\nwarp_speed: 9\n")])
    assert exc.value.code == 2


def test_the_seed_scheduler_block_maps_onto_real_settings(tmp_path):
    args = _parse(["serve", "--config", _yaml(tmp_path, SEED_SCHEDULER)])
    config = config_from_args(args, None)
    assert config.max_num_seqs == 64
    assert config.queue_timeout == pytest.approx(5.0)  # ms -> the engine's queue timeout in seconds
    assert config.scheduling_policy == "fair" and config.preemption == "aggressive"
    sched = config.scheduler_config(num_blocks=64, max_num_batched_tokens=2048, max_model_len=512, tier_blocks=0,
                                    sliding_window=None)
    assert sched.policy == "fair" and sched.max_num_seqs == 64 and sched.reserve_decode is False
    conservative = _parse(["serve", "--config", _yaml(tmp_path, SEED_SCHEDULER.replace("aggressive",
                                                                                         "conservative"))])
    sched = config_from_args(conservative, None).scheduler_config(
        num_blocks=64, max_num_batched_tokens=2048, max_model_len=512, tier_blocks=0, sliding_window=None)
    assert sched.reserve_decode is True


def test_unknown_keys_are_usage_errors_naming_the_key(tmp_path, capsys):
    err = _usage_error(["serve", "--config", _yaml(tmp_path, "max_num_seqs: 4\nbatch_wizardry: 3\n")], capsys)
    assert "batch_wizardry" in err and "unknown setting" in err and "Traceback" not in err
    err = _usage_error(["serve", "--config", _yaml(tmp_path, "scheduler:\n  max_batch_size: 4\n  swap: yes\n")],
                       capsys)
    assert "scheduler.swap" in err and "max_batch_size" in err  # names the key and the known ones
    # A flag of another command is no key of this one.
    err = _usage_error(["chat", "--config", _yaml(tmp_path, "port: 8001\n")], capsys)
    assert "port" in err


@pytest.mark.parametrize(("text", "named"), [
    ("max_num_seqs: lots\n", "max_num_seqs: expected an integer, got 'lots'"),
    ("max_num_seqs: 2.5\n", "max_num_seqs: expected an integer"),
    ("enable_prefix_caching: maybe\n", "enable_prefix_caching: expected true or false"),
    ("dtype: float8\n", "dtype: must be one of"),
    ("max_num_seqs: [1, 2]\n", "max_num_seqs: expected a single value"),
    ("scheduler:\n  policy: round_robin\n", "scheduler.policy: must be one of"),
    ("scheduler:\n  timeout_ms: 5s\n", "scheduler.timeout_ms: expected a number of milliseconds"),
    ("scheduler:\n  preemption: sometimes\n", "scheduler.preemption: must be one of aggressive, conservative"),
    ("scheduler:\n  max_batch_size: 8\nmax_num_seqs: 8\n", "sets the same setting as scheduler.max_batch_size"),
    ("- max_num_seqs\n", "must hold a mapping"),
    ("max_num_seqs: [\n", "not valid YAML"),
])
def test_bad_values_are_named(tmp_path, capsys, text, named):
    err = _usage_error(["serve", "--config", _yaml(tmp_path, text)], capsys)
    assert named in err, err


def test_a_missing_file_is_a_usage_error(tmp_path, capsys):
    err = _usage_error(["serve", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert "cannot read" in err and "nope.yaml" in err


def test_a_value_the_config_refuses_ends_with_exit_2_not_a_traceback(tmp_path):
    """Type-correct but invalid (EngineConfig's own check), through the real `ironlm` entry point."""
    path = _yaml(tmp_path, SEED_SCHEDULER.replace("max_batch_size: 64", "max_batch_size: 0"))
    run = subprocess.run([sys.executable, "-m", "ironlm.cli", "generate", "hi", "--config", path, "--device", "cpu"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "max_num_seqs" in run.stderr and "Traceback" not in run.stderr
