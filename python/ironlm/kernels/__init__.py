"""Triton kernels: paged prefill and decode attention, and the KV-cache write.

Their sources live in the repository's top-level `kernels/` directory. A wheel carries them inside this
package (build.rs stages them and `[tool.maturin] include` puts them here); in a source checkout, editable
installs included, this package reads them from `kernels/` in place, so an edited kernel needs no rebuild.
"""

from pathlib import Path

_SOURCE_KERNELS = Path(__file__).resolve().parents[3] / "kernels"
# Both markers: only a checkout of this repository has kernels/ next to Cargo.toml, never an install prefix.
if (_SOURCE_KERNELS / "decode_attention.py").is_file() and (_SOURCE_KERNELS.parent / "Cargo.toml").is_file():
    __path__.insert(0, str(_SOURCE_KERNELS))
