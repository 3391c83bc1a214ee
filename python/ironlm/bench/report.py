"""Shared reporting: the machine a figure was measured on, JSON files, matplotlib plots, tables."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat (busy: all but idle and iowait).
    Their difference over a run, less the run's own CPU time, is what other processes took meanwhile."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    return sum(parts) - parts[3] - parts[4], sum(parts)


_TCK = os.sysconf("SC_CLK_TCK")


def proc_ticks() -> dict[int, tuple[str, int, int]]:
    """pid -> (command name, parent pid, user + system ticks) of every process readable now."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[int(entry.name)] = (comm, int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def process_tree(root: int, procs: dict[int, tuple[str, int, int]]) -> set[int]:
    pids, grew = {root}, True
    while grew:
        more = {pid for pid, (_, ppid, _) in procs.items() if ppid in pids} - pids
        pids |= more
        grew = bool(more)
    return pids


class CpuWatch:
    """CPU seconds between start() and stop(): the whole machine's, a server tree's, this client's, the rest."""

    def start(self) -> None:
        self.t0, self.busy0, self.procs0, self.self0 = time.perf_counter(), cpu_jiffies()[0], proc_ticks(), \
            time.process_time()

    def stop(self, server_pid: int) -> dict[str, Any]:
        wall, busy, procs = time.perf_counter() - self.t0, cpu_jiffies()[0] - self.busy0, proc_ticks()
        client = time.process_time() - self.self0
        server = process_tree(server_pid, procs)

        def delta(pid: int) -> int:
            before = self.procs0.get(pid)
            return procs[pid][2] - (before[2] if before and before[0] == procs[pid][0] else 0)

        server_s = sum(delta(p) for p in server) / _TCK
        others = sorted(((delta(p) / _TCK, procs[p][0], p) for p in procs if p not in server and p != os.getpid()),
                        reverse=True)
        busy_s = busy / _TCK
        other_s = max(0.0, busy_s - server_s - client)
        return {"wall_s": wall, "cpus": os.cpu_count(), "machine_busy_cores": busy_s / wall,
                "server_cores": server_s / wall, "client_cores": client / wall, "other_cores": other_s / wall,
                "top_others": [{"pid": p, "comm": c, "cores": s / wall} for s, c, p in others[:3] if s > 0]}


# The /proc/cpuinfo flags that decide which kernels torch and llama.cpp can use.
_SIMD_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "bf16")


def read_bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 3) -> float:
    """The machine's read bandwidth now, GB/s: the best of `repeats` torch sums over an `nbytes` fp32 tensor on
    torch's threads (a decode step reads its weights the same way, once, in order). Taken beside each timed run:
    on a shared VM it drifts by up to 2x within minutes."""
    import time

    import torch

    data = torch.full((nbytes // 4,), 0.5)
    data.sum()  # warm-up, untimed
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def cpu_flags() -> list[str]:
    """The CPU's vector-instruction flags (AVX2, AVX-512 and its VNNI/BF16 parts, AMX...), sorted."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted({x for x in flags if x.startswith(_SIMD_PREFIXES)})
    except OSError:
        pass
    return []


def invocation() -> list[str]:
    """The command line this benchmark was started with, for the report beside a baseline's."""
    import sys

    return [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else []


def machine_info(device: str | None = None) -> dict[str, Any]:
    """CPU model and vector flags, cores, memory, torch/transformers versions and the accelerator, if any."""
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_cores": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device or ("cuda" if torch.cuda.is_available() else "cpu"),
    }
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * page_size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    for mod in ("transformers", "ironlm", "triton"):
        with contextlib.suppress(ImportError, AttributeError):  # optional: absent packages are not reported
            info[mod] = __import__(mod).__version__
    return info


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return obj.item()
    return obj


def write_json(path: str | os.PathLike, data: Mapping[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(data), indent=2) + "\n", encoding="utf-8")
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_bars(path: str | os.PathLike, bars: Sequence[tuple[str, float]], *, title: str, ylabel: str,
              highlight: str | None = None) -> Path:
    """One bar per configuration (e.g. output tokens/s per engine and batch size)."""
    plt = _pyplot()
    labels = [b[0] for b in bars]
    values = [b[1] for b in bars]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(bars) + 2), 4.2))
    colors = ["tab:orange" if highlight and label.startswith(highlight) else "tab:blue" for label in labels]
    rects = ax.bar(range(len(bars)), values, color=colors)
    ax.bar_label(rects, labels=[f"{v:.3g}" for v in values], fontsize=8)
    ax.set_xticks(range(len(bars)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def _save(fig, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    _pyplot().close(fig)
    return out


def plot_cdfs(path: str | os.PathLike, series: Mapping[str, Sequence[float]], *, title: str,
              unit: str = "ms") -> Path:
    """Empirical CDFs, one panel per latency metric (TTFT, TPOT, ITL, E2E)."""
    import numpy as np

    plt = _pyplot()
    names = list(series)
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(3.6 * max(1, len(names)), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        values = np.sort(np.asarray(series[name], dtype=float))
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
            for q, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(values, q), color="gray", linestyle=style, linewidth=0.8,
                           label=f"p{q}")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xlabel(f"{name} ({unit})")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table for the terminal."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
        return str(v)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)
