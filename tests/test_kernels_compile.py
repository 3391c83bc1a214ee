"""Every Triton kernel compiles for sm_90 (H100/H200) on this CPU-only machine.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs the real GPU pipeline down to a cubin
(ptxas included) and rejects what a launch on the GPU would (fp16 tl.dot with K < 16, loop-carried type changes,
layouts the backend can't lower). It must run with the interpreter OFF, so the compiles happen in a subprocess
whose environment has no TRITON_INTERPRET (test_kernels.py sets it in this process) and a private
TRITON_CACHE_DIR. The configurations below mirror what the wrappers in ironlm.kernels launch: same constexprs,
default num_warps/num_stages, 16-byte divisibility hints on pointers and strides as the launcher would infer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import ironlm.kernels.cache_write as cw
import ironlm.kernels.decode_attention as da
import ironlm.kernels.fused_moe as fm
import ironlm.kernels.prefill_attention as pa
import ironlm.kernels.quant_matmul as qm

assert not da.interpreted(), "compile checks need TRITON_INTERPRET unset"
TARGET = GPUTarget("cuda", 90, 32)
TY = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
# Pointer args that always hold int32 metadata / fp32 partials; everything else follows the model dtype.
INT_PTRS = {"slot_ptr": "*i64", "seq_ids_ptr": "*i32", "query_start_ptr": "*i32", "seq_lens_ptr": "*i32",
            "block_tables_ptr": "*i32", "sinks_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
            "route_w_ptr": "*fp32"}
# runtime values without a 16-multiple
NOT_DIV16 = {"stride_bt", "num_splits", "stride_lb", "stride_lh", "M", "N", "K", "stride_sn", "num_pairs",
             "stride_se"}


def compile_one(fn, dtype, constexprs, ptr_types=None, options=None):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = (ptr_types or {}).get(name) or INT_PTRS.get(name) or TY[dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "softcap", "alpha", "limit"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name not in NOT_DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {"num_warps": 4, "num_stages": 3, **(options or {})}
    k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=TARGET, options=opts)
    return {"kernel": fn.__name__, "dtype": dtype, **{k2: str(v) for k2, v in constexprs.items()},
            "shared": k.metadata.shared, "ptx_bytes": len(k.asm["ptx"]), "cubin_bytes": len(k.asm["cubin"])}


results = []
job = json.loads(sys.argv[1])
for cfg in job["configs"]:
  for dtype in cfg["dtypes"]:
    for d in cfg["head_dims"]:
        for hkv in (1, 8):
            row = hkv * d
            results.append(compile_one(cw.reshape_and_cache_kernel, dtype,
                                       {"ROW": row, "BLOCK": triton.next_power_of_2(row)}))
        for group in cfg["groups"]:
            block_g, use_dot = da.decode_block_g(group)
            for partial in (False, True):
                ptrs = {"out_ptr": "*fp32", "lse_ptr": "*fp32"} if partial else {"lse_ptr": TY[dtype]}
                results.append(compile_one(da.decode_attention_kernel, dtype, {
                    "GROUP": group, "BLOCK_G": block_g, "HEAD_DIM": d, "BLOCK_N": 64, "PAGE_SIZE": 16,
                    "USE_DOT": use_dot, "COMPUTE_F32": False,
                    "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "WRITE_PARTIAL": partial,
                    "SOFTCAP": False, "HAS_SINKS": False}, ptrs))
        results.append(compile_one(da.decode_reduce_kernel, dtype, {"HEAD_DIM": d, "BLOCK_S": 32,
                                                                     "HAS_SINKS": False},
                                   {"part_ptr": "*fp32", "lse_ptr": "*fp32"}))
        for group in (1, cfg["groups"][-1]):
            results.append(compile_one(pa.prefill_attention_kernel, dtype, {
                "GROUP": group, "HEAD_DIM": d, "BLOCK_M": 64, "BLOCK_N": 64, "PAGE_SIZE": 16,
                "COMPUTE_F32": False, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "SOFTCAP": False,
                "HAS_SINKS": False}))
    # Soft-capped logits (Gemma 2): both attention kernels once per dtype, largest head_dim and group
    d, group = max(cfg["head_dims"]), cfg["groups"][-1]
    block_g, use_dot = da.decode_block_g(group)
    for dtype in cfg["dtypes"]:
        precision = "ieee" if dtype == "fp32" else "tf32"
        for partial in (False, True):
            ptrs = {"out_ptr": "*fp32", "lse_ptr": "*fp32"} if partial else {"lse_ptr": TY[dtype]}
            results.append(compile_one(da.decode_attention_kernel, dtype, {
                "GROUP": group, "BLOCK_G": block_g, "HEAD_DIM": d, "BLOCK_N": 64, "PAGE_SIZE": 16,
                "USE_DOT": use_dot, "COMPUTE_F32": False, "DOT_PRECISION": precision, "WRITE_PARTIAL": partial,
                "SOFTCAP": True, "HAS_SINKS": False}, ptrs))
        results.append(compile_one(pa.prefill_attention_kernel, dtype, {
            "GROUP": group, "HEAD_DIM": d, "BLOCK_M": 64, "BLOCK_N": 64, "PAGE_SIZE": 16,
            "COMPUTE_F32": False, "DOT_PRECISION": precision, "SOFTCAP": True, "HAS_SINKS": False}))
    # Attention sinks (gpt-oss, head_dim 64, GQA 8): both attention kernels and stage 2 once per dtype, with a window
    # as gpt-oss's sliding layers run them (the window is a runtime value: the same compile serves both)
    group = cfg["groups"][-1]
    block_g, use_dot = da.decode_block_g(group)
    for dtype in cfg["dtypes"]:
        precision = "ieee" if dtype == "fp32" else "tf32"
        for partial in (False, True):
            ptrs = {"out_ptr": "*fp32", "lse_ptr": "*fp32"} if partial else {"lse_ptr": TY[dtype]}
            results.append(compile_one(da.decode_attention_kernel, dtype, {
                "GROUP": group, "BLOCK_G": block_g, "HEAD_DIM": 64, "BLOCK_N": 64, "PAGE_SIZE": 16,
                "USE_DOT": use_dot, "COMPUTE_F32": False, "DOT_PRECISION": precision, "WRITE_PARTIAL": partial,
                "SOFTCAP": False, "HAS_SINKS": True}, ptrs))
        results.append(compile_one(da.decode_reduce_kernel, dtype, {"HEAD_DIM": 64, "BLOCK_S": 32,
                                                                     "HAS_SINKS": True},
                                   {"part_ptr": "*fp32", "lse_ptr": "*fp32"}))
        results.append(compile_one(pa.prefill_attention_kernel, dtype, {
            "GROUP": group, "HEAD_DIM": 64, "BLOCK_M": 64, "BLOCK_N": 64, "PAGE_SIZE": 16,
            "COMPUTE_F32": False, "DOT_PRECISION": precision, "SOFTCAP": False, "HAS_SINKS": True}))
# The weight-only GEMM: int8 per channel and int4 in groups of 32 / 128, decode (16-row) and prefill (64-row) tiles.
for dtype in job["quant_dtypes"]:
    for bits, group in ((8, 0), (4, 32), (4, 128)):
        for m in (1, 256):
            block_m, block_n, block_k = qm.tiles(m, group)
            results.append(compile_one(qm.quant_matmul_kernel, dtype, {
                "BITS": bits, "GROUP": group, "HAS_BIAS": True, "HAS_RES": True, "BLOCK_M": block_m,
                "BLOCK_N": block_n, "BLOCK_K": block_k, "DOT_PRECISION": "tf32"},
                {"w_ptr": "*i8" if bits == 8 else "*u8", "s_ptr": "*fp32"}))
# The fused MoE: gate_up (SiLU) and down (fp32 rows) with decode (16-row) and prefill (64-row) blocks in each dtype;
# GELU-tanh and the clamped SwiGLU with biases once (bf16); int8 / int4 experts in the 16-bit dtypes, 64-row blocks.
# Strides of 1 (dense N, quantized K, per-channel scales) are constexprs, as the launcher specializes them.
def moe_cases(dtype):
    for block_m in (16, 64):
        yield from ((16, 0, block_m, act, False) for act in (1, 0))
    if dtype == "bf16":
        yield from ((16, 0, 16, act, True) for act in (2, 3))
    if dtype != "fp32":
        yield from ((bits, group, 64, act, False) for bits, group in ((8, 0), (4, 32)) for act in (1, 0))


for dtype in job.get("moe_dtypes", []):
    for bits, group, block_m, act, bias in moe_cases(dtype):
        _, block_n, block_k = fm.tiles(block_m * 8, 8, 2048, group)
        ones = {"stride_wn": 1} if bits == 16 else {"stride_wk": 1, **({"stride_sn": 1} if group == 0 else {})}
        ptrs = {"w_ptr": {16: TY[dtype], 8: "*i8", 4: "*u8"}[bits], "s_ptr": "*fp32"}
        if act == 0:
            ptrs["out_ptr"] = "*fp32"
        results.append(compile_one(fm.fused_moe_kernel, dtype, {
            **ones, "ROW_DIV": 2 if act else 1, "ACT": act, "BITS": bits, "GROUP": group, "HAS_BIAS": bias,
            "MUL_ROUTED": act == 0, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "COMPUTE_F32": False, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32"}, ptrs))
print("RESULTS " + json.dumps(results))
"""

