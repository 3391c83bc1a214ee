"""Loading HF model folders: `config.json` through `transformers.AutoConfig`, weights from safetensors (one file
or sharded with `model.safetensors.index.json`; `pytorch_model*.bin` as a fallback), tokenizer through
`AutoTokenizer`.

Safetensors files are memory-mapped and read one tensor at a time straight into the model's (fused) parameters,
so peak memory is the model plus one tensor.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ironlm.model import registry, weights
from ironlm.model.config import ModelConfig
from ironlm.model.llama import DecoderLM

logger = logging.getLogger(__name__)


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def load_hf_config(path: Path) -> ModelConfig:
    from transformers import AutoConfig, GenerationConfig

    cfg_json = json.loads((path / "config.json").read_text())
    model_type = cfg_json.get("model_type")
    archs = cfg_json.get("architectures") or [model_type]
    # fail before transformers tries to build an unknown class
    registry.by_model_type(model_type, f"{'/'.join(map(str, archs))} (model_type={model_type!r})")
    hf_config = AutoConfig.from_pretrained(str(path))
    gen = None
    if (path / "generation_config.json").is_file():
        try:
            gen = GenerationConfig.from_pretrained(str(path))
        except Exception as exc:  # noqa: BLE001 - a broken generation config must not stop the model loading
            logger.warning("ignoring unreadable generation_config.json in %s: %s", path, exc)
            gen = None
    return ModelConfig.from_hf(hf_config, gen)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise FileNotFoundError(f"no model weights (*.safetensors or pytorch_model*.bin) in {path}")


def iter_weights(files: list[Path], skip: Callable[[str], bool] | None = None):
    """(name, tensor) pairs, one tensor materialised at a time; names `skip` accepts are never read."""
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                    if skip is None or not skip(name):
                        yield name, sf.get_tensor(name)
        else:
            state = torch.load(str(f), map_location="cpu", mmap=True, weights_only=True)
            for name in list(state.keys()):
                tensor = state.pop(name)  # mmap: a tensor skipped here is never paged in
                if skip is None or not skip(name):
                    yield name, tensor
            del state


def load_hf_weights(model: DecoderLM, path: Path) -> None:
    files = weight_files(path)
    split = registry.by_model_type(model.config.architecture).split is not None  # splitting reads whole tensors
    if model.tp is not None and not split and all(f.suffix == ".safetensors" for f in files):
        _load_shard(model, files)
    else:
        # expert parallelism: another rank's experts are skipped by name, before a split family renames them
        for name, tensor in iter_weights(files, lambda n: weights.foreign_expert(model.config, n)):
            model.load_weight(name, tensor)
    model.finish_loading()


def _load_shard(model: DecoderLM, files: list[Path]) -> None:
    """Tensor parallel: read only this rank's slice of each weight (safetensors slices are lazy)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                if weights.wanted(model, weights.canonical(model.config, name)):
                    part = sf.get_slice(name)
                    model.load_weight(name, part, tuple(part.get_shape()))


def load_hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def model_name_for(path: Path) -> str:
    return os.path.basename(os.path.normpath(str(path)))
