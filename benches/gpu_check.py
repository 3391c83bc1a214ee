"""GPU gate (run through benches/gpu_check.sh, which sets up PYTHONPATH, wheels and the model).

Every check compares against something that is right by construction and becomes rows of one table
(benches/gpu_gate.py); any mismatch or error makes the exit status 1:

  parity    greedy tokens against transformers on the same device: fp32 identical to its greedy loop, bf16 every
            token a tie with the fp32 reference's argmax at the same prefix (within TIE_BF16 logits, or 1.5x what
            transformers' own bf16 greedy reaches)
  graphs    the CUDA-graph decode (padded batches 1 -> 1, 3 -> 4, 5 -> 8, 13 -> 16) gives the eager engine's fp32
            tokens; replays counted; decode speed with and without graphs
  quant     whole-model int8 / int4 / fp8: the share of greedy tokens that are the fp32 reference's argmax
  kv_tier   the host tier is pinned, a block round-trip through it is bit-exact, and a run that demotes and
            promotes prefixes gives the tokens of a run that never evicts
  grammar   regex / JSON schema / choice outputs on the device's sampler all conform
  serve     `ironlm serve` as a real process (TP=1), the openai client: completion text = the offline engine's,
            streamed chat, a json_schema response_format that parses
  kernels   benches/gpu_kernels.py (correctness rows gate, timings reported)
  e2e       workload W, ironlm vs transformers (report only; skipped when the budget is short)

--dry-run runs the same checks on the CPU (Triton through its interpreter, the graph path without capture:
engine/cuda_graphs.py), so the script is known to work before device time is spent. Everything lands in
OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_gate import Row, as_json, equal, error, first_difference, judged, skipped, table, ties, verdict

# bf16 tie tolerance in logits: at least this, or 1.5x the largest gap transformers' own bf16 greedy shows
TIE_BF16 = 0.5
# Share of greedy tokens that must be the fp32 reference's argmax. A broken kernel gives ~0; these are far below
# what a correct quantization of a real model reaches, and far above what garbage does.
QUANT_TOP1 = {"int8": 0.8, "fp8": 0.7, "int4": 0.5}
DRY_QUANT_TOP1 = 0.2  # a tiny random model's logits are nearly flat: quantization noise flips many argmaxes
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The quick brown fox",
    "In the beginning of the twentieth century,", "To make a cup of tea, first", "The largest planet in our solar",
    "A haiku about the sea:", "def fibonacci(n):", "The three primary colors are", "Once upon a time, in a land",
    "The speed of light is about", "My favourite book is", "import numpy as np\n", "The opposite of hot is",
    "Photosynthesis is the process", "Dear Sir or Madam,",
]


@dataclass
class Ctx:
    model: str | None
    reference: str | None  # transformers loads this one (default: the model)
    device: str
    dry: bool
    out: Path
    max_new: int
    engine_kw: dict[str, Any] = field(default_factory=dict)
    prompts: list[list[int]] = field(default_factory=list)
    ref: Any = None
    deadline: float = float("inf")  # perf_counter() by which the run should be over (budget + a margin)
    kernels_proc: subprocess.Popen[bytes] | None = None  # gpu_kernels.py, started early on a dry run

    def llm(self, **kw: Any) -> Any:
        from ironlm import LLM

        return LLM(self.model, **{"device": self.device, "seed": 0, **self.engine_kw, **kw})


def close(llm: Any) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(llm: Any, prompts: list[list[int]], max_new: int, **params: Any) -> list[list[int]]:
    from ironlm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class Reference:
    """transformers in fp32 on the check's device: its own greedy loop, and teacher-forced gaps of other tokens."""

    def __init__(self, path: str | None, device: str) -> None:
        import torch

        from ironlm.model import default_model_path

        self.torch = torch
        self.device = torch.device(device)
        self.path = path or default_model_path()
        self.model = self.load(torch.float32)

    def load(self, dtype: Any) -> Any:
        from ironlm.bench.baseline import load_hf_model

        return load_hf_model(self.path, dtype, self.device)

    def greedy(self, prompts: list[list[int]], max_new: int, model: Any = None) -> list[list[int]]:
        torch = self.torch
        model = self.model if model is None else model
        results = []
        with torch.inference_mode():
            for prompt in prompts:
                out = model(torch.tensor([prompt], device=self.device), use_cache=True)
                tokens: list[int] = []
                for _ in range(max_new):
                    tok = int(out.logits[0, -1].argmax())
                    tokens.append(tok)
                    out = model(torch.tensor([[tok]], device=self.device), past_key_values=out.past_key_values,
                                use_cache=True)
                results.append(tokens)
        return results

    def gaps(self, prompt: list[int], tokens: list[int]) -> list[float]:
        """Per step: the reference's max logit minus its logit of `tokens[i]`, given prompt + tokens[:i]."""
        torch = self.torch
        if not tokens:
            return []
        ids = torch.tensor([prompt + tokens[:-1]], device=self.device)
        with torch.inference_mode():
            logits = self.model(ids).logits[0, len(prompt) - 1:].float()
        chosen = logits.gather(1, torch.tensor(tokens, device=self.device)[:, None])[:, 0]
        return (logits.max(dim=1).values - chosen).tolist()

    def all_gaps(self, prompts: list[list[int]], outs: list[list[int]]) -> list[float]:
        return [g for p, o in zip(prompts, outs) for g in self.gaps(p, o)]


