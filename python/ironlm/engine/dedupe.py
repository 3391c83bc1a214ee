"""Request dedupe: identical deterministic requests share one engine sequence, and a result cache answers repeats.

Two requests with the same model, prompt, sampling parameters and request options, sampled greedily or with the
same explicit seed, produce the same tokens; computing them twice wastes the batch. AsyncLLMEngine therefore
hands a request whose key matches a running one to that sequence as a *listener*: the engine's cumulative outputs
are copied to every listener under the listener's own request id (and its own arrival time), so each client sees
a complete stream of its own. A listener that leaves (abort, disconnect, timeout) only leaves its group; the
sequence is aborted once nobody listens any more. The first request's id is the engine's id for the sequence,
also after that request left.

With a result cache (`result_cache_size` > 0), a finished group's final output is kept (LRU), and a later
request with the same content key is answered from it without reaching the engine at all.

Everything here runs on the engine thread (the async engine's loop), so nothing is locked.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ironlm.engine.outputs import RequestMetrics, RequestOutput
from ironlm.exceptions import InvalidArgumentError
from ironlm.sampling_params import SamplingParams

# Request options that change when a request is served but never what it generates: a cached result answers a
# request whatever its values, while sharing a *running* sequence needs them equal (the sequence is scheduled with
# the first request's priority, deadline and queue timeout). `arrival_time` differs for every request.
_SCHEDULING_OPTIONS = frozenset({"priority", "deadline", "timeout"})
_NOT_KEYED = frozenset({"arrival_time"})
# Only complete results are worth replaying: an abort, a timeout or an error says nothing about the next request.
_CACHEABLE_FINISH = frozenset({"stop", "length"})


def _freeze(value: Any) -> Hashable:
    """A hashable, order-stable form of a prompt or parameter value; unknown objects key by repr (never
    equal across two objects without their own __repr__, which errs on the side of not sharing)."""
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    if isinstance(value, np.ndarray):
        return ("ndarray", tuple(value.tolist()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((repr(k), _freeze(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(v) for v in value)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple((f.name, _freeze(getattr(value, f.name)))
                                            for f in dataclasses.fields(value)))
    return ("repr", type(value).__name__, repr(value))


def is_deterministic(params: SamplingParams | None) -> bool:
    """Greedy, or seeded: the same request gives the same tokens (None means the default, random sampling)."""
    return params is not None and (params.greedy or params.seed is not None)


@dataclass(frozen=True)
class RequestKey:
    content: Hashable  # what the output depends on: the result cache's key
    scheduling: Hashable  # plus how the sequence is scheduled: sharing a running sequence needs both equal


def request_key(model: str, prompt: Any, params: SamplingParams | None,
                options: dict[str, Any]) -> RequestKey | None:
    """The dedupe key of a request, or None when it must not be shared (random sampling without a seed).

    Every SamplingParams field is part of it, so a field added later is keyed without an edit here; so is every
    request option except the arrival time (cache salt / tenant isolate the cache like the prefix cache)."""
    if not is_deterministic(params):
        return None
    assert params is not None
    sampling = tuple((f.name, _freeze(getattr(params, f.name))) for f in dataclasses.fields(params))
    keyed = {k: v for k, v in options.items() if k not in _NOT_KEYED}
    content_opts = tuple(sorted((k, _freeze(v)) for k, v in keyed.items()
                                if k not in _SCHEDULING_OPTIONS and v is not None))
    sched_opts = tuple(sorted((k, _freeze(v)) for k, v in keyed.items() if k in _SCHEDULING_OPTIONS))
    content = (model, _freeze(prompt), sampling, content_opts)
    return RequestKey(content, (content, sched_opts))


@dataclass
class _Listener:
    request_id: str
    arrival_time: float


@dataclass
class _Group:
    engine_id: str
    key: RequestKey
    listeners: dict[str, _Listener] = field(default_factory=dict)
    last: RequestOutput | None = None


def relabel(output: RequestOutput, listener: _Listener, now: float | None = None) -> RequestOutput:
    """`output` as listener's own: its request id, and timings counted from its own arrival (never before it).

    `now` (a result-cache answer) stamps every timing: the tokens reach this request at that moment."""
    m, arrival = output.metrics, listener.arrival_time

    def since_arrival(t: float | None) -> float | None:
        return None if t is None else max(t, arrival)

    if now is not None:
        metrics = RequestMetrics(arrival, now, now, now, now if output.finished else None)
    else:
        metrics = RequestMetrics(arrival, since_arrival(m.first_scheduled_time), since_arrival(m.first_token_time),
                                 since_arrival(m.last_token_time), since_arrival(m.finished_time))
    return dataclasses.replace(output, request_id=listener.request_id, metrics=metrics, extra=dict(output.extra))


class ResultCache:
    """LRU of finished deterministic results by content key (engine thread only)."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise InvalidArgumentError(f"result_cache_size must be an integer >= 0, got {capacity!r}",
                                       param="result_cache_size")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, RequestOutput] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> RequestOutput | None:
        if not self.capacity:
            return None
        output = self._entries.get(key)
        if output is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return output

    def put(self, key: Hashable, output: RequestOutput) -> None:
        if not self.capacity or output.error or not output.finished:
            return
        if not all(c.finish_reason in _CACHEABLE_FINISH for c in output.outputs):
            return
        self._entries[key] = output
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.evictions += 1


