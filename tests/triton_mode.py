"""The Triton interpreter switch for the test modules that run Triton kernels (test_kernels.py's docstring says why).

Import it before anything that may import triton: it sets ``TRITON_INTERPRET=1`` unless a CUDA device is there.
``IN_PROCESS`` is False when triton was imported in compiled mode earlier in this process; a module then calls
``subprocess_test(__file__)`` in place of its tests, which reruns the module in a fresh interpreted process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _interpreter_usable() -> bool:
    if "triton" not in sys.modules:
        return True  # imported after the variable is set below: interpreted
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.sum, InterpretedFunction)


IN_PROCESS = ON_GPU or _interpreter_usable()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


def subprocess_test(path: str) -> Callable[[], None]:
    """A test that runs the module at `path` under pytest in a fresh process with the interpreter on."""

    def test_in_interpreter_subprocess() -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                              env=env, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]

    return test_in_interpreter_subprocess
