"""Fault injection for tests: `IRONLM_FAULT` makes chosen engine steps raise, to prove the error paths.

    IRONLM_FAULT="step:raise:every=3"                    every 3rd step of the engine loop raises
    IRONLM_FAULT="forward:raise:after=2,times=1"         the 3rd model forward raises, once
    IRONLM_FAULT="step:raise:after=4;restart:raise"      rules joined by ';'

A rule is `site:raise[:option=N,...]`. Sites:
- `step`     the engine loop's step as a whole (AsyncLLMEngine), as if the engine's own bookkeeping failed: the
             loop fails its in-flight requests, and enough of these in a row restart the loop;
- `forward`  the model forward inside LLMEngine.step: that step's requests fail, the engine carries on;
- `restart`  the engine loop's restart itself: the engine is then dead (/health 503).
Options: `every` (each N-th call raises, default 1), `after` (the first N calls pass, default 0), `times` (at most
N raises, default unlimited).

Each engine parses the variable once, when it is built; unset, `from_env` returns None and every hook is a single
`is not None` test. A malformed value raises InvalidArgumentError at startup rather than silently injecting nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ironlm.exceptions import InjectedFault, InvalidArgumentError

ENV_VAR = "IRONLM_FAULT"
SITES = ("step", "forward", "restart")
_OPTIONS = ("every", "after", "times")


@dataclass
class FaultRule:
    site: str
    every: int = 1
    after: int = 0
    times: int | None = None
    calls: int = 0
    fired: int = 0

    def hit(self) -> bool:
        self.calls += 1
        if self.calls <= self.after or (self.times is not None and self.fired >= self.times):
            return False
        if (self.calls - self.after) % self.every:
            return False
        self.fired += 1
        return True


class Faults:
    def __init__(self, rules: list[FaultRule]) -> None:
        self.rules = rules

    def check(self, site: str) -> None:
        """Raise InjectedFault if a rule for `site` fires on this call."""
        for rule in self.rules:
            if rule.site == site and rule.hit():
                raise InjectedFault(f"injected fault: {site} call {rule.calls} ({ENV_VAR})")

    def fired(self, site: str) -> int:
        return sum(rule.fired for rule in self.rules if rule.site == site)


def _bad(spec: str, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{ENV_VAR}: {reason} in {spec!r} (expected site:raise[:every=N,after=N,times=N] "
                                f"with site one of {', '.join(SITES)})", param=ENV_VAR)


def parse(value: str) -> Faults:
    rules = []
    for spec in filter(None, (part.strip() for part in value.split(";"))):
        site, _, rest = spec.partition(":")
        action, _, options = rest.partition(":")
        if site not in SITES:
            raise _bad(spec, f"unknown site {site!r}")
        if action != "raise":
            raise _bad(spec, f"unknown action {action!r}")
        rule = FaultRule(site)
        for option in filter(None, options.split(",")):
            key, _, number = option.partition("=")
            if key not in _OPTIONS or not number.isdigit():
                raise _bad(spec, f"bad option {option!r}")
            setattr(rule, key, int(number))
        if rule.every < 1:
            raise _bad(spec, "every must be >= 1")
        rules.append(rule)
    if not rules:
        raise _bad(value, "no rule")
    return Faults(rules)


def from_env(environ: Mapping[str, str] = os.environ) -> Faults | None:
    """The rules in `IRONLM_FAULT`, or None when it is unset or empty (production)."""
    value = environ.get(ENV_VAR, "").strip()
    return parse(value) if value else None