def reference(ctx: Ctx) -> Reference:
    if ctx.ref is None:
        ctx.ref = Reference(ctx.reference or ctx.model, ctx.device)
    return ctx.ref


# ---- checks -------------------------------------------------------------------------------------------------
def check_parity(ctx: Ctx) -> Iterator[Row]:
    ref = reference(ctx)
    want = ref.greedy(ctx.prompts, ctx.max_new)
    llm = ctx.llm(dtype="float32", quantization="none")
    got = greedy(llm, ctx.prompts, ctx.max_new)
    close(llm)
    # Where a sequence differs: the step, and how far ironlm's token sits below the reference's argmax there.
    diffs = {}
    for i, (g, w) in enumerate(zip(got, want)):
        at = first_difference(g, w)
        if at is not None:
            diffs[i] = {"step": at, "gap": ref.gaps(ctx.prompts[i], g)[at] if at < len(g) else None}
    yield equal("parity", f"fp32: {len(want)} prompts x {ctx.max_new} tokens vs transformers greedy", got == want,
                True, "identical", first_differences=diffs)
    llm = ctx.llm(dtype="bfloat16", quantization="none")
    got = greedy(llm, ctx.prompts, ctx.max_new)
    close(llm)
    # transformers' own bf16 greedy, judged the same way, says how far bf16 ties reach on this model.
    import torch

    hf_bf16 = ref.load(torch.bfloat16)
    hf = ties(ref.all_gaps(ctx.prompts, ref.greedy(ctx.prompts, ctx.max_new, hf_bf16)), TIE_BF16)
    del hf_bf16
    limit = max(TIE_BF16, 1.5 * hf.max_gap)
    t = ties(ref.all_gaps(ctx.prompts, got), limit)
    same = sum(g == w for g, w in zip(got, want))
    yield judged("parity", "bf16: max gap to the fp32 argmax (teacher-forced)", t.max_gap, limit,
                 top1_rate=t.top1_rate, steps=t.steps, identical_sequences=same, transformers_bf16_gap=hf.max_gap,
                 transformers_bf16_top1=hf.top1_rate)


