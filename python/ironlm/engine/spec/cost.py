"""The speculation cost model: each step's proposal budget from measured step costs and the acceptance so far.

A proposal row pays off only while the forward is memory-bound: on a CPU a step of 1 and of 8 rows cost about
one weight pass, but past a knee every row costs its own compute and a rejected proposal costs as much as a
useful row. Where the knee lies depends on the machine, the model, the batch and which code path a step takes
(a decode-only batch may run the lean CPU step while a verification runs another), so nothing here is assumed:
`StepCosts` learns t(rows), the wall time of a step of that many query rows, from the steps the engine runs, one
curve for each kind of step: with or without proposals, with or without prefill rows (a decode-only batch may
take a faster path than one with a prefill chunk at the same row count; mixing them would make a plain decode
step look as slow as a prefill step, and speculation look cheap). `SpecBudget.choose` then picks the proposal
budget P that maximises rows of work per second, (n + a P) / t_spec(n + P) against n / t_plain(n) for n base
rows (decode + prefill) and a accepted tokens per proposed one; 0 pauses speculation for the step (vLLM's
dynamic speculation and SmartSpec make the same goodput comparison). Prefill rows count as work like decode
rows: the plain server needs them as much, so a step a prefill chunk already made compute-bound does not look
cheap to speculate in. A step is capped at the token budget: where base rows + proposals would pass it, the
proposals take the place of prompt rows (the core plans them first), so the step does min(rows, budget - P) base
rows: a step the budget already fills only trades sure prompt rows for proposals that may be rejected.

Cold start and drift: with nothing measured near the rows asked the step speculates with one sequence's
proposals, to measure; a curve with no point near the rows asked borrows the other curve's (both measure steps of
that many rows); a point not refreshed for `probe_every` steps (the kind of step the decision avoids) is
measured again by one probe step, a small one: k proposals when paused, none when speculating.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Samples a bucket takes as a median before its EMA starts: a cold first step (allocation, a cache miss) does
# not become the estimate.
_WARM = 5


@dataclass
class _Bucket:
    rows: float
    seconds: float
    count: int = 0
    last: int = 0  # the observation counter when it was last updated
    first: list[tuple[float, float]] = field(default_factory=list)


class StepCosts:
    """Online t(rows) of one kind of step: per power-of-two bucket of rows, the mean rows and seconds of its
    steps (the median of the first `_WARM`, then an EMA with each sample clamped to [1/2, 2] x the estimate, so
    one stalled step moves it a bounded amount and a real change still wins in a few dozen steps); piecewise
    linear between buckets, the last segment's slope above them. A fixed `table` of (rows, seconds) is used as
    given and learns nothing."""

    def __init__(self, alpha: float = 0.1, table: Sequence[tuple[int, float]] | None = None,
                 renew_after: int = 64) -> None:
        self.alpha = alpha
        # A bucket no step refreshed for this many observations takes its next sample as the estimate: the
        # budget a choice avoids is measured only by an occasional probe, and at one clamped EMA step a probe an
        # estimate a stall inflated took dozens of probes (thousands of steps) to come down. Were the sample an
        # outlier, either the choice avoids the bucket as before or runs it and the EMA corrects it step by step.
        self.renew_after = renew_after
        self.frozen = table is not None
        self.buckets: dict[int, _Bucket] = {}
        self.clock = 0
        self._points = sorted((float(r), float(s)) for r, s in table or ())

    @staticmethod
    def _key(rows: float) -> int:
        return max(0, int(rows).bit_length() - 1)

    def _sort(self) -> None:
        # A bucket counts from its third step on: one step of a loaded machine must not decide for 64.
        self._points = sorted((b.rows, b.seconds) for b in self.buckets.values() if b.count >= 3)

    def observe(self, rows: int, seconds: float, clock: int | None = None) -> None:
        if self.frozen or rows < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        self.clock = self.clock + 1 if clock is None else clock
        b = self.buckets.setdefault(self._key(rows), _Bucket(float(rows), seconds))
        renew = b.count > _WARM and self.clock - b.last > self.renew_after
        b.count += 1
        b.last = self.clock
        if renew:
            b.rows, b.seconds = float(rows), seconds
        elif b.count <= _WARM:
            b.first.append((float(rows), seconds))
            b.rows = sorted(r for r, _ in b.first)[len(b.first) // 2]
            b.seconds = sorted(s for _, s in b.first)[len(b.first) // 2]
            if b.count == _WARM:
                b.first = []
        else:
            s = min(max(seconds, b.seconds / 2), b.seconds * 2)
            b.rows += self.alpha * (rows - b.rows)
            b.seconds += self.alpha * (s - b.seconds)
        self._sort()

    def estimate(self, rows: float) -> float | None:
        """Seconds of a step of `rows` rows; None where nothing measured reaches it (below the first bucket, or
        above the only one)."""
        pts = self._points
        if not pts or self._key(rows) < self._key(pts[0][0]):
            return None
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, s0), (r1, s1) in itertools.pairwise(pts):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0) if r1 > r0 else s1
        if len(pts) == 1:
            return pts[0][1] if self._key(rows) == self._key(pts[0][0]) else None
        (r0, s0), (r1, s1) = pts[-2], pts[-1]
        slope = max(0.0, (s1 - s0) / (r1 - r0)) if r1 > r0 else 0.0
        return s1 + slope * (rows - r1)

    def stale(self, rows: float, now: int, after: int) -> bool:
        """No step of about `rows` rows was measured in the last `after` observations (or never)."""
        if self.frozen:
            return False
        b = self.buckets.get(self._key(rows))
        return b is None or now - b.last > after


class Acceptance:
    """Accepted tokens per proposed token, over recent verifications (decayed sums with a one-token prior
    at 1/2, so a cold start neither trusts nor dismisses speculation)."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.accepted = 0.0
        self.proposed = 0.0

    def record(self, proposed: int, accepted: int) -> None:
        if proposed > 0:
            self.accepted = self.accepted * self.decay + accepted
            self.proposed = self.proposed * self.decay + proposed

    @property
    def rate(self) -> float:
        return (self.accepted + 0.5) / (self.proposed + 1.0)


