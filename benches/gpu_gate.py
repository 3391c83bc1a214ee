"""The GPU check's verdict: rows of (check, case, value, limit, ok), one table, and the exit status.

Kept free of torch and ironlm so that the rules a GPU run is judged by are tested on any machine
(tests/test_gpu_check.py): a row that is not ok, or a check that raised, fails the whole run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Row states: "ok" and "skip" pass, "FAIL" (a mismatch) and "ERROR" (the check raised) fail the run.
PASSING = ("ok", "skip")


@dataclass
class Row:
    check: str
    case: str
    value: str = ""
    limit: str = ""
    status: str = "ok"
    seconds: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status in PASSING


def judged(check: str, case: str, value: float, limit: float, *, higher_is_better: bool = False,
           fmt: str = ".3g", **detail: Any) -> Row:
    """A measured value against its bound: value <= limit (or >= with higher_is_better); NaN always fails."""
    ok = not math.isnan(value) and (value >= limit if higher_is_better else value <= limit)
    return Row(check, case, format(value, fmt), (">= " if higher_is_better else "<= ") + format(limit, fmt),
               "ok" if ok else "FAIL", detail=detail)


def equal(check: str, case: str, got: Any, want: Any, what: str = "identical", **detail: Any) -> Row:
    """got == want; `what` names the passing value ("identical", "yes")."""
    same = got == want
    return Row(check, case, what if same else ("no" if what == "yes" else "differs"), what, "ok" if same else "FAIL",
               detail=detail if same else {"got": got, "want": want, **detail})


def error(check: str, exc: BaseException) -> Row:
    return Row(check, "raised", f"{type(exc).__name__}: {exc}"[:160], "no error", "ERROR")


def skipped(check: str, case: str, why: str) -> Row:
    return Row(check, case, why, "", "skip")


@dataclass
class Ties:
    """How a sequence of chosen tokens sits under a reference's logits at the same positions (teacher forcing)."""

    steps: int
    top1: int  # steps whose token is the reference's argmax
    max_gap: float  # largest (reference max logit - reference logit of the chosen token)
    first_off: int | None  # first step whose gap exceeds the tie tolerance (None: all within)

    @property
    def top1_rate(self) -> float:
        return self.top1 / self.steps if self.steps else 1.0


def ties(gaps: Sequence[float], tol: float) -> Ties:
    """`gaps[i]`: the reference's max logit minus its logit of the token chosen at step i. A chosen token ties
    with the reference's argmax when its gap is within `tol`: a lower precision may pick either side of a
    near-tie, never a clearly worse token."""
    first_off = next((i for i, g in enumerate(gaps) if not g <= tol), None)  # NaN is never within
    return Ties(len(gaps), sum(1 for g in gaps if g <= 0.0), max(gaps, default=0.0), first_off)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


COLUMNS = ("check", "case", "value", "limit", "status", "s")


def table(rows: Sequence[Row]) -> str:
    cells = [[r.check, r.case, r.value, r.limit, r.status, "-" if r.seconds is None else f"{r.seconds:.1f}"]
             for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) if cells else len(c) for i, c in enumerate(COLUMNS)]
    out = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join(out)


def verdict(rows: Sequence[Row]) -> int:
    """0 when every row passed (and there is at least one), else 1."""
    return 0 if rows and all(r.passed for r in rows) else 1


def as_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
