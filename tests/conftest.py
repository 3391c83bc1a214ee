"""Where the suite runs: a CPU machine or a GPU one. Engines built with the default device ("auto") land on CUDA
wherever there is one, so what a test may expect depends on the machine; the helpers here (and tests/devices.py)
say it once instead of in every file.

- `@pytest.mark.cuda`: the test needs a CUDA device (skipped on a CPU machine).
- `devices.logprob_atol(device, dtype)`: how far an engine's logprobs may sit from an fp32 transformers oracle.

Tests that start several ranks pin `device="cpu"` (gloo ranks share the CPU), so a one-GPU machine never asks
for a second GPU.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