class SpecBudget:
    """Chooses each step's proposal budget; the engine feeds it every step's rows, proposals and wall time."""

    def __init__(self, k: int, cap: int | None = None, table: Sequence[tuple[int, float]] | None = None,
                 margin: float = 0.02, probe_every: int = 64, token_budget: int | None = None) -> None:
        self.k, self.cap, self.margin, self.probe_every = k, cap, margin, probe_every
        self.token_budget = token_budget  # the step's most rows (max_num_batched_tokens); None: no limit
        # Decode-only steps without / with proposals, then the same with prefill rows in the step.
        self.plain, self.spec, self.plain_prefill, self.spec_prefill = (
            StepCosts(table=table, renew_after=probe_every) for _ in range(4))
        self.acceptance = Acceptance()
        self.steps = 0  # observations
        self.budget: int | None = None  # the last choice (None: none made yet)
        self.paused_steps = 0  # steps with decodes the model chose not to speculate in
        self.probes = 0
        self.last_probe = 0

    def _cost(self, curve: StepCosts, other: StepCosts, rows: float) -> float | None:
        t = curve.estimate(rows)
        return other.estimate(rows) if t is None else t

    def _curves(self, prefill: bool) -> tuple[StepCosts, StepCosts]:
        return (self.plain_prefill, self.spec_prefill) if prefill else (self.plain, self.spec)

    def gain(self, rows: int, p: int, prefill: bool = False) -> float | None:
        """Rows of work per second with a budget of `p` proposals over `rows` base rows, relative to none; None
        where neither curve has measured anything that large."""
        plain, spec = self._curves(prefill)
        top = self.token_budget
        if top is not None:
            rows = min(rows, top)
            p = min(p, top - 1)
        done = rows if top is None else min(rows, top - p)  # base rows the speculative step still does
        base = self._cost(plain, spec, rows)
        t = self._cost(spec, plain, rows + p if top is None else min(rows + p, top))
        if base is None or t is None or t <= 0:
            return None
        return (done + self.acceptance.rate * p) / t * base / rows

    def choose(self, decode: int, rows: int) -> int:
        """The budget for a step expected to hold `decode` decoding sequences in `rows` base rows (more than
        `decode`: prefill rows too)."""
        rows = max(rows, decode)
        prefill = rows > decode
        most = decode * self.k
        if self.cap is not None:
            most = min(most, self.cap - decode)
        if decode <= 0 or most <= 0:
            self.budget = 0
            return 0
        grid = sorted({most, min(self.k, most), *(1 << i for i in range(most.bit_length()) if 1 << i < most)})
        gains = [(g, p) for p in grid if (g := self.gain(rows, p, prefill)) is not None]
        if not gains:
            # Nothing measured near these rows: measure with one sequence's proposals. A full budget here (64
            # sequences x k rows, where every row is compute) cost several plain steps per cold step, and a bucket
            # needs three steps before it counts; from a measured point the grid grows the budget step by step.
            best = min(self.k, most)
        else:
            g, p = max(gains)
            best = p if g > 1.0 + self.margin else 0
        # The kinds of step the decision avoids are measured again now and then, each with a cheap step: paused,
        # one sequence's proposals; speculating, a plain step and the next larger budget (one slow step inflates
        # the estimate of the budget it ran, and without a probe the choice never ran that budget again: a draft
        # model speculating 2 of its 4 tokens for 60 steps after a stall was seen).
        plain, spec = self._curves(prefill)
        if best == 0:
            probes = [(spec, rows + min(self.k, most), min(self.k, most))]
        else:
            probes = [(plain, rows, 0)] + [(spec, rows + p, p) for p in grid if p > best][:1]
        due = self.steps - self.last_probe >= self.probe_every
        stale = [p for curve, at, p in probes if due and curve.stale(at, self.steps, self.probe_every)]
        if stale:
            self.last_probe = self.steps
            self.probes += 1
            best = stale[0]
        elif best == 0:
            self.paused_steps += 1
        self.budget = best
        return best

    def observe(self, rows: int, proposed: int, accepted: int, seconds: float, prefill: bool = False) -> None:
        """One step ran: `rows` query rows in all, `proposed` of them proposals of which `accepted` were right,
        `prefill`: some of them prompt rows."""
        self.steps += 1
        plain, spec = self._curves(prefill)
        (spec if proposed else plain).observe(rows, seconds, self.steps)
        self.acceptance.record(proposed, accepted)