SM90_MAX_SHARED = 227 * 1024  # opt-in dynamic shared memory per block on H100/H200


def run_compiles(tmp_path: Path, jobs: list[dict]) -> list[dict]:
    """Each job in its own subprocess, all at once: a compile is single-threaded Python + LLVM, so on CI's two
    cores two processes take about half the wall time of one. Output goes to files (a full pipe would stall a
    process while the other is being waited on)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = []
    try:
        for i, job in enumerate(jobs):
            env_i = {**env, "TRITON_CACHE_DIR": str(tmp_path / f"triton-cache-{i}")}
            with open(tmp_path / f"out-{i}", "w") as out, open(tmp_path / f"err-{i}", "w") as err:
                procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, json.dumps(job)], env=env_i,
                                              stdout=out, stderr=err, text=True))
        results = []
        for i, proc in enumerate(procs):
            proc.wait(timeout=900)
            assert proc.returncode == 0, (tmp_path / f"err-{i}").read_text()[-6000:]
            text = (tmp_path / f"out-{i}").read_text()
            line = next(ln for ln in text.splitlines() if ln.startswith("RESULTS "))
            results += json.loads(line[len("RESULTS "):])
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# fp16 and bf16 at both head dims; MHA (broadcast path) and GQA 4 / 8 (tl.dot path); fp32 (ieee dots) once.
CONFIGS = [
    {"dtypes": ["fp16"], "head_dims": [64, 128], "groups": [1, 4]},
    {"dtypes": ["bf16"], "head_dims": [64, 128], "groups": [1, 8]},
    {"dtypes": ["fp32"], "head_dims": [64], "groups": [2]},
]


# Three subprocesses for CI's two cores: fp16, bf16, fp32 + the GEMM (measured: ~33, ~33, ~27 s of CPU each plus
# ~6 s of imports; the GEMM's 12 compiles are cheap), each with one dtype's fused-MoE compiles (8, 10, 4 of them,
# ~0.6 s each). One process per dtype keeps each job's code simple.
JOBS = [
    {"configs": [CONFIGS[0]], "quant_dtypes": [], "moe_dtypes": ["fp16"]},
    {"configs": [CONFIGS[1]], "quant_dtypes": [], "moe_dtypes": ["bf16"]},
    {"configs": [CONFIGS[2]], "quant_dtypes": ["fp16", "bf16"], "moe_dtypes": ["fp32"]},
]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_compiles(tmp_path_factory.mktemp("sm90"), JOBS)


def test_every_kernel_compiles_for_sm90(compiled: list[dict]) -> None:
    expected = sum(len(c["dtypes"]) * len(c["head_dims"]) * (2 + 2 * len(c["groups"]) + 1 + 2) for c in CONFIGS)
    expected += sum(3 * len(c["dtypes"]) for c in CONFIGS)  # the soft-capped decode (x2) and prefill kernels
    expected += sum(4 * len(c["dtypes"]) for c in CONFIGS)  # with sinks: decode (x2), stage 2 and prefill
    expected += 2 * 3 * 2  # quant_matmul: 2 dtypes x 3 formats x 2 tile shapes
    expected += 3 * 4 + 2 + 2 * 4  # fused_moe: 3 dtypes x 2 launches x 2 tiles, 2 activations, 2 x 2 formats x 2
    assert len(compiled) == expected
    kinds = {(r["kernel"], r["dtype"], r.get("HEAD_DIM", "")) for r in compiled}
    for dtype in ("fp16", "bf16"):
        for d in ("64", "128"):
            for kernel in ("decode_attention_kernel", "decode_reduce_kernel", "prefill_attention_kernel"):
                assert (kernel, dtype, d) in kinds
        assert ("quant_matmul_kernel", dtype, "") in kinds
    moe = {(r["dtype"], r["BITS"], r["ACT"]) for r in compiled if r["kernel"] == "fused_moe_kernel"}
    assert {(t, "16", act) for t in ("fp16", "bf16", "fp32") for act in ("0", "1")} <= moe
    assert {("bf16", bits, act) for bits in ("8", "4") for act in ("0", "1")} | {("bf16", "16", "2"),
                                                                               ("bf16", "16", "3")} <= moe
    assert {r["dtype"] for r in compiled if r.get("SOFTCAP") == "True"} == {"fp16", "bf16", "fp32"}
    sinks = {(r["kernel"], r["dtype"]) for r in compiled if r.get("HAS_SINKS") == "True"}
    assert sinks == {(k, t) for k in ("decode_attention_kernel", "decode_reduce_kernel", "prefill_attention_kernel")
                     for t in ("fp16", "bf16", "fp32")}
    for r in compiled:
        assert r["cubin_bytes"] > 0, r


def test_shared_memory_fits_sm90(compiled: list[dict]) -> None:
    for r in compiled:
        assert r["shared"] <= SM90_MAX_SHARED, f"needs {r['shared']} B of shared memory: {r}"
