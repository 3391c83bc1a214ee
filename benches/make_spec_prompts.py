"""Makes the speculative-decoding bench's "copy" prompt set (python/ironlm/bench/spec_copy_prompts.json): passages
of this repository's own source and docs, cut at blank lines into 300-700-token pieces (the default model's
tokenizer), shuffled with a fixed seed, the first --count taken as they come, each framed as "copy this text".

No passage is chosen by how well the model copies it: the set stands for input-grounded answers as they come,
copied in part and paraphrased in part, and the bench reports how much of each answer copies its input. The files
change, so the set is a frozen snapshot: running this again later makes a different one.

    python benches/make_spec_prompts.py [--count 16] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "python/ironlm/bench/spec_copy_prompts.json"
# The instruction both before and after the passage: with it only before, the 135M model describes a long passage
# instead of copying it (a quarter of its answer tokens copied, against half with both, over 60 passages).
FRAME = ("Copy the following text word for word.\n\n{text}\n\n"
         "Now copy the text above word for word, starting from its first line.")


def passages(tokenizer: Any, lo: int, hi: int) -> list[tuple[str, str]]:
    """(file, passage) for every run of blank-line-separated paragraphs reaching `lo` tokens, kept if at most `hi`;
    code fenced with its language."""
    files = sorted(ROOT.glob("python/ironlm/**/*.py")) + sorted(ROOT.glob("rust/src/**/*.rs"))
    files += [ROOT / "README.md", ROOT / "docs/ARCHITECTURE.md"]
    out = []
    for f in files:
        lang = {".py": "python", ".rs": "rust"}.get(f.suffix)
        buf = ""
        for para in f.read_text().split("\n\n"):
            buf += para + "\n\n"
            n = len(tokenizer(buf)["input_ids"])
            if n >= lo:
                if n <= hi:
                    body = buf.strip()
                    out.append((str(f.relative_to(ROOT)), f"```{lang}\n{body}\n```" if lang else body))
                buf = ""
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=700)
    a = ap.parse_args()
    from ironlm.model.default import default_model_path
    from ironlm.model.gguf import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    pool = passages(tokenizer, a.min_tokens, a.max_tokens)
    random.Random(a.seed).shuffle(pool)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    prompts = [{"task": "copy", "source": f"{src}@{commit[:12]}", "text": FRAME.format(text=body)}
               for src, body in pool[:a.count]]
    OUT.write_text(json.dumps(prompts, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(prompts)} of {len(pool)} passages -> {OUT}")


if __name__ == "__main__":
    main()
