"""Triton paged-attention kernels (and the quantized linears, the fused MoE) at real sizes: correctness, timing.

    python benches/gpu_kernels.py [--json PATH] [--dry-run] [--only cache,decode,prefill,mixed,quant,moe]

On a CUDA machine: bf16, head_dim 128 (Llama-3-8B attention: 32 query heads, 8 KV heads, pages of 16), decode
batches up to 256 and contexts up to 32k, prefill/extend chunks with and without a cached prefix, and a mixed
batch. Every case is checked against ironlm's torch backend (on a random subset of sequences where the full
batch would be slow) and timed with triton.testing.do_bench (median); decode and cache-write times are turned
into achieved bandwidth and compared with a device-to-device copy measured first, prefill times into TFLOP/s.
`quant` times Llama-3-8B's gate|up projection (4096 -> 28672) through the int8 / int4 weight-only Triton GEMM and
fp8 `_scaled_mm` against torch's bf16 matmul, at decode and prefill row counts (weight GB/s and TFLOP/s).
`moe` runs one Qwen3-30B-A3B MoE layer (128 experts, top-8, hidden 2048, expert width 768) through the fused-MoE
kernel, bf16 and int8 experts, checked against and timed beside MoeBlock's per-expert loop on the same weights:
GB/s of the routed experts' weights (each read once), TFLOP/s.

--dry-run runs every case and check at tiny sizes on CPU through the Triton interpreter (no timing), so the
script is known to work before device time is spent. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' @triton.jit decorators run

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from ironlm.attention import AttentionMetadata
from ironlm.attention.torch_backend import TorchAttention, write_kv_cache
from ironlm.attention.triton_backend import TritonAttention
from ironlm.kernels.cache_write import reshape_and_cache
from ironlm.kernels.decode_attention import num_kv_splits, paged_decode_attention
from ironlm.kernels.prefill_attention import paged_prefill_attention
from ironlm.model.linear_gpu import Fp8Linear, TritonQuantLinear, dequantize_rows
from ironlm.model.moe.experts import MoeBlock
from ironlm.model.moe.spec import MoeConfig, RouteSpec

REL_TOL = 2e-2  # max |triton - torch| / max |torch|, bf16 storage


class Paged:
    """One layer's paged caches filled with random "already cached" K/V, shuffled block tables, new rows."""

    def __init__(self, ctx_lens: list[int], q_lens: list[int], *, hq: int, hkv: int, d: int, page: int,
                 dtype: torch.dtype, device: str, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.ctx = np.asarray(ctx_lens, dtype=np.int64)
        self.ql = np.asarray(q_lens, dtype=np.int64)
        seq = self.ctx + self.ql
        nbs = -(-seq // page)
        num_blocks = int(nbs.sum()) + 1
        perm = rng.permutation(num_blocks)
        self.bt = np.zeros((len(seq), int(nbs.max())), dtype=np.int32)
        used = 0
        for i, nb in enumerate(nbs):
            self.bt[i, :nb] = perm[used : used + nb]
            used += int(nb)
        shape = (num_blocks, page, hkv, d)
        self.k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        t = int(self.ql.sum())
        self.q = torch.randn(t, hq, d, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.k = torch.randn(t, hkv, d, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.v = torch.randn(t, hkv, d, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.page, self.device, self.scale = page, device, d**-0.5
        self.meta = AttentionMetadata.from_lengths(context_lens=self.ctx, query_lens=self.ql, block_tables=self.bt,
                                                   block_size=page, device=device)
        self.qsl = np.concatenate([[0], np.cumsum(self.ql)])
        self.ids = {"all": torch.arange(len(seq), dtype=torch.int32, device=device)}

    def kv_bytes(self) -> int:
        """K and V bytes an attention pass must read: every sequence's whole context, once."""
        per_token = self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return int(2 * (self.ctx + self.ql).sum() * per_token)

    def check(self, out: torch.Tensor, subset: np.ndarray) -> dict[str, Any]:
        """Rows of `subset` sequences against the torch backend (sequences are independent of each other)."""
        rows = np.concatenate([np.arange(self.qsl[i], self.qsl[i + 1]) for i in subset])
        meta = AttentionMetadata.from_lengths(context_lens=self.ctx[subset], query_lens=self.ql[subset],
                                              block_tables=self.bt[subset], block_size=self.page,
                                              device=self.device)
        r = torch.from_numpy(rows).to(self.device)
        # Rewrites the subset's new rows into their slots with the same values: the caches are unchanged.
        ref = TorchAttention().forward(self.q[r], self.k[r], self.v[r], self.k_cache, self.v_cache, meta,
                                       self.scale).float()
        err = (out[r].float() - ref).abs().max().item()
        rel = err / max(ref.abs().max().item(), 1e-6)
        return {"checked_seqs": len(subset), "max_abs_err": err, "rel_err": rel, "ok": bool(rel < REL_TOL)}


def subset_of(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(n, size=min(n, k), replace=False))


def bench(fn: Callable[[], Any], dry: bool) -> float | None:
    if dry:
        fn()
        return None
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def copy_bandwidth(device: str, dry: bool) -> float | None:
    """Device-to-device copy GB/s (read + write) of a 1 GiB buffer: the roofline the kernels are held to."""
    if dry:
        return None
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), False)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def run_cache_write(cfg: dict, dry: bool) -> list[dict]:
    rows = []
    for t in cfg["cache_tokens"]:
        p = Paged([0] * t, [1] * t, seed=1, **cfg["model"])
        slots = p.meta.slot_mapping.clone()
        slots[::7] = -1  # padding rows are skipped
        ref_k, ref_v = p.k_cache.clone(), p.v_cache.clone()
        write_kv_cache(p.k, p.v, ref_k, ref_v, slots)
        reshape_and_cache(p.k, p.v, p.k_cache, p.v_cache, slots)
        ok = bool(torch.equal(p.k_cache, ref_k) and torch.equal(p.v_cache, ref_v))
        ms = bench(lambda p=p, slots=slots: reshape_and_cache(p.k, p.v, p.k_cache, p.v_cache, slots), dry)
        moved = 2 * 2 * p.k.numel() * p.k.element_size()  # read k, v + write both
        rows.append({"kernel": "cache_write", "case": f"T={t}", "ms": ms,
                     "GB/s": None if ms is None else moved / (ms * 1e-3) / 1e9, "ok": ok})
    return rows


def run_decode(cfg: dict, dry: bool, sms: int) -> list[dict]:
    rows = []
    for b, ctx in cfg["decode"]:
        rng = np.random.default_rng(b * 7 + ctx)
        # Mixed lengths around the target (75-100%), one sequence at the full context, one of length 1.
        lens = np.maximum(1, (ctx * rng.uniform(0.75, 1.0, b)).astype(int))
        lens[0] = ctx
        if b > 1:
            lens[-1] = 1
        p = Paged(list(lens - 1), [1] * b, seed=b + ctx, **cfg["model"])
        reshape_and_cache(p.k, p.v, p.k_cache, p.v_cache, p.meta.slot_mapping)
        m = p.meta
        for splits in ("auto", 1):
            n = None if splits == "auto" else 1
            out = torch.empty_like(p.q)

            def call(out: torch.Tensor = out, n: int | None = n, p: Paged = p, m: AttentionMetadata = m) -> None:
                paged_decode_attention(p.q, p.k_cache, p.v_cache, out, p.ids["all"], m.query_start_loc, m.seq_lens,
                                       m.block_tables, p.scale, m.max_seq_len, num_splits=n,
                                       block_n=cfg["decode_block_n"], num_sms=sms)

            call()
            row = {"kernel": "decode", "case": f"B={b} ctx<={ctx}",
                   "splits": num_kv_splits(b, p.k_cache.shape[2], m.max_seq_len, cfg["decode_block_n"], sms)
                   if n is None else 1}
            row.update(p.check(out, subset_of(b, cfg["check_seqs"])))
            ms = bench(call, dry)
            row["ms"] = ms
            row["GB/s"] = None if ms is None else p.kv_bytes() / (ms * 1e-3) / 1e9
            rows.append(row)
            if dry and splits == "auto" and row["splits"] == 1:
                # Tiny dry-run contexts never trigger split-K on their own: force it so stage 2 runs too.
                out2 = torch.empty_like(p.q)
                paged_decode_attention(p.q, p.k_cache, p.v_cache, out2, p.ids["all"], m.query_start_loc,
                                       m.seq_lens, m.block_tables, p.scale, m.max_seq_len, num_splits=3,
                                       block_n=cfg["decode_block_n"], num_sms=sms)
                rows.append({"kernel": "decode", "case": f"B={b} ctx<={ctx}", "splits": 3, "ms": None,
                             **p.check(out2, subset_of(b, cfg["check_seqs"]))})
        del p
    return rows


def prefill_flops(p: Paged, hq: int, d: int) -> float:
    # QK^T and PV over the causally visible keys of every query row: 2 matmuls x 2 flops per MAC.
    visible = sum(int(c) * int(n) + int(n) * (int(n) + 1) // 2 for c, n in zip(p.ctx, p.ql))
    return 4.0 * visible * hq * d


def run_prefill(cfg: dict, dry: bool) -> list[dict]:
    rows = []
    hq, d = cfg["model"]["hq"], cfg["model"]["d"]
    for name, ctx, ql in cfg["prefill"]:
        p = Paged(ctx, ql, seed=len(ql) + sum(ql), **cfg["model"])
        reshape_and_cache(p.k, p.v, p.k_cache, p.v_cache, p.meta.slot_mapping)
        m = p.meta
        out = torch.empty_like(p.q)

        def call(out: torch.Tensor = out, p: Paged = p, m: AttentionMetadata = m) -> None:
            paged_prefill_attention(p.q, p.k_cache, p.v_cache, out, p.ids["all"], m.query_start_loc, m.seq_lens,
                                    m.block_tables, p.scale, m.max_query_len, block_m=cfg["prefill_block"],
                                    block_n=cfg["prefill_block"])

        call()
        row = {"kernel": "prefill", "case": name}
        row.update(p.check(out, subset_of(len(ql), cfg["check_seqs"])))
        ms = bench(call, dry)
        row["ms"] = ms
        row["TFLOP/s"] = None if ms is None else prefill_flops(p, hq, d) / (ms * 1e-3) / 1e12
        rows.append(row)
        del p
    return rows


def run_mixed(cfg: dict, dry: bool, sms: int) -> list[dict]:
    """The whole TritonAttention.forward (cache write + decode kernel + prefill kernel) on a mixed batch."""
    rows = []
    for name, ctx, ql in cfg["mixed"]:
        p = Paged(ctx, ql, seed=3, **cfg["model"])
        backend = TritonAttention(decode_block_n=cfg["decode_block_n"], prefill_block_m=cfg["prefill_block"],
                                  prefill_block_n=cfg["prefill_block"], num_sms=sms)

        def call(backend: TritonAttention = backend, p: Paged = p) -> torch.Tensor:
            return backend.forward(p.q, p.k, p.v, p.k_cache, p.v_cache, p.meta, p.scale)

        out = call()
        row = {"kernel": "forward(mixed)", "case": name}
        # Always include the prefill sequences (they're first) plus a sample of the decodes.
        n_pre = int((p.ql > 1).sum())
        subset = np.unique(np.concatenate([np.arange(n_pre), subset_of(len(ql), cfg["check_seqs"])]))
        row.update(p.check(out, subset))
        row["ms"] = bench(call, dry)
        rows.append(row)
        del p
    return rows


def run_quant(cfg: dict, dry: bool) -> list[dict]:
    """One projection through each quantized linear vs torch's bf16 matmul on the same (dequantized) weights."""
    n, k = cfg["quant_shape"]
    dev, dtype = cfg["model"]["device"], cfg["model"]["dtype"]
    gen = torch.Generator(device=dev).manual_seed(5)
    w = torch.randn(n, k, generator=gen, device=dev, dtype=torch.float32) * 0.02
    dense = w.to(dtype)
    lins: dict[str, Any] = {"int8": TritonQuantLinear.from_float(w, 8, 0), "int4 g128": TritonQuantLinear.from_float(
        w, 4, 128)}
    if dev == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        lins["fp8"] = Fp8Linear.from_float(w)
    rows = []
    for m in cfg["quant_rows"]:
        # fp32 activations in the interpreter: it has no bf16 arithmetic
        x = torch.randn(m, k, generator=gen, device=dev, dtype=torch.float32).to(dtype if dev == "cuda" else
                                                                                   torch.float32)
        ms = bench(lambda x=x: torch.mm(x.to(dtype), dense.t()), dry)
        rows.append({"kernel": "linear bf16", "case": f"M={m} {n}x{k}", "ms": ms,
                     "GB/s": None if ms is None else dense.numel() * 2 / (ms * 1e-3) / 1e9,
                     "TFLOP/s": None if ms is None else 2 * m * n * k / (ms * 1e-3) / 1e12, "ok": True})
        for name, lin in lins.items():
            out = lin(x).float()
            ref_w = (dequantize_rows(lin.qweight, lin.scales, lin.bits, lin.group) if isinstance(lin, TritonQuantLinear)
                     else lin.weight.float() * lin.scale[:, None])
            ref = x.float() @ ref_w.t()
            rel = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            ms = bench(lambda lin=lin, x=x: lin(x), dry)
            rows.append({"kernel": f"linear {name}", "case": f"M={m} {n}x{k}", "ms": ms,
                         "GB/s": None if ms is None else lin.nbytes / (ms * 1e-3) / 1e9,
                         "TFLOP/s": None if ms is None else 2 * m * n * k / (ms * 1e-3) / 1e12, "rel_err": rel,
                         "ok": bool(rel < (0.1 if name == "fp8" else REL_TOL))})
    return rows


def run_moe(cfg: dict, dry: bool) -> list[dict]:
    """One MoE layer's routed experts: the fused kernel vs the per-expert loop (the reference), same routing."""
    e, top_k, hidden, inter = cfg["moe_shape"]
    dev = cfg["model"]["device"]
    dtype = cfg["model"]["dtype"] if dev == "cuda" else torch.float32  # the loop's bf16 on CPU is slow, not wrong
    gen = torch.Generator(device=dev).manual_seed(7)
    rows = []
    for fmt in ("dense", "int8"):
        block = MoeBlock(hidden, MoeConfig(RouteSpec(e, top_k), inter, (True,)), dtype, torch.device(dev))
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device=dev) * 0.02)
        block.finish_loading()
        if fmt == "int8":
            block.quantize_(lambda pieces, bias: TritonQuantLinear.from_float(torch.cat([w for _, w in pieces]), 8, 0,
                                                                              bias))
        per_expert = 3 * hidden * inter * (dtype.itemsize if fmt == "dense" else 1)
        for t in cfg["moe_rows"]:
            x = torch.randn(t, hidden, generator=gen, device=dev).to(dtype)
            logits = torch.randn(t, e, generator=gen, device=dev)
            weights, ids = torch.softmax(logits, -1).topk(top_k, -1)

            def call(block: MoeBlock = block, fused: bool = True, x: torch.Tensor = x, w: torch.Tensor = weights,
                     ids: torch.Tensor = ids) -> torch.Tensor:
                block.fused = fused
                return block.run_experts(x, w, ids)

            out, ref = call().float(), call(fused=False).float()
            rel = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            routed = int(torch.unique(ids).numel())
            flops = 2 * t * top_k * 3 * hidden * inter
            for name, fused in (("fused_moe", True), ("moe loop", False)):
                ms = bench(lambda fused=fused, call=call: call(fused=fused), dry)
                rows.append({"kernel": f"{name} {fmt}", "case": f"T={t} E={e} top{top_k} {hidden}x{inter}",
                             "ms": ms, "GB/s": None if ms is None else routed * per_expert / (ms * 1e-3) / 1e9,
                             "TFLOP/s": None if ms is None else flops / (ms * 1e-3) / 1e12,
                             **({"rel_err": rel, "ok": bool(rel < REL_TOL)} if fused else {"ok": True})})
    return rows


def configs(dry: bool) -> dict:
    if dry:
        return {
            "model": {"hq": 4, "hkv": 2, "d": 64, "page": 4, "dtype": torch.bfloat16, "device": "cpu"},
            "cache_tokens": [5],
            "decode": [(3, 9), (2, 40)],
            "prefill": [("fresh 2x9", [0, 0], [9, 1]), ("prefix 13 + chunk 6", [13], [6])],
            "mixed": [("1 chunk + 2 decodes", [0, 7, 3], [6, 1, 1])],
            "decode_block_n": 16, "prefill_block": 16, "check_seqs": 8,
            "quant_shape": (72, 192), "quant_rows": [1, 20],
            "moe_shape": (8, 2, 64, 32), "moe_rows": [1, 9],
        }
    return {
        # Llama-3-8B attention: GQA 4, head_dim 128, bf16, pages of 16.
        "model": {"hq": 32, "hkv": 8, "d": 128, "page": 16, "dtype": torch.bfloat16, "device": "cuda"},
        "cache_tokens": [256, 8192],
        "decode": [(1, 32768), (8, 32768), (32, 8192), (64, 4096), (128, 2048), (256, 512), (256, 2048)],
        "prefill": [
            ("1 x 8192 fresh", [0], [8192]),
            ("8 x 1024 fresh", [0] * 8, [1024] * 8),
            ("extend 2048 after 30720 cached", [30720], [2048]),
            ("16 x 512 after 1536 cached", [1536] * 16, [512] * 16),
            ("lengths 1..2047", [0, 0, 100, 0, 999], [1, 17, 500, 2047, 1]),
        ],
        "mixed": [("chunk 2048 + 255 decodes at ~1k", [0] + [1024] * 255, [2048] + [1] * 255)],
        "decode_block_n": 64, "prefill_block": 64, "check_seqs": 6,
        "quant_shape": (28672, 4096), "quant_rows": [1, 16, 256, 2048],
        # Qwen3-30B-A3B's MoE layer
        "moe_shape": (128, 8, 2048, 768), "moe_rows": [1, 32, 2048],
    }


def format_rows(rows: list[dict]) -> str:
    cols = ["kernel", "case", "splits", "ms", "GB/s", "%copy", "TFLOP/s", "rel_err", "ok"]
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)
    table = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU via the Triton interpreter")
    ap.add_argument("--only", default="cache,decode,prefill,mixed,quant,moe")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    cfg = configs(args.dry_run)
    dev = cfg["model"]["device"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4
    t0 = time.perf_counter()
    copy_gbs = copy_bandwidth(dev, args.dry_run)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if dev == "cuda" else f"cpu (interpreter) {platform.processor()}",
        "torch": torch.__version__, "triton": triton.__version__, "dry_run": args.dry_run, "num_sms": sms,
        "copy_GB/s": copy_gbs, "model": {k: str(v) for k, v in cfg["model"].items()}, "rows": [],
    }
    print(f"gpu_kernels: {report['device']}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy bandwidth {copy_gbs and round(copy_gbs)} GB/s", flush=True)
    steps = {"cache": lambda: run_cache_write(cfg, args.dry_run), "decode": lambda: run_decode(cfg, args.dry_run, sms),
             "prefill": lambda: run_prefill(cfg, args.dry_run), "mixed": lambda: run_mixed(cfg, args.dry_run, sms),
             "quant": lambda: run_quant(cfg, args.dry_run), "moe": lambda: run_moe(cfg, args.dry_run)}
    for name in args.only.split(","):
        try:
            new = steps[name]()
        except Exception as exc:  # noqa: BLE001 - keep going: one broken kernel shouldn't hide the others' numbers
            new = [{"kernel": name, "case": "error", "ok": False, "error": f"{type(exc).__name__}: {exc}"}]
        for r in new:
            if copy_gbs and r.get("GB/s"):
                r["%copy"] = 100.0 * r["GB/s"] / copy_gbs
            print(json.dumps(r), flush=True)
        report["rows"] += new
        if dev == "cuda":
            torch.cuda.empty_cache()
    report["elapsed_s"] = time.perf_counter() - t0
    report["ok"] = all(r.get("ok", False) for r in report["rows"])
    report["table"] = format_rows(report["rows"])
    print(report["table"])
    print(f"gpu_kernels: {'all checks passed' if report['ok'] else 'SOME CHECKS FAILED'} "
          f"in {report['elapsed_s']:.0f} s", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
