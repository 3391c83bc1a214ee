"""`ironlm bench scheduler`: runs `ironlm.bench.scheduler.run` and adds the config, machine, table and plot.

The comparison itself (Rust core vs a Python reference scheduler) lives in `ironlm.bench.scheduler`; this file
only reports it, reading its result generically: rows of numbers keyed by `num_seqs`.
"""

from __future__ import annotations

import json
from typing import Any

from ironlm.bench.report import format_table, machine_info


def run(num_seqs_list: tuple[int, ...] = (64, 256, 1024), steps: int | None = None,
        quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """One `scheduler.run` per size (a progress bar over sizes), merged into one result."""
    from tqdm.auto import tqdm

    from ironlm.bench import scheduler

    kwargs: dict[str, Any] = {"quick": quick}
    if steps is not None:
        kwargs["steps"] = steps
    result: dict[str, Any] = {}
    for n in tqdm(list(num_seqs_list), desc="scheduler bench", unit="size", disable=not progress):
        part = scheduler.run(num_seqs_list=(n,), **kwargs)
        merged = result.get("results", []) + part.get("results", [])
        result = {**part, "results": merged}
    config = {"num_seqs_list": list(num_seqs_list), **kwargs}
    return {"bench": "scheduler", "config": config, "machine": machine_info("cpu"), "result": result}


def rows(result: Any) -> list[dict[str, Any]]:
    """The per-size rows of a scheduler result: a list of dicts, or a dict of them keyed by size."""
    if isinstance(result, dict):
        for key in ("results", "rows", "sizes"):
            if key in result:
                return rows(result[key])
        if result and all(isinstance(v, dict) for v in result.values()):
            return [{"num_seqs": k, **v} for k, v in result.items()]
        return []
    if isinstance(result, list):
        return [r for r in result if isinstance(r, dict)]
    return []


def _numeric(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "num_seqs"}


def summary_text(report: dict[str, Any]) -> str:
    table = rows(report["result"])
    if not table:
        return json.dumps(report["result"], indent=2, default=str)
    keys = list(dict.fromkeys(k for r in table for k in _numeric(r)))
    body = [[r.get("num_seqs", "")] + [_numeric(r).get(k, "") for k in keys] for r in table]
    return format_table(["num_seqs", *keys], body)


def plot(report: dict[str, Any], path: str) -> None:
    """Grouped bars per size of every timing field (names ending in _us/_ms/_s or holding 'time')."""
    from ironlm.bench.report import _pyplot

    table = rows(report["result"])
    keys = [k for k in dict.fromkeys(k for r in table for k in _numeric(r))
            if k.endswith(("_us", "_ms", "_s", "_ns")) or "time" in k]
    if {"rust_us", "python_us"} <= set(keys):  # wall time per step; the other fields are its parts
        keys = ["rust_us", "python_us"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        xs = [j + i * width for j in range(len(table))]
        ax.bar(xs, [_numeric(r).get(key, 0.0) for r in table], width, label=key)
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(table))],
                  [str(r.get("num_seqs", j)) for j, r in enumerate(table)])
    ax.set_xlabel("sequences")
    ax.set_ylabel("per step (" + (keys[0].rsplit("_", 1)[-1] if keys else "") + ", log scale)")
    ax.set_yscale("log")
    ax.set_title("scheduler step cost: Rust core vs Python reference", fontsize=10)
    if keys:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
