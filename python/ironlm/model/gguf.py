"""Loading llama.cpp GGUF files: config from the metadata, tensors dequantized into the model dtype, tokenizer
through transformers' GGUF support (cached as a tokenizer.json folder after the first conversion).

Metadata and tensor infos are parsed here with the `gguf` package's constants (gguf's `GGUFReader` builds a numpy
memmap per token string, ~2 s for a 49k vocab; this parser takes milliseconds). Tensor data is memory-mapped.
F32/F16/BF16/Q8_0/Q4_0/Q4_1/MXFP4 are dequantized in numpy (vectorised, bit-identical to `gguf.quants.dequantize`)
when a tensor is not kept quantized (`quantization none`, a GPU, a tensor-parallel column cut);
every other type gguf knows (Q5_x, K-quants, ...) goes through `gguf.quants.dequantize`.

llama.cpp's converter permutes the rows of Q and K for llama-architecture models (its rotary pairs adjacent
elements, HF's rotates halves); we undo it so the weights are the HF ones, as transformers does.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ironlm import _core
from ironlm.model import registry
from ironlm.model.config import ModelConfig, UnsupportedModelError
from ironlm.model.families.common import gguf_rope_scaling
from ironlm.model.mla import rope_rows
from ironlm.model.moe.gguf import gguf_moe, split_experts
from ironlm.model.quantize import GGML_QUANTIZED, QuantSpec, from_float, is_quantized_tensor
from ironlm.model.weights import foreign_expert
from ironlm.model.weights import gguf_to_hf as hf_name

if TYPE_CHECKING:
    from ironlm.distributed.sharding import ShardSpec

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

# GGUFValueType -> struct format
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class StringArray:
    """A metadata array of strings (e.g. the vocabulary): only its length is kept."""

    length: int

    def __len__(self) -> int:
        return self.length


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first), i.e. GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name


class GGUFFile:
    """Minimal, fast GGUF reader: metadata dict, tensor infos, memory-mapped raw tensor bytes."""

    def __init__(self, path: str | os.PathLike) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = str(path)
        with open(self.path, "rb") as f:
            # copy-on-write mapping: writable views for torch.from_numpy, pages shared with the page cache
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        buf = self._mm
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (need >= 2)")
        self.version = version
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _read_str(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            value, pos = _read_value(buf, pos + 4, vtype)
            self.metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name, pos = _read_str(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise ValueError(f"{self.path}: tensor {name} has unknown ggml type {ggml_type}") from None
            n = int(np.prod(shape)) if shape else 1
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, data_start + offset, n // block * type_size)
        self._np = np.frombuffer(self._mm, dtype=np.uint8)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes (read-only view of the mapping)."""
        return self._np[info.offset : info.offset + info.nbytes]

    def dequantize(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        info = self.tensors[name]
        return dequantize(self.raw(info), info.ggml_type, info.shape).to(dtype)

    def close(self) -> None:
        self._np = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a tensor still views the mapping; it is released with it
            pass


def _read_str(buf: Any, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


def _read_value(buf: Any, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_str(buf, pos)
    if vtype == _ARRAY:
        itype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype in _NP:
            dt = np.dtype(_NP[itype]).newbyteorder("<")
            arr = np.frombuffer(buf, dtype=dt, count=count, offset=pos)
            return arr, pos + count * dt.itemsize
        if itype == _STRING:
            if count > 64:  # vocabularies / merges: skip over them, keep the length
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
                return StringArray(count), pos
            items = []
            for _ in range(count):
                s, pos = _read_str(buf, pos)
                items.append(s)
            return items, pos
        items = []
        for _ in range(count):
            v, pos = _read_value(buf, pos, itype)
            items.append(v)
        return items, pos
    raise ValueError(f"unknown GGUF metadata value type {vtype}")


# ---- dequantization -----------------------------------------------------------------------------------------
def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor bytes -> float tensor of `shape` (fp32, or the stored float type for F16/BF16)."""
    from gguf import GGMLQuantizationType as Q

    if ggml_type == Q.F32:
        return torch.from_numpy(_writable(raw)).view(torch.float32).view(shape)
    if ggml_type == Q.F16:
        return torch.from_numpy(_writable(raw)).view(torch.float16).view(shape)
    if ggml_type == Q.BF16:
        return torch.from_numpy(_writable(raw)).view(torch.bfloat16).view(shape)
    if ggml_type in _NUMPY_DEQUANT:
        out = _NUMPY_DEQUANT[ggml_type](raw)
    else:
        from gguf.quants import dequantize as gguf_dequantize

        out = np.ascontiguousarray(gguf_dequantize(np.asarray(raw), Q(ggml_type)), dtype=np.float32)
    return torch.from_numpy(out).view(shape)


# numpy, not torch: torch's elementwise kernels crawl on the [n_blocks, 16]-strided views these formats need,
# numpy handles them at memory speed. Same arithmetic (and so bit-identical results) as gguf.quants.
def _scale(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)  # [n, 1]


def _nibbles(qs: np.ndarray, dtype: type) -> np.ndarray:
    out = np.empty((qs.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, :16])  # element j < 16: low nibble of byte j
    np.right_shift(qs, 4, out=out[:, 16:])  # element j >= 16: high nibble of byte j - 16
    return out.view(dtype) if dtype is not np.uint8 else out


def _dq_q8_0(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    blocks = raw.reshape(-1, 34)
    out = np.empty(blocks.shape[0] * 32, np.float32) if out is None else out
    np.multiply(blocks[:, 2:].view(np.int8), _scale(blocks, 0), out=out.reshape(-1, 32))
    return out


def _dq_q4_0(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    blocks = raw.reshape(-1, 18)
    q = _nibbles(blocks[:, 2:], np.int8)
    q -= 8
    out = np.empty(blocks.shape[0] * 32, np.float32) if out is None else out
    np.multiply(q, _scale(blocks, 0), out=out.reshape(-1, 32))
    return out


def _dq_q4_1(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    blocks = raw.reshape(-1, 20)
    out = np.empty(blocks.shape[0] * 32, np.float32) if out is None else out
    o = out.reshape(-1, 32)
    np.multiply(_nibbles(blocks[:, 4:], np.uint8), _scale(blocks, 0), out=o)
    o += _scale(blocks, 2)
    return out


# E2M1 codes -> values, doubled (the scale below is half the E8M0 power): ggml's kvalues_mxfp4
_E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def _dq_mxfp4(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """MXFP4 (gpt-oss's experts): 32 elements per 17-byte block, an E8M0 exponent byte then 16 bytes of E2M1
    codes (element j < 16 in byte j's low nibble, j >= 16 in byte j - 16's high one)."""
    blocks = raw.reshape(-1, 17)
    e = blocks[:, :1].astype(np.uint32)
    # 2 ** (e - 127) / 2 as float32 bits (ggml_e8m0_to_fp32_half): subnormal for e < 2
    half = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)
    out = np.empty(blocks.shape[0] * 32, np.float32) if out is None else out
    np.multiply(half, _E2M1[_nibbles(blocks[:, 1:], np.uint8)], out=out.reshape(-1, 32))
    return out


_NUMPY_DEQUANT = {8: _dq_q8_0, 2: _dq_q4_0, 3: _dq_q4_1, 39: _dq_mxfp4}  # GGMLQuantizationType values (stable)


def _writable(raw: np.ndarray) -> np.ndarray:
    # torch.from_numpy warns on read-only arrays; the mapping is copy-on-write, so this is only a fallback.
    return raw if raw.flags.writeable else raw.copy()


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (rows of each head: interleaved pairs -> halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---- config -------------------------------------------------------------------------------------------------
def gguf_config(gf: GGUFFile) -> ModelConfig:
    arch = gf.get("general.architecture")
    family = registry.by_gguf_arch(arch)

    def meta(key: str, default: Any = None) -> Any:
        return gf.get(f"{arch}.{key}", default)

    def scalar(value: Any, what: str) -> int:
        if isinstance(value, np.ndarray):  # per-layer arrays (hybrid models): only uniform ones are supported
            if len(set(value.tolist())) != 1:
                raise UnsupportedModelError(f"per-layer {what} {value.tolist()} is not supported")
            value = value[0]
        return int(value)

    hidden = int(meta("embedding_length"))
    num_heads = scalar(meta("attention.head_count"), "head_count")
    num_kv = scalar(meta("attention.head_count_kv", num_heads), "head_count_kv")
    head_dim = meta("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta("rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // num_heads
    vocab = meta("vocab_size")
    if vocab is None:
        tokens = gf.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else gf.tensors["token_embd.weight"].shape[0]

    rope_scaling = gguf_rope_scaling(meta)
    freq_factors = None
    if "rope_freqs.weight" in gf.tensors:
        freq_factors = gf.dequantize("rope_freqs.weight").float().flatten().tolist()

    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = gf.get(key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    bos = gf.get("tokenizer.ggml.bos_token_id")
    pad = gf.get("tokenizer.ggml.padding_token_id")
    fields: dict[str, Any] = dict(  # noqa: C408 - keyword form, as the dataclass call it feeds
        architecture=family.model_types[0],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=scalar(meta("feed_forward_length"), "feed_forward_length"),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length", 4096)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rope_freq_factors=freq_factors,
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        attention_out_bias="blk.0.attn_output.bias" in gf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        pad_token_id=None if pad is None else int(pad),
        source="gguf",
        moe=gguf_moe(meta, gf, arch, int(meta("block_count"))),
    )
    fields.update(family.gguf_fields(meta, gf))
    return ModelConfig(**fields)


# ---- weights ------------------------------------------------------------------------------------------------
def load_gguf_weights(model: Any, gf: GGUFFile, config: ModelConfig,
                      spec: QuantSpec | None = None) -> dict[str, Any]:
    """Dequantize every tensor straight into its (fused) model parameter, un-permuting Q/K for llama archs; with
    a quantized `spec`, the linears become QuantMatrix objects instead (their blocks kept, see model/quantize.py),
    returned by HF name for the model's `quantize_` to install after `finish_loading`.

    Contiguous fp32 CPU targets are written in place by the numpy kernels; everything else (the transposed
    projection weights) goes through one temporary per tensor.
    """
    family = registry.by_gguf_arch(gf.get("general.architecture"))
    permute, renames = family.gguf_permuted_qk, family.gguf_renames
    split_fused(gf, config)
    parts: dict[str, Any] = {}
    shard: ShardSpec | None = None if model.tp is None else model.tp.shard  # tensor parallel: dequantize, slice
    for name, info in gf.tensors.items():
        target_name = hf_name(name, renames)
        if target_name is None or foreign_expert(model.config, target_name):
            continue  # another rank's expert (expert parallelism): its blocks are never read
        if spec is not None and spec.enabled and is_quantized_tensor(name):
            heads = 0
            if permute and (".attn_q." in name or ".attn_k." in name):
                heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            rows = rope_rows(config, target_name.partition(".self_attn.")[2])  # MLA: de-interleave kept q / kv_a
            parts[target_name] = from_gguf(gf, name, spec, heads, shard, rows)
            model.mark_loaded(target_name)
            continue
        dest = model.weight_target(target_name)
        if dest is None:
            continue
        if shard is None and tuple(dest.shape) != info.shape:
            raise ValueError(f"GGUF tensor {name}: shape {info.shape} != expected {tuple(dest.shape)}")
        raw = gf.raw(info)
        is_qk = ".attn_q." in name or ".attn_k." in name
        n_head = config.num_heads if ".attn_q." in name else config.num_kv_heads
        with torch.no_grad():
            numpy_ok = info.ggml_type in _NUMPY_DEQUANT and dest.device.type == "cpu" and dest.dtype == torch.float32
            if numpy_ok and dest.is_contiguous() and not (permute and is_qk) and shard is None:
                _NUMPY_DEQUANT[info.ggml_type](raw, out=dest.detach().numpy().reshape(-1))  # in place, no temp
            else:
                w = dequantize(raw, info.ggml_type, info.shape)
                if permute and is_qk:
                    w = unpermute_qk(w, n_head)
                if shard is not None:
                    w = shard.take(target_name, w, tuple(w.shape))
                if tuple(dest.shape) != tuple(w.shape):
                    raise ValueError(f"GGUF tensor {name}: shape {tuple(w.shape)} != expected {tuple(dest.shape)}")
                dest.copy_(w)
        model.mark_loaded(target_name)
    return parts


def split_fused(gf: GGUFFile, config: ModelConfig) -> None:
    """Replace fused tensors by row slices under the unfused names (in place, idempotent): ``attn_qkv`` (Phi-3 and
    others) -> ``attn_q|k|v``, and an ``ffn_up`` twice the MLP width with no ``ffn_gate`` (Phi-3's gate|up) ->
    ``ffn_gate`` + ``ffn_up``. A slice of whole rows is a tensor of its own in every GGUF type (no block spans
    two rows), so quantized blocks are kept and every later step (Q/K un-permutation, tensor-parallel slicing,
    QuantMatrix) sees ordinary tensors."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def cut(info: GGUFTensorInfo, names: list[str], sizes: list[int]) -> None:
        rows, cols = info.shape
        if sum(sizes) != rows:
            raise ValueError(f"GGUF tensor {info.name}: {rows} rows, expected {sum(sizes)} ({'+'.join(map(str, sizes))})")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        row_bytes = cols // block * type_size
        del gf.tensors[info.name]  # first: Phi-3's up half keeps the fused tensor's name
        start = 0
        for name, n in zip(names, sizes):
            gf.tensors[name] = GGUFTensorInfo(name, (n, cols), info.ggml_type, info.offset + start * row_bytes,
                                              n * row_bytes)
            start += n

    split_experts(gf, lambda t: GGML_QUANT_SIZES[GGMLQuantizationType(t)])
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for name, info in list(gf.tensors.items()):
        m = _BLOCK_RE.match(name)
        if m is None or len(info.shape) != 2:
            continue
        blk = f"blk.{m.group(1)}."
        if m.group(2) == "attn_qkv.weight":
            cut(info, [blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"], [q, kv, kv])
        elif m.group(2) == "ffn_up.weight" and info.shape[0] == 2 * inter and blk + "ffn_gate.weight" not in gf.tensors:
            cut(info, [blk + "ffn_gate.weight", blk + "ffn_up.weight"], [inter, inter])


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def has_quantized_linears(gf: GGUFFile) -> bool:
    """Whether the file's linears are quantized blocks the core's kernels can keep (quantization `auto`)."""
    return any(info.ggml_type in GGML_QUANTIZED for name, info in gf.tensors.items() if is_quantized_tensor(name))


def from_gguf(gf: GGUFFile, name: str, spec: QuantSpec, unpermute_heads: int = 0,
              shard: ShardSpec | None = None, rows_order: torch.Tensor | None = None) -> _core.QuantMatrix:
    """A GGUF tensor as a QuantMatrix: quantized types keep their blocks (rows re-ordered for llama Q/K without
    dequantizing: a block never spans rows); float tensors are quantized per `spec` (int8, groups of 32 when the
    file decides). With a tensor-parallel `shard`, only this rank's part: a row slice keeps the blocks (zero bytes
    are zero weights in every kept type, so vocab padding rows are zero blocks); a column slice (o, down) cuts
    through blocks, so those are dequantized, sliced and quantized again to int8."""
    info = gf.tensors[name]
    rows, cols = info.shape
    hf = hf_name(name, registry.by_gguf_arch(gf.get("general.architecture")).gguf_renames) or name
    cut = None if shard is None else shard.cut(hf)
    if info.ggml_type in GGML_QUANTIZED and spec.source == "gguf" and (cut is None or cut.dim == 0):
        raw = np.asarray(gf.raw(info)).reshape(rows, -1)
        if unpermute_heads:
            raw = unpermute_qk(torch.from_numpy(raw.copy()), unpermute_heads).numpy()
        if rows_order is not None:
            raw = raw[rows_order.numpy()]
        if cut is not None:
            part = raw[cut.start:min(cut.stop, rows)]
            pad = (cut.stop - cut.start) - len(part)
            raw = np.concatenate([part, np.zeros((pad, raw.shape[1]), raw.dtype)]) if pad else part
            rows = cut.stop - cut.start
        return _core.QuantMatrix.from_ggml(np.ascontiguousarray(raw).reshape(-1), info.ggml_type, rows, cols)
    w = dequantize(gf.raw(info), info.ggml_type, info.shape)
    if unpermute_heads:
        w = unpermute_qk(w, unpermute_heads)
    if rows_order is not None:
        w = w[rows_order]
    if shard is not None:
        if cut is not None and info.ggml_type in GGML_QUANTIZED and spec.source == "gguf":
            logger.info("tensor parallel: %s is split across its quantized blocks; this rank dequantizes its "
                        "columns and keeps them as int8", name)
        w = shard.take(hf, w, tuple(w.shape))
        if cut is not None and cut.dim == 1 and w.shape[1] % 32:  # the core's rows are whole 32-column blocks
            raise UnsupportedModelError(
                f"tensor parallel: {name} splits into {w.shape[1]} columns a rank, not a multiple of 32, which its "
                "quantized blocks need; load it with quantization='none' or fewer ranks")
    return from_float(w, spec if spec.source == "load" else QuantSpec(bits=8, group_size=32))


# ---- tokenizer ----------------------------------------------------------------------------------------------
def _cache_root() -> Path:
    root = os.environ.get("IRONLM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ironlm"


def load_gguf_tokenizer(path: str | os.PathLike, *, use_cache: bool = True) -> Any:
    """transformers' GGUF tokenizer conversion (seconds), cached as a saved tokenizer folder (tens of ms).

    The cache key covers the file's path, size and mtime and the transformers version; any cache failure falls
    back to the plain conversion. IRONLM_CACHE_DIR moves the cache; IRONLM_NO_TOKENIZER_CACHE=1 disables it.
    """
    import transformers
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    use_cache = use_cache and not os.environ.get("IRONLM_NO_TOKENIZER_CACHE")
    cache_dir = None
    if use_cache:
        st = path.stat()
        key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        cache_dir = _cache_root() / "tokenizers" / f"{path.stem}-{digest}"
        if (cache_dir / "tokenizer_config.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(cache_dir))
            except Exception as exc:  # noqa: BLE001 - a stale/corrupt cache entry: convert again
                logger.warning("ignoring unreadable tokenizer cache %s: %s", cache_dir, exc)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, TypeError) as exc:
        # AutoTokenizer first rebuilds a transformers config, which it cannot for architectures its GGUF support
        # lacks (olmo2, smollm3, granite, ...) or misreads (gpt-oss: a TypeError on an array-valued key); the
        # tokenizer itself only needs the tokenizer.* metadata.
        if isinstance(exc, ValueError) and "architecture" not in str(exc):
            raise
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    if cache_dir is not None:
        tmp = cache_dir.with_name(f"{cache_dir.name}.tmp{os.getpid()}")
        try:
            tokenizer.save_pretrained(str(tmp))
            os.replace(tmp, cache_dir)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def resolve_gguf(path: Path) -> Path | None:
    """A .gguf file, or a folder holding exactly one; None otherwise."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise ValueError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)}); pass one")
    return None


_QUANT_SUFFIX = re.compile(r"[.\-_](?:[QqIi][A-Za-z0-9]*_[A-Za-z0-9_]+|[Qq]\d+|[Ff]16|[Ff]32|[Bb][Ff]16)$")


def gguf_model_name(path: Path) -> str:
    """File stem without the quantization suffix: SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem
