"""Where a W step's time goes: per step phase (prefill-carrying vs decode-only steps) and per op class (GEMMs by
projection, attention by kind, norms, activation, RoPE, the rest of the forward, sampling), on the first N requests
of workload W through `LLM.generate`.

    flock /tmp/ironlm-bench.lock .venv/bin/python benches/profile_w.py [HF_DIR] [--requests 24] [--dtype auto]
        [--torch-profile] [--json PATH]

Every timed call is wrapped (perf_counter, the CPU ops are synchronous) with exclusive accounting: a call inside
another (the core's dense kernel inside a linear, the paged kernel inside the attention backend) is subtracted
from its parent, so the classes add up to the forward's wall time. The wrappers cost ~1 us a call (~150 calls a
step), well under 1 % of a step. GEMM classes also report rows and achieved GFLOP/s. `--torch-profile` adds
torch.profiler's top aten ops by self CPU time over the same run (dtype casts, copies and gathers show there).
Prints the CPU model, the threads and the other processes' CPU use during the run (/proc/stat).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ironlm import _core
from ironlm.attention import cpu_backend, torch_backend
from ironlm.bench.datasets import RandomSpec, random_dataset
from ironlm.bench.report import cpu_jiffies, machine_info
from ironlm.model import lean, linear, llama

DEFAULT_HF = "/work/main/.vllm-cpu/hf/SmolLM2-135M-Instruct"


class Ledger:
    """Exclusive time per (phase, op class): a nested call's time is taken out of its parent's."""

    def __init__(self) -> None:
        self.phase = "other"
        self.self_s: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.flops: dict[tuple[str, str], float] = defaultdict(float)
        self.rows: dict[tuple[str, str], int] = defaultdict(int)
        self._stack: list[float] = []  # children's time of each open call

    def wrap(self, fn: Callable, op: str | Callable[..., str], gemm: Callable[..., tuple[int, int, int]] | None = None
             ) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            name = op(*args, **kwargs) if callable(op) else op
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                child = self._stack.pop()
                key = (self.phase, name)
                self.self_s[key] += dt - child
                self.calls[key] += 1
                if gemm is not None:
                    m, k, n = gemm(*args, **kwargs)
                    self.flops[key] += 2.0 * m * k * n
                    self.rows[key] += m
                if self._stack:
                    self._stack[-1] += dt

        return timed


def _install(ledger: Ledger, names: dict[int, str]) -> None:
    """Wrap the forward's op classes in place (module attributes, so every caller sees the wrapped one). The lean
    step runs layer by layer here (lean.FUSE_LAYERS off): the fused stack's ops are one core call, not timed apart."""
    lean.FUSE_LAYERS = False

    def lin_name(lin: Any, *_: Any, **__: Any) -> str:
        return f"gemm.{names.get(id(lin), '?')}"

    def lin_shape(lin: Any, x: torch.Tensor, *_: Any, **__: Any) -> tuple[int, int, int]:
        w = getattr(lin, "weight", None)
        n, k = (w.shape[0], w.shape[1]) if w is not None else (lin.matrix.rows, lin.matrix.cols)
        return x.shape[0], n, k

    # QuantLinear's `into`/`accumulate` of a half-precision model call its `__call__`: the ledger's exclusive
    # accounting keeps that time counted once.
    for cls in (linear.DenseLinear, linear.QuantLinear):
        for meth in ("__call__", "into", "accumulate"):
            setattr(cls, meth, ledger.wrap(getattr(cls, meth), lin_name, lin_shape))
    for fn, op in (("rms_norm", "norm"), ("silu_and_mul", "act"), ("gelu_tanh_and_mul", "act"),
                   ("rope_inplace", "rope"), ("qk_norm_inplace", "rope"), ("dense_matmul", "gemm.core_kernel"),
                   ("paged_decode_attention", "attn.decode_kernel"), ("decode_attention_qkv", "attn.decode_kernel"),
                   ("prefill_attention", "attn.prefill")):
        setattr(_core, fn, ledger.wrap(getattr(_core, fn), op))
    cpu_backend.CpuAttention.forward = ledger.wrap(cpu_backend.CpuAttention.forward, "attn.other")  # type: ignore[method-assign]
    cpu_backend._prefill_one = ledger.wrap(cpu_backend._prefill_one, "attn.prefill")
    torch_backend._prefill_one = cpu_backend._prefill_one
    cpu_backend.write_kv_cache = ledger.wrap(cpu_backend.write_kv_cache, "attn.kv_write")
    lean.lean_forward = ledger.wrap(lean.lean_forward, "lean.other")
    layers_f = llama.DecoderLM.forward

    def forward(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, kv: Any, meta: Any,
                logits_indices: torch.Tensor) -> torch.Tensor:
        qlens = np.diff(meta.query_start_loc_cpu)
        ledger.phase = "prefill" if (qlens > 1).any() else "decode"
        return layers_f(model, input_ids, positions, kv, meta, logits_indices)

    llama.DecoderLM.forward = ledger.wrap(forward, "forward.other")  # type: ignore[method-assign]