def check_graphs(ctx: Ctx) -> Iterator[Row]:
    from ironlm.engine.cuda_graphs import DecodeGraphs, capture_sizes

    kw: dict[str, Any] = {"dtype": "float32", "quantization": "none"}
    if ctx.dry:  # the graph path needs the Triton backend: on CPU through the interpreter, capture=False
        kw.update(attention_backend="triton", max_model_len=256)
    eager = ctx.llm(enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    prompts = (ctx.prompts * 2)[:13] if not ctx.dry else ctx.prompts[:5]
    batches = [1, 3, 5, 13] if not ctx.dry else [1, 3, 5]
    want = {b: greedy(eager, prompts[:b], ctx.max_new) for b in batches}
    eager_s = _decode_speed(eager, prompts, ctx) if not ctx.dry else None
    close(eager)
    llm = ctx.llm(**kw)
    runner = llm.engine.runner
    if ctx.dry:
        yield equal("graphs", "cpu engine runs eager (no graphs)", runner.graphs is None, True, "yes")
        runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, sizes=capture_sizes(8),
                                     max_model_len=runner.max_model_len, block_size=ctx.engine_kw["block_size"],
                                     device=runner.device, capture=False)
        runner.graphs.capture_all()
    graphs = runner.graphs
    if graphs is None:
        yield Row("graphs", "captured on this device", "none", "captured", "FAIL")
        close(llm)
        return
    yield Row("graphs", "captured sizes", f"{len(graphs.sizes)} ({graphs.sizes[0]}..{graphs.sizes[-1]})",
              "startup " + f"{runner.startup_timings.get('cuda_graphs', 0.0):.1f} s")
    for b in batches:
        size = graphs.sizes[next(i for i, s in enumerate(graphs.sizes) if s >= b)]
        before = graphs.replays
        got = greedy(llm, prompts[:b], ctx.max_new)
        yield equal("graphs", f"fp32 batch {b} (padded to {size}) = eager", got, want[b],
                    **({} if got == want[b] else {"divergence": divergence(ctx, prompts[:b], got, want[b])}))
        yield judged("graphs", f"batch {b}: decode steps replayed", graphs.replays - before, ctx.max_new - 1,
                     higher_is_better=True, fmt="d")
    if not ctx.dry:
        graph_s = _decode_speed(llm, prompts, ctx)
        yield Row("graphs", "decode tok/s 13 seqs: graphs / eager", f"{graph_s:.0f} / {eager_s:.0f}",
                  f"{graph_s / eager_s:.2f}x" if eager_s else "")
    close(llm)


def divergence(ctx: Ctx, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]) -> dict[int, Any]:
    """Where two greedy runs part, and both tokens' gaps under the fp32 reference there: two gaps near 0 are a
    near-tie that a different reduction order may break either way, a large one a real error."""
    out: dict[int, Any] = {}
    for i, (g, w) in enumerate(zip(got, want)):
        at = first_difference(g, w)
        if at is None or at >= min(len(g), len(w)):
            continue
        ref = reference(ctx)
        out[i] = {"step": at, "gap_got": ref.gaps(prompts[i], g[:at + 1])[at],
                  "gap_want": ref.gaps(prompts[i], w[:at + 1])[at]}
    return out


def _decode_speed(llm: Any, prompts: list[list[int]], ctx: Ctx, new: int = 128) -> float:
    greedy(llm, prompts, 4)  # warm
    t0 = time.perf_counter()
    outs = greedy(llm, prompts, new)
    return sum(len(o) for o in outs) / (time.perf_counter() - t0)


def check_quant(ctx: Ctx) -> Iterator[Row]:
    import torch

    ref = reference(ctx)
    for mode in ("int8", "int4", "fp8"):
        if mode == "fp8" and not (ctx.device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)):
            yield skipped("quant", "fp8", "needs CUDA sm_89+")
            continue
        t0 = time.perf_counter()
        llm = ctx.llm(quantization=mode, dtype="bfloat16" if ctx.device == "cuda" else "float32")
        got = greedy(llm, ctx.prompts, ctx.max_new)
        weight_mb = llm.engine.runner.weight_bytes / 1e6
        close(llm)
        t = ties(ref.all_gaps(ctx.prompts, got), float("inf"))
        row = judged("quant", f"{mode}: greedy tokens = fp32 argmax", t.top1_rate,
                     DRY_QUANT_TOP1 if ctx.dry else QUANT_TOP1[mode], higher_is_better=True, fmt=".2f",
                     max_gap=t.max_gap, weight_mb=weight_mb)
        row.seconds = time.perf_counter() - t0
        yield row