class Deduper:
    """The engine thread's table of shared sequences (groups of listeners) and the result cache."""

    def __init__(self, *, share_inflight: bool = True, result_cache_size: int = 0) -> None:
        self.share_inflight = share_inflight
        self.cache = ResultCache(result_cache_size)
        self._groups: dict[str, _Group] = {}  # engine request id -> its group
        self._by_key: dict[Hashable, str] = {}  # scheduling key -> engine request id of the running sequence
        self._member_of: dict[str, str] = {}  # listener request id -> engine request id
        self.dedupe_hits = 0

    @property
    def enabled(self) -> bool:
        return self.share_inflight or self.cache.capacity > 0

    def stats(self) -> dict[str, int]:
        return {"dedupe_hits_total": self.dedupe_hits, "dedupe_groups": len(self._groups),
                "result_cache_hits_total": self.cache.hits, "result_cache_misses_total": self.cache.misses,
                "result_cache_evictions_total": self.cache.evictions, "result_cache_size": len(self.cache)}

    # ---- a new request (engine thread, before it would be added to the engine) -------------------------
    def cached(self, key: RequestKey | None, request_id: str, arrival_time: float,
               now: float) -> RequestOutput | None:
        """The cached final output for this request (relabelled as its own), or None."""
        if key is None:
            return None
        output = self.cache.get(key.content)
        return None if output is None else relabel(output, _Listener(request_id, arrival_time), now)

    def join(self, key: RequestKey | None, request_id: str, arrival_time: float) -> tuple[bool, RequestOutput | None]:
        """Attach the request to a running sequence with the same key: (joined, the sequence's latest output as
        this request's, to send at once, or None before the sequence produced anything)."""
        if key is None or not self.share_inflight:
            return False, None
        engine_id = self._by_key.get(key.scheduling)
        if engine_id is None or request_id in self._member_of:
            return False, None
        group = self._groups[engine_id]
        listener = _Listener(request_id, arrival_time)
        group.listeners[request_id] = listener
        self._member_of[request_id] = engine_id
        self.dedupe_hits += 1
        return True, None if group.last is None else relabel(group.last, listener)

    def lead(self, key: RequestKey | None, request_id: str, arrival_time: float) -> None:
        """The request went to the engine: later identical ones may join it (and its result may be cached)."""
        if key is None:
            return
        group = _Group(request_id, key, {request_id: _Listener(request_id, arrival_time)})
        self._groups[request_id] = group
        self._member_of[request_id] = request_id
        if self.share_inflight:
            self._by_key.setdefault(key.scheduling, request_id)

    # ---- the engine's outputs ----------------------------------------------------------------------
    def fan_out(self, output: RequestOutput) -> list[RequestOutput]:
        """One engine output as each listener's output; a finished one ends the group (and may be cached)."""
        group = self._groups.get(output.request_id)
        if group is None:
            return [output]
        if output.finished:
            self._end(group)
            self.cache.put(group.key.content, output)
        else:
            group.last = output
        return [output if rid == group.engine_id else relabel(output, listener)
                for rid, listener in group.listeners.items()]

    def release(self, request_ids: Iterable[str]) -> list[str]:
        """Listeners that left; returns the engine request ids nobody listens to any more (to abort)."""
        to_abort = []
        for rid in request_ids:
            engine_id = self._member_of.pop(rid, None)
            if engine_id is None:  # not shared: the request is its own sequence
                to_abort.append(rid)
                continue
            group = self._groups[engine_id]
            group.listeners.pop(rid, None)
            if not group.listeners:
                self._end(group)
                to_abort.append(engine_id)
        return to_abort

    def drop_inflight(self) -> None:
        """The engine dropped every sequence (a loop restart); results already cached stay valid."""
        self._groups.clear()
        self._by_key.clear()
        self._member_of.clear()

    def _end(self, group: _Group) -> None:
        self._groups.pop(group.engine_id, None)
        if self._by_key.get(group.key.scheduling) == group.engine_id:
            del self._by_key[group.key.scheduling]
        for rid in group.listeners:
            self._member_of.pop(rid, None)