class _Switch:
    """Turns the issue-20 paths in `names` off (pack: oneDNN's prepacked f32 / bf16 GEMMs; attn: bf16 prefill attention,
    the fp32 upcast instead; f32rows: f32 calls above CORE_MAX_ROWS rows on the core's packed copy, torch's GEMM
    instead) and back on, between runs of one process. The caller drops the model's fused stack after each `set`
    (its row limit is fixed when it is built)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._onednn = linear.DenseLinear._onednn
        self._prefill = cpu_backend._prefill_one
        self._f32_rows = linear.packed_f32_rows

    def set(self, on: bool) -> None:
        if "f32rows" in self.names:
            linear.packed_f32_rows = self._f32_rows if on else (lambda: linear.CORE_MAX_ROWS)  # type: ignore[assignment]
        if "pack" in self.names:
            linear.DenseLinear._onednn = self._onednn if on else (lambda lin, x: None)  # type: ignore[method-assign]
        if "attn" in self.names:
            one = self._prefill
            cpu_backend._prefill_one = one if on else (lambda *a, half=False, **k: one(*a, **k))


def _names(model: Any) -> dict[int, str]:
    out = {id(model.head): "head"}
    for layer in model.layers:
        for part in ("qkv", "o", "gate_up", "down"):
            out[id(getattr(layer, part))] = part
    return out


def report(ledger: Ledger, breakdown: dict[str, float], elapsed: float) -> dict[str, Any]:
    forward = sum(v for v in ledger.self_s.values())
    rows = []
    for key in sorted(ledger.self_s, key=lambda k: -ledger.self_s[k]):
        s = ledger.self_s[key]
        row = {"phase": key[0], "op": key[1], "s": s, "pct_forward": 100 * s / forward, "calls": ledger.calls[key]}
        if ledger.flops[key]:
            row["gflops"] = ledger.flops[key] / s / 1e9 if s else 0.0
            row["mean_rows"] = ledger.rows[key] / ledger.calls[key]
        rows.append(row)
    print(f"\nwall {elapsed:.2f} s; engine phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()))
    print(f"timed forward (sum of classes) {forward:.2f} s\n")
    print(f"{'phase':8s} {'op':20s} {'s':>8s} {'% fwd':>7s} {'calls':>7s} {'GFLOP/s':>8s} {'rows':>6s}")
    for r in rows:
        print(f"{r['phase']:8s} {r['op']:20s} {r['s']:8.3f} {r['pct_forward']:7.2f} {r['calls']:7d} "
              f"{r.get('gflops', 0):8.0f} {r.get('mean_rows', 0):6.0f}")
    by_op: dict[str, float] = defaultdict(float)
    for r in rows:
        by_op[r["op"].split(".")[0]] += r["s"]
    print("\nby class: " + ", ".join(f"{k} {v:.2f} s ({100 * v / forward:.1f} %)" for k, v in by_op.items()))
    by_phase: dict[str, float] = defaultdict(float)
    for r in rows:
        by_phase[r["phase"]] += r["s"]
    print("by phase: " + ", ".join(f"{k} {v:.2f} s ({100 * v / forward:.1f} %)" for k, v in by_phase.items()))
    return {"rows": rows, "forward_s": forward, "elapsed_s": elapsed, "phases_s": breakdown}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=DEFAULT_HF)
    p.add_argument("--requests", type=int, default=24, help="the first N requests of W (64 requests, seed 0)")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on native-bf16 CPUs, else float32")
    p.add_argument("--torch-profile", action="store_true")
    p.add_argument("--no-wrap", action="store_true", help="time the run only (an A/B probe without wrappers)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="K=V", help="extra LLM(...) argument")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 keeps a loaded machine's "
                   "OpenMP barrier stalls out of the per-op figures")
    p.add_argument("--off", default="", help="comma list of issue-20 paths to turn off for an A/B: pack (oneDNN "
                   "prepacked f32 / bf16 GEMMs), attn (bf16 prefill attention; fp32 upcast instead), f32rows (f32 calls above "
                   "two rows on torch's GEMM, not the core's packed copy)")
    p.add_argument("--output-len", type=int, help="every request's output length (e.g. 1: the prefill alone)")
    p.add_argument("--ab", type=int, metavar="ROUNDS", help="no profile: alternate --off's paths off and on for "
                   "ROUNDS rounds in one process and print each side's median wall time")
    p.add_argument("--json")
    args = p.parse_args()
    off = set(filter(None, args.off.split(",")))
    switch = _Switch(off)
    if not args.ab:
        switch.set(False)
    if args.threads:
        torch.set_num_threads(args.threads)

    from ironlm.llm import LLM
    from ironlm.sampling_params import SamplingParams

    extra = {k: int(v) if v.isdigit() else v for k, v in (a.split("=", 1) for a in args.engine_arg)}
    llm = LLM(args.model, dtype=args.dtype, **extra)
    model = llm.engine.runner.model
    vocab = model.config.vocab_size
    reqs = random_dataset(RandomSpec(), vocab).requests[: args.requests]
    warm = random_dataset(RandomSpec(seed=1), vocab).requests[: args.requests]
    if args.output_len:
        reqs, warm = ([replace(r, output_len=args.output_len) for r in rs] for rs in (reqs, warm))

    def run(rs: list) -> float:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in rs]
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in rs]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(warm)
    llm.engine.scheduler.reset_prefix_cache()
    if args.ab:
        times: dict[bool, list[float]] = {True: [], False: []}
        jiffies, cpu0, t0 = cpu_jiffies()[0], time.process_time(), time.perf_counter()
        for _ in range(args.ab):
            for on in (False, True):
                switch.set(on)
                model._lean_stack = None
                llm.engine.scheduler.reset_prefix_cache()
                times[on].append(run(reqs))
        med = {k: statistics.median(v) for k, v in times.items()}
        wall = time.perf_counter() - t0
        others = ((cpu_jiffies()[0] - jiffies) / 100 - (time.process_time() - cpu0)) / wall
        print(f"cpu: {machine_info().get('cpu_model')}, threads {torch.get_num_threads()}; {len(reqs)} requests, "
              f"{sum(len(r.prompt_token_ids) for r in reqs)} prompt + {sum(r.output_len for r in reqs)} output "
              f"tokens; other processes {max(0.0, others):.2f} cores")
        print(f"A/B {sorted(off)} off {times[False]} on {times[True]}: medians {med[False]:.2f} / {med[True]:.2f} s "
              f"= {med[False] / med[True]:.2f}x")
        return
    ledger = Ledger()
    if not args.no_wrap:
        _install(ledger, _names(model))
    llm.engine.timer.reset()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.torch_profile \
        else nullcontext()
    jiffies, cpu0 = cpu_jiffies()[0], time.process_time()
    with prof:
        elapsed = run(reqs)
    hz = 100
    others = ((cpu_jiffies()[0] - jiffies) / hz - (time.process_time() - cpu0)) / elapsed
    info = machine_info()
    print(f"cpu: {info.get('cpu_model')}, threads {torch.get_num_threads()}, torch {torch.__version__}; "
          f"{len(reqs)} requests, {sum(len(r.prompt_token_ids) for r in reqs)} prompt + "
          f"{sum(r.output_len for r in reqs)} output tokens; other processes {max(0.0, others):.2f} cores")
    out = report(ledger, llm.engine.step_breakdown(), elapsed) if not args.no_wrap else {"elapsed_s": elapsed}
    print(f"elapsed {elapsed:.2f} s")
    if args.torch_profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))  # type: ignore[union-attr]
    if args.json:
        out.update(machine=info, requests=len(reqs), other_cores=others, args=vars(args))
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
