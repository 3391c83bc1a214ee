"""GPU check driver (run through benches/gpu_check.sh, which sets up PYTHONPATH and the model).

1. benches/gpu_kernels.py: every Triton kernel against its torch reference at real sizes, timed with
   triton.testing.do_bench, bandwidth against a measured copy bandwidth (that script's own work).
2. Workload W end to end on the default model: ironlm vs transformers (one at a time on the first 8
   requests, static left-padded batches of 8/16/32/64), same process, same requests.
3. A short table printed last; everything in OUT/gpu_check.json (+ the kernels' own JSON and log).

--dry-run: the same steps on CPU with tiny sizes, so every code path runs; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_kernels(out: Path, dry_run: bool, timeout_s: float) -> dict[str, Any]:
    script = HERE / "gpu_kernels.py"
    if not script.exists():
        return {"status": "missing", "script": str(script)}
    json_path = out / "gpu_kernels.json"
    base = [sys.executable, str(script), *(["--dry-run"] if dry_run else [])]
    result = _stream(base + ["--json", str(json_path)], out / "gpu_kernels.log", timeout_s)
    if result["returncode"] == 2 and "unrecognized arguments" in result["tail"]:
        result = _stream(base, out / "gpu_kernels.log", timeout_s)  # an older interface without --json
    if json_path.exists():
        try:
            result["json"] = json.loads(json_path.read_text())
        except json.JSONDecodeError as exc:
            result["json_error"] = str(exc)
    result["status"] = "ok" if result["returncode"] == 0 else "failed"
    return result


def _stream(cmd: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    """Run cmd, echoing its output live and into log; killed after timeout_s."""
    t0 = time.perf_counter()
    lines: list[str] = []
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
                lines.append(line.rstrip("\n"))
            proc.wait()
        finally:
            timer.cancel()
    elapsed = time.perf_counter() - t0
    return {"cmd": cmd, "returncode": proc.returncode, "elapsed_s": elapsed,
            "timed_out": elapsed >= timeout_s and proc.returncode != 0, "tail": "\n".join(lines[-25:])}


def run_e2e(model: str | None, dry_run: bool, out: Path) -> dict[str, Any]:
    from ironlm.bench import throughput as tp
    from ironlm.bench.datasets import RandomSpec
    from ironlm.bench.report import write_json

    if dry_run:
        config = tp.ThroughputConfig(model=model, random=RandomSpec(4, (8, 32), (4, 8)), baseline="transformers",
                                     baseline_batch_sizes=(2, 4), baseline_single_limit=2, progress=False,
                                     engine_args={"device": "cpu", "kv_cache_memory": "256MiB"})
    else:
        config = tp.ThroughputConfig(model=model, baseline="transformers", baseline_batch_sizes=(8, 16, 32, 64),
                                     baseline_single_limit=8, progress=False)
    t0 = time.perf_counter()
    report = tp.run(config)
    report["wall_s"] = time.perf_counter() - t0
    write_json(out / "e2e_throughput.json", report)
    return report


def kernel_table(kernels: dict[str, Any]) -> str:
    """The kernels' own summary: a 'table' string or 'rows' in their JSON, else the tail of their output."""
    data = kernels.get("json") or {}
    if isinstance(data, dict) and isinstance(data.get("table"), str):
        return data["table"]
    rows = data.get("rows") or data.get("results") if isinstance(data, dict) else None
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        from ironlm.bench.report import format_table

        keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list))))
        return format_table(keys, [[r.get(k, "") for k in keys] for r in rows])
    return "\n".join(kernels.get("tail", "").splitlines()[-12:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: exercises everything but the timing")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out/gpu_check"))
    ap.add_argument("--model", default=os.environ.get("IRONLM_MODEL"), help="default: the built-in model")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--kernels-timeout-s", type=float, default=240.0)
    args = ap.parse_args(argv)

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels on CPU tensors need the interpreter
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    from ironlm.bench.report import machine_info, write_json

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    report: dict[str, Any] = {"bench": "gpu_check", "dry_run": args.dry_run, "machine": machine_info(),
                              "model": args.model or "default"}
    if not args.skip_kernels:
        print("== 1/2 kernels: benches/gpu_kernels.py", flush=True)
        report["kernels"] = run_kernels(out, args.dry_run, args.kernels_timeout_s)
        write_json(out / "gpu_check.json", report)
    if not args.skip_e2e:
        print("== 2/2 end to end: workload W, ironlm vs transformers", flush=True)
        try:
            report["e2e"] = run_e2e(args.model, args.dry_run, out)
        except Exception as exc:  # noqa: BLE001 - the table and JSON must still come out
            import traceback

            traceback.print_exc()
            report["e2e"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    report["wall_s"] = time.perf_counter() - t0
    write_json(out / "gpu_check.json", report)

    from ironlm.bench import throughput as tp

    m = report["machine"]
    print(f"\n===== gpu_check {'(DRY RUN: timings meaningless) ' if args.dry_run else ''}on "
          f"{m.get('gpu', m['device'])}, torch {m['torch']}, {report['wall_s']:.0f} s =====")
    if "kernels" in report:
        k = report["kernels"]
        print(f"-- kernels: {k['status']}" + (f" (rc {k.get('returncode')}, {k.get('elapsed_s', 0):.0f} s)"
                                              if k["status"] != "missing" else ""))
        if k["status"] != "missing":
            print(kernel_table(k))
    if "e2e" in report:
        e = report["e2e"]
        print("-- end to end (W):", "failed: " + e["error"] if e.get("status") == "failed" else "")
        if e.get("status") != "failed":
            print(tp.summary_text(e))
    print(f"full JSON: {out / 'gpu_check.json'}")
    failed = report.get("kernels", {}).get("status") == "failed" or report.get("e2e", {}).get("status") == "failed"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
