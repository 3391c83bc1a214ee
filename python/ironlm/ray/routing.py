"""Prefix-affinity request routing for the engine replicas, on Ray Serve's request-router extension point.

The ingress hashes the first block of each prompt into `RouteHint.prefix_key`. The router sends a key to the
replica that served it first, whose radix cache holds that prefix, unless that replica has more than `margin`
requests in flight beyond the least loaded one: then, as for requests without a key, the lower-queue of two
random replicas (power of two choices).

The router lives in the process that holds the deployment handle (the ingress), so the loads it compares are
the requests it has routed and not yet seen complete: exact with one ingress replica, a per-ingress view
otherwise, which is what power of two choices needs anyway.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


@dataclass(frozen=True)
class RouteHint:
    prefix_key: str | None = None


def prefix_key(path: str, body: bytes, block: int) -> str | None:
    """The affinity key of a completions/chat request body: a hash of its first `block` prompt characters
    (token ids for a token prompt); None for other requests and for prompts shorter than one block."""
    if not path.endswith("completions"):
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    lead: Any = None
    if isinstance(req.get("messages"), list):
        lead = "".join(f"{m.get('role')}\x00{_content_text(m.get('content'))}\x00"
                       for m in req["messages"] if isinstance(m, dict))
    else:
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: its first prompt decides
        lead = prompt
    if isinstance(lead, str):
        if len(lead) < block:
            return None
        data = lead[:block].encode()
    elif isinstance(lead, list) and len(lead) >= block and all(isinstance(t, int) for t in lead[:block]):
        data = b"t" + b",".join(str(t).encode() for t in lead[:block])
    else:
        return None
    # The model name is part of the key: a replica's cache is per model.
    model = str(req.get("model") or "").encode()
    return hashlib.blake2b(model + b"\x00" + data, digest_size=8).hexdigest()


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _hint(pending: PendingRequest | None) -> RouteHint:
    if pending is None:
        return RouteHint()
    hint = pending.kwargs.get("route")
    return hint if isinstance(hint, RouteHint) else RouteHint()


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: prefix affinity within a load margin, else power of two choices."""

    def initialize_state(self, routing: str = "prefix", margin: int = 4, max_keys: int = 65536,
                         **_: Any) -> None:
        self._affinity = routing == "prefix"
        self._margin = margin
        self._max_keys = max_keys
        # prefix key -> the replica that first served it, least recently used first
        self._owners: OrderedDict[str, ReplicaID] = OrderedDict()
        # requests routed and not yet completed, per replica and per internal request id
        self._inflight: dict[ReplicaID, int] = {}
        self._request_replica: dict[str, ReplicaID] = {}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, owner in self._owners.items() if owner == replica_id]:
            del self._owners[key]
        self._inflight.pop(replica_id, None)

    def load(self, replica_id: ReplicaID) -> int:
        return self._inflight.get(replica_id, 0)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hint = _hint(pending_request)
        pair = _two_random(candidate_replicas)
        if not self._affinity or hint.prefix_key is None:
            return [pair]
        owner_id = self._owners.get(hint.prefix_key)
        owner = next((r for r in candidate_replicas if r.replica_id == owner_id), None)
        if owner is None:
            return [pair]
        self._owners.move_to_end(hint.prefix_key)
        least = min(self.load(r.replica_id) for r in candidate_replicas)
        if self.load(owner.replica_id) - least > self._margin:
            return [pair]
        # The owner first; if its queue is full Ray Serve falls through to the pair.
        return [[owner], pair]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._request_replica[request_id] = replica_id
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1
        key = _hint(pending_request).prefix_key
        if self._affinity and key is not None and key not in self._owners:
            self._owners[key] = replica_id
            if len(self._owners) > self._max_keys:
                self._owners.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed_to = self._request_replica.pop(internal_request_id, None)
        if routed_to is not None and self._inflight.get(routed_to, 0) > 0:
            self._inflight[routed_to] -= 1


def _two_random(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, 2) if len(replicas) > 2 else list(replicas)