def check_kv_tier(ctx: Ctx) -> Iterator[Row]:
    import numpy as np
    import torch

    kw = {"dtype": "float32", "quantization": "none", "max_num_seqs": 2, "num_kv_blocks": 48,
          "kv_offload_memory": "64MiB", "max_model_len": 512}
    llm = ctx.llm(**kw)
    runner = llm.engine.runner
    tier = runner.tier
    if ctx.device == "cuda":
        yield equal("kv_tier", "host tier is pinned", bool(tier._data.is_pinned()), True, "yes")
    else:
        yield skipped("kv_tier", "host tier is pinned", "cpu: nothing to pin")
    # Round trip: random content into device blocks 0..7, down to slots 0..7, back into blocks 8..15.
    caches = runner.kv_caches
    gen = torch.Generator(device=runner.device).manual_seed(0)
    for k, v in caches:
        for c in (k, v):
            c[:8].copy_(torch.randn(c[:8].shape, generator=gen, device=runner.device, dtype=torch.float32))
    n = 8
    tier.store(caches, np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.int64))
    tier.load(caches, np.stack([np.arange(n), np.arange(n) + n], axis=1).astype(np.int64))
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    exact = all(torch.equal(c[:n], c[n:2 * n]) for kv in caches for c in kv)
    yield equal("kv_tier", f"{n} blocks device -> tier -> device, bit-exact", exact, True, "yes")
    per_block = runner.measure_tier_copy()
    block_bytes = sum(c[0].numel() * c.element_size() for kv in caches for c in kv)
    yield Row("kv_tier", "promotion copy", f"{block_bytes / per_block / 1e9:.2f} GB/s", f"{per_block * 1e6:.0f} us/block")
    # A pool of 48 blocks of 16 for 2 sequences at a time: 6 prefixes of ~120 tokens evict each other, the second
    # round finds them in the tier.
    tok = llm.get_tokenizer()
    prefixes = [tok.encode(" ".join(f"{p} {i}" for i in range(24)))[:120] for p in PROMPTS[:6]]
    prompts = [p + tok.encode(f" Question {j}:")[:6] for j in range(2) for p in prefixes]
    got = greedy(llm, prompts, 16)
    stats = llm.engine.stats()
    close(llm)
    plain = ctx.llm(dtype="float32", quantization="none", max_model_len=512)
    want = greedy(plain, prompts, 16)
    close(plain)
    yield equal("kv_tier", "demote/promote run = never-evicting run", got, want)
    yield judged("kv_tier", "blocks promoted from the tier", stats["kv_promotions"], 1, higher_is_better=True,
                 fmt="d", demotions=stats.get("kv_demotions"))


GRAMMAR_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                   "ok": {"type": "boolean"}},
                  "required": ["color", "ok"], "additionalProperties": False}


def _schema_ok(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(obj, dict) and set(obj) == {"color", "ok"} and obj["color"] in ("red", "green", "blue")
            and isinstance(obj["ok"], bool))


def check_grammar(ctx: Ctx) -> Iterator[Row]:
    import re

    from ironlm import SamplingParams
    from ironlm.structured.params import StructuredOutputsParams

    llm = ctx.llm(dtype="bfloat16" if ctx.device == "cuda" else "float32")
    # The token masks are applied by the engine's sampler, on the logits' device.
    yield equal("grammar", "sampler (masks, draws) on the device", llm.engine.sampler.device.type, ctx.device,
                ctx.device)
    texts = PROMPTS[:6]
    cases: list[tuple[str, StructuredOutputsParams, Callable[[str], bool]]] = [
        ("regex [0-9]{3}-[a-z]{4}", StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{4}"),
         lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{4}", s) is not None),
        ("json schema (enum, boolean)", StructuredOutputsParams(json=GRAMMAR_SCHEMA), _schema_ok),
        ("choice yes/no/maybe", StructuredOutputsParams(choice=["yes", "no", "maybe"]),
         lambda s: s in ("yes", "no", "maybe")),
    ]
    for name, so, valid in cases:
        for temperature in (0.0, 1.0):  # greedy and sampled: the mask holds for both
            sp = SamplingParams(temperature=temperature, max_tokens=48, seed=1, structured_outputs=so)
            outs = llm.generate(texts, sp, use_tqdm=False)
            good = sum(valid(o.outputs[0].text) and o.outputs[0].finish_reason == "stop" for o in outs)
            yield judged("grammar", f"{name}, T={temperature:g}: outputs conforming", good, len(texts),
                         higher_is_better=True, fmt="d", samples=[o.outputs[0].text for o in outs[:2]])
    close(llm)


def check_serve(ctx: Ctx) -> Iterator[Row]:
    import openai

    from ironlm.bench.server_process import ServerProcess

    dtype = "bfloat16" if ctx.device == "cuda" else "float32"
    flags = ["--device", ctx.device, "--dtype", dtype, "--tensor-parallel-size", "1",
             *[x for k, v in ctx.engine_kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    prompt = PROMPTS[0]
    llm = ctx.llm(dtype=dtype)
    offline = llm.generate(prompt, _sp(), use_tqdm=False)[0].outputs[0].text
    close(llm)
    server = ServerProcess(ctx.model, flags)
    t0 = time.perf_counter()
    server.start(timeout_s=300)
    try:
        yield Row("serve", "ironlm serve healthy (real process)", f"{time.perf_counter() - t0:.0f} s to /health")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
        name = client.models.list().data[0].id
        text = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        yield equal("serve", "completion text = offline engine's", text, offline)
        stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say hi."}],
                                                max_tokens=12, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        yield judged("serve", "streamed chat chunks", len(pieces), 2, higher_is_better=True, fmt="d")
        resp = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Pick a color."}], max_tokens=48, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": GRAMMAR_SCHEMA}})
        content = resp.choices[0].message.content or ""
        yield equal("serve", "json_schema response_format parses", _schema_ok(content), True, "yes", content=content)
    finally:
        alive = server.proc is not None and server.proc.poll() is None
        server.stop()
    yield equal("serve", "server alive at the end", alive, True, "yes")


