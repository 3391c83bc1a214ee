"""Where the suite runs: a CPU machine, one GPU or several. Engines built with the default device ("auto") land on
CUDA wherever there is one, so what a test may expect depends on the machine it runs on; the helpers here say it
once instead of in every file.

- `@pytest.mark.devices(n)`: the test starts `n` ranks on the devices "auto" picks. CPU ranks share the CPU
  (gloo), so any `n` runs there; on CUDA every rank takes its own GPU (`cuda:<local rank>`), so with fewer than
  `n` GPUs the test is skipped instead of asking for a device that is not there.
- `@pytest.mark.cuda`: the test needs a CUDA device (skipped on a CPU machine).
- `logprob_atol(device, dtype)`: how far an engine's logprobs may sit from an fp32 transformers oracle.
"""

from __future__ import annotations

import pytest
import torch

from devices import devices_available


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "devices(n): starts n ranks on the devices 'auto' picks (skipped if fewer)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("devices"):
        ok, why = devices_available(int(mark.args[0]))
        if not ok:
            pytest.skip(why)
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
