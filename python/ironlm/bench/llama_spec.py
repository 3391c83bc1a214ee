"""llama.cpp's own speculative modes on the spec benchmark's prompts: `llama-lookup` (prompt lookup, n-gram) and
`llama-speculative` (a draft model), one process per prompt, greedy, the same thread count; their "decoded N tokens
in S seconds" and "accept = X%" lines are the figures (built by `make llama-cpp`, benches/build_llama_cpp.sh).

llama.cpp's plain decode on the same prompts is `llama-lookup` drafting nothing (`k` = 0): its loop then decodes
one token per step with the same prompt handling, sampler and timer as the lookup run, where llama-cli (not built)
would add its chat loop and llama-server its HTTP slot machinery; the per-token n-gram cache update it keeps doing
is a few hash inserts.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from ironlm.bench.llama_cpp import find_binary

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")


def run_one(binary: str, gguf: Path, prompt: str, max_tokens: int, k: int, threads: int,
            draft_gguf: Path | None = None, timeout: float = 900.0) -> dict[str, float]:
    """One prompt through `binary` (llama-lookup or llama-speculative; llama-lookup with `k` 0: plain decode):
    decoded tokens, seconds, drafted, accepted."""
    cmd = [str(find_binary(binary)), "-m", str(gguf), "-p", prompt, "-n", str(max_tokens), "--spec-draft-n-max", str(k),
           "-t", str(threads), "--temp", "0", "-c", "4096"]
    if draft_gguf is not None:
        cmd += ["-md", str(draft_gguf), "-td", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    text = out.stdout + out.stderr
    dec, acc, drafted = _DECODED.findall(text), _ACCEPT.findall(text), _DRAFTED.findall(text)
    if out.returncode != 0 or not dec:
        raise RuntimeError(f"{binary} failed (rc {out.returncode}): {text[-2000:]}")
    tokens, secs = dec[-1]
    return {"tokens": int(tokens), "seconds": float(secs), "drafted": int(drafted[-1]) if drafted else 0,
            "accepted": int(acc[-1]) if acc else 0}


def summarize(runs: list[dict[str, float]], binary: str) -> dict[str, Any]:
    """`run_one` results: decode tok/s over all of them and the acceptance."""
    tokens, secs = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    return {"binary": binary, "decode_tok_s": tokens / secs if secs else 0.0, "decode_tokens": tokens,
            "drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0}