def _sp() -> Any:
    from ironlm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=16)


def start_kernels(ctx: Ctx) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(HERE / "gpu_kernels.py"), "--json", str(ctx.out / "gpu_kernels.json"),
           *(["--dry-run"] if ctx.dry else [])]
    with open(ctx.out / "gpu_kernels.log", "w", encoding="utf-8") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def check_kernels(ctx: Ctx) -> Iterator[Row]:
    json_path = ctx.out / "gpu_kernels.json"
    proc = ctx.kernels_proc or start_kernels(ctx)
    try:
        proc.wait(timeout=max(60.0, min(300.0, ctx.deadline - time.perf_counter())))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not json_path.exists():
        yield Row("kernels", "gpu_kernels.py", f"rc {proc.returncode}, no JSON (see gpu_kernels.log)", "", "ERROR")
        return
    report = json.loads(json_path.read_text())
    for r in report["rows"]:
        value = "; ".join(f"{k} {r[k]:.3g}" for k in ("ms", "GB/s", "%copy", "TFLOP/s") if r.get(k) is not None)
        if "error" in r:
            value = r["error"][:120]
        limit = f"rel_err {r['rel_err']:.2g}" if r.get("rel_err") is not None else ""
        yield Row("kernels", f"{r['kernel']} {r['case']}" + (f" splits={r['splits']}" if "splits" in r else ""),
                  value or "correct", limit, "ok" if r.get("ok") else "FAIL")
    if proc.returncode != 0 and report.get("ok", False):
        yield Row("kernels", "gpu_kernels.py exit status", str(proc.returncode), "0", "FAIL")


def check_e2e(ctx: Ctx) -> Iterator[Row]:
    from ironlm.bench import throughput as tp
    from ironlm.bench.datasets import RandomSpec
    from ironlm.bench.report import write_json

    if ctx.dry:
        config = tp.ThroughputConfig(model=ctx.model, random=RandomSpec(4, (8, 32), (4, 8)), baseline="transformers",
                                     baseline_batch_sizes=(2,), baseline_single_limit=2, progress=False,
                                     engine_args={"device": "cpu", **ctx.engine_kw})
    else:
        config = tp.ThroughputConfig(model=ctx.model, baseline="transformers", baseline_batch_sizes=(16, 64),
                                     baseline_single_limit=4, progress=False, warmup="short")
    report = tp.run(config)
    write_json(ctx.out / "e2e_throughput.json", report)
    first = report["results"][0]
    yield Row("e2e", "W: ironlm output tok/s", f"{first['output_tokens_per_s']:.0f}",
              f"best baseline {report.get('best_baseline')}: {report.get('ratio_vs_best_baseline', 0):.2f}x")


CHECKS: dict[str, Callable[[Ctx], Iterator[Row]]] = {
    "parity": check_parity, "graphs": check_graphs, "quant": check_quant, "kv_tier": check_kv_tier,
    "grammar": check_grammar, "serve": check_serve, "kernels": check_kernels, "e2e": check_e2e,
}


