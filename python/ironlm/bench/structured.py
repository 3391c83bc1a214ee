"""`ironlm bench throughput --structured json`: W with a JSON schema on every request, against the same work
unconstrained.

Each round runs the constrained pass first, then the unconstrained pass with every request's `max_tokens` set to
what its constrained twin generated (a grammar may end a request early), so both passes compute the same tokens in
the same batches and their step times compare directly. The core computes the masks on a worker thread from
`schedule()` until the sampler joins it after the forward: `mask_wait_s` is the part of `mask_compute_s` the
forward did not hide.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from ironlm.bench.baseline import sync
from ironlm.bench.datasets import Dataset

# Nested objects, an array, an enum, numbers and bounded strings: every step's masks go through llguidance's
# lexer and Earley parser, and outputs rarely end before max_tokens.
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "label": {"type": "string", "maxLength": 24},
                    "score": {"type": "number"},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                },
                "required": ["id", "label", "score", "kind"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}


def _once(llm: Any, ds: Dataset, constrained: bool, lengths: list[int] | None, progress: bool) -> dict[str, Any]:
    from ironlm.sampling_params import SamplingParams
    from ironlm.structured import StructuredOutputsParams

    engine = llm.engine
    engine.scheduler.reset_prefix_cache()
    engine.timer.reset()
    before, masks_before = engine.stats(), engine.scheduler.mask_stats()
    so = StructuredOutputsParams(json=JSON_SCHEMA) if constrained else None
    max_tokens = lengths or [r.output_len for r in ds.requests]
    params = [SamplingParams(max_tokens=max(1, m), ignore_eos=True, temperature=0.0, structured_outputs=so)
              for m in max_tokens]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in ds.requests]
    sync(engine.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    sync(engine.device)
    elapsed = time.perf_counter() - t0
    after, masks_after = engine.stats(), engine.scheduler.mask_stats()
    breakdown = engine.step_breakdown()
    steps = after["num_steps"] - before["num_steps"]
    return {
        "elapsed_s": elapsed,
        "num_steps": steps,
        "step_wall_s": sum(breakdown.values()),
        "step_breakdown_s": breakdown,
        "lengths": [len(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "mask": {k: masks_after[k] - masks_before[k] for k in masks_after},
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
    }


def _validity(run: dict[str, Any]) -> dict[str, Any]:
    """Completed outputs that parse and match the schema (`jsonschema` is a test extra: without it, parse only)."""
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        jsonschema = None
    complete = valid = 0
    for text, why in zip(run["texts"], run["finish_reasons"]):
        if why != "stop":
            continue  # cut by max_tokens: a prefix of valid JSON, not a document
        complete += 1
        try:
            doc = json.loads(text)
            if jsonschema is not None:
                jsonschema.validate(doc, JSON_SCHEMA)
            valid += 1
        except ValueError:
            pass
        except Exception as exc:  # jsonschema.ValidationError, when it is installed
            if jsonschema is None or not isinstance(exc, jsonschema.ValidationError):
                raise
    return {"complete": complete, "valid": valid, "cut_by_max_tokens": len(run["texts"]) - complete,
            "checked_against_schema": jsonschema is not None}


def run_structured(config: Any, llm: Any, ds: Dataset, warm: Dataset | None, machine: dict[str, Any],
                   model: dict[str, Any]) -> dict[str, Any]:
    if config.structured != "json":
        raise ValueError(f"structured must be 'json', got {config.structured!r}")
    if warm is not None:
        _once(llm, warm, True, None, False)
    con_runs: list[dict[str, Any]] = []
    plain_runs: list[dict[str, Any]] = []
    for _ in range(config.repeats):
        con = _once(llm, ds, True, None, config.progress)
        con_runs.append(con)
        plain_runs.append(_once(llm, ds, False, con["lengths"], config.progress))

    def summary(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
        last = runs[-1]
        elapsed = statistics.median(r["elapsed_s"] for r in runs)
        step = statistics.median(r["step_wall_s"] / max(1, r["num_steps"]) for r in runs)
        out_tokens = sum(last["lengths"])
        return {"label": label, "engine": "ironlm", "elapsed_s": elapsed, "samples_s": [r["elapsed_s"] for r in runs],
                "num_steps": last["num_steps"], "step_ms": 1e3 * step, "output_tokens": out_tokens,
                "output_tokens_per_s": out_tokens / elapsed, "num_preemptions": last["num_preemptions"],
                "step_breakdown_s": last["step_breakdown_s"]}

    con_s, plain_s = summary("ironlm json schema", con_runs), summary("ironlm unconstrained", plain_runs)
    mask = con_runs[-1]["mask"]
    compute, wait = mask["compute_s"], mask["wait_s"]
    structured = {
        "schema": JSON_SCHEMA,
        "step_time_ratio": con_s["step_ms"] / plain_s["step_ms"],
        "elapsed_ratio": con_s["elapsed_s"] / plain_s["elapsed_s"],
        "mask_steps": mask["steps"], "mask_rows": mask["rows"],
        "rows_per_mask_step": mask["rows"] / mask["steps"] if mask["steps"] else 0.0,
        "mask_compute_s": compute, "mask_wait_s": wait,
        "mask_compute_ms_per_step": 1e3 * compute / mask["steps"] if mask["steps"] else 0.0,
        "mask_overlap_pct": 100.0 * (1.0 - wait / compute) if compute else 0.0,
        "mask_threads": llm.engine.scheduler.mask_threads,
        "validity": _validity(con_runs[-1]),
        "requests_ended_by_grammar": sum(r == "stop" for r in con_runs[-1]["finish_reasons"]),
    }
    return {
        "bench": "throughput", "config": {"structured": config.structured, "repeats": config.repeats},
        "machine": machine, "model": model, "dataset": ds.summary(),
        "results": [con_s, plain_s], "headline": con_s["label"], "structured": structured,
    }


def summary_text(report: dict[str, Any]) -> str:
    s = report["structured"]
    con, plain = report["results"]
    v = s["validity"]
    lines = [
        (f"dataset: {report['dataset']['name']}  requests: {report['dataset']['num_requests']}  "
        f"model: {report['model']['name']}  (a JSON schema on every request; the unconstrained pass generates "
        "the same token counts)"),
        f"{'':22} {'elapsed s':>10} {'steps':>6} {'ms/step':>8} {'out tok/s':>10}",
    ]
    for r in (con, plain):
        lines.append(f"{r['label']:22} {r['elapsed_s']:10.2f} {r['num_steps']:6d} {r['step_ms']:8.2f} "
                     f"{r['output_tokens_per_s']:10.1f}")
    lines.append(f"step time with masks / unconstrained: {s['step_time_ratio']:.3f}x (elapsed {s['elapsed_ratio']:.3f}x)")
    lines.append(f"masks: {s['mask_rows']} rows over {s['mask_steps']} steps ({s['rows_per_mask_step']:.1f} rows/step), "
                 f"{s['mask_compute_ms_per_step']:.2f} ms/step on {s['mask_threads']} threads; waited "
                 f"{1e3 * s['mask_wait_s']:.1f} ms of {1e3 * s['mask_compute_s']:.1f} ms "
                 f"({s['mask_overlap_pct']:.1f}% hidden behind the forward)")
    lines.append(f"outputs: {v['valid']}/{v['complete']} complete ones valid against the schema; "
                 f"{v['cut_by_max_tokens']} cut by max_tokens")
    return "\n".join(lines)