def run_checks(ctx: Ctx, names: list[str], budget_s: float, t_start: float,
               save: Callable[[list[Row]], None] = lambda rows: None) -> list[Row]:
    """Each check's rows in order; `save` after every check, so a run cut short still leaves its rows."""
    rows: list[Row] = []
    for name in names:
        if name == "e2e" and time.perf_counter() - t_start > budget_s - 180:
            rows.append(skipped("e2e", "W throughput", f"budget: {budget_s:.0f} s"))
            continue
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            for row in CHECKS[name](ctx):
                row.seconds = row.seconds if row.seconds is not None else time.perf_counter() - t0
                print(f"   {row.status:5s} {row.case}: {row.value}", flush=True)
                rows.append(row)
                t0 = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others' rows
            import traceback

            traceback.print_exc()
            rows.append(error(name, exc))
        save(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the same checks on CPU (small), before device time")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out/gpu_check"))
    ap.add_argument("--model", default=os.environ.get("IRONLM_MODEL"), help="default: the built-in model")
    ap.add_argument("--reference-model", default=None, help="what transformers loads (default: --model)")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--skip", default="", help="comma-separated checks to leave out")
    ap.add_argument("--budget-s", type=float, default=450.0, help="e2e is skipped past budget - 180 s")
    ap.add_argument("--max-new", type=int, default=None, help="greedy tokens per prompt (32; 8 on a dry run)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n and n not in args.skip.split(",")]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        ap.error(f"unknown checks {unknown}; choose from {','.join(CHECKS)}")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    from ironlm.bench.report import machine_info, write_json

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    ctx = Ctx(model=args.model, reference=args.reference_model, device="cpu" if args.dry_run else "cuda",
              dry=args.dry_run, out=out, max_new=args.max_new or (8 if args.dry_run else 32),
              engine_kw={"block_size": 16, **({"kv_cache_memory": "256MiB", "max_model_len": 512} if args.dry_run
                                              else {"kv_cache_memory": "4GiB", "max_model_len": 2048})})
    from transformers import AutoTokenizer

    from ironlm.model import default_model_path

    tok_path = Path(args.model) if args.model else Path(default_model_path())
    tokenizer = (AutoTokenizer.from_pretrained(tok_path.parent, gguf_file=tok_path.name) if tok_path.suffix == ".gguf"
                 else AutoTokenizer.from_pretrained(tok_path))
    ctx.prompts = [tokenizer.encode(p) for p in (PROMPTS[:4] if args.dry_run else PROMPTS[:8])]
    ctx.deadline = t_start + args.budget_s + 60
    m = machine_info()

    def save(rows: list[Row]) -> None:
        write_json(out / "gpu_check.json", {
            "bench": "gpu_check", "dry_run": args.dry_run, "machine": m, "model": args.model or "default",
            "wall_s": time.perf_counter() - t_start, "rows": as_json(rows), "exit": verdict(rows),
            "table": table(rows)})

    if args.dry_run and "kernels" in names:
        # On the CPU the interpreted kernels are one more single-threaded process: run beside the other checks,
        # they take the second core instead of adding their time at the end. Never on a GPU, where the kernels'
        # timings want the device to themselves.
        ctx.kernels_proc = start_kernels(ctx)
    rows = run_checks(ctx, names, args.budget_s, t_start, save)
    if ctx.kernels_proc is not None and ctx.kernels_proc.poll() is None:  # its check was skipped: not left running
        ctx.kernels_proc.kill()
        ctx.kernels_proc.wait()
    wall = time.perf_counter() - t_start
    save(rows)
    failed = [r for r in rows if not r.passed]
    print(f"\n===== gpu_check {'(DRY RUN on CPU) ' if args.dry_run else ''}on {m.get('gpu', m['device'])}, "
          f"torch {m['torch']}, {wall:.0f} s: {'PASS' if not failed else f'{len(failed)} FAILED'} =====")
    print(table(rows))
    for r in failed:
        print(f"FAILED {r.check} / {r.case}: {json.dumps(r.detail, default=str)[:600]}")
    print(f"full JSON: {out / 'gpu_check.json'}")
    return verdict(rows)


if __name__ == "__main__":
    sys.exit(main())
