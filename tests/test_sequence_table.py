"""SequenceTable: the one owner of a slot's Python state, for the engine and the sampler together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from ironlm.engine.outputs import RequestMetrics
from ironlm.engine.sequence_table import EngineRequest, SequenceTable
from ironlm.sampler import Sampler
from ironlm.sampling_params import SamplingParams
from tiny_models import make_tiny_tokenizer


class RecordingSampler:
    """Stands in for Sampler: remembers which slots are live, and refuses what the real one refuses."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.removed: list[int] = []

    def add(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None = None,
            *, stop_token_ids: Sequence[int] = ()) -> None:
        assert slot not in self.live, f"slot {slot} added twice"
        self.live[slot] = (seed, tuple(stop_token_ids))

    def remove(self, slot: int) -> None:
        assert slot in self.live, f"slot {slot} removed but not live"
        del self.live[slot]
        self.removed.append(slot)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tiny_tokenizer()


def request(rid: str, params: SamplingParams) -> EngineRequest:
    return EngineRequest(rid, None, [5, 6, 7], params, RequestMetrics(arrival_time=0.0))


def test_add_and_finish_keep_sampler_and_table_in_step(tokenizer: Any) -> None:
    sampler = RecordingSampler()
    table = SequenceTable(sampler, tokenizer)  # type: ignore[arg-type]
    req = request("a", SamplingParams(n=3, seed=10, max_tokens=4))
    table.add(req, [4, 9, 2], stop_token_ids=[0, 3])
    assert sampler.live == {4: (10, (0, 3)), 9: (11, (0, 3)), 2: (12, (0, 3))}  # seed + index: n streams
    assert [s.index for s in req.seqs] == [0, 1, 2] and len(table) == 1
    assert table.seq(9) is req.seqs[1] and table.seq(5) is None

    assert table.finish(9, "stop", stop_token=3) is req
    assert table.finish(9, "stop") is None  # twice: nothing happens, the sampler is not asked again
    assert sampler.removed == [9] and not req.finished
    assert req.seqs[1].output().finish_reason == "stop" and req.seqs[1].output().stop_reason == 3
    table.finish(4, "length")
    table.finish(2, "length")
    assert req.finished and sampler.live == {} and sorted(sampler.removed) == [2, 4, 9]
    assert table.pop("a") is req and len(table) == 0 and table.pop("a") is None


def test_release_closes_only_what_still_runs(tokenizer: Any) -> None:
    sampler = RecordingSampler()
    table = SequenceTable(sampler, tokenizer)  # type: ignore[arg-type]
    a = request("a", SamplingParams(n=2, max_tokens=4))
    b = request("b", SamplingParams(max_tokens=4))
    table.add(a, [0, 1], stop_token_ids=[])
    table.add(b, [2], stop_token_ids=[])
    assert table.requests_in([2, 1, 0, 7]) == [b, a]  # distinct, first-seen order, unknown slots skipped
    table.finish(0, "length")
    table.release(a, "abort")
    assert [s.finish_reason for s in a.seqs] == ["length", "abort"]  # a finished sequence keeps its reason
    assert sorted(sampler.removed) == [0, 1] and list(sampler.live) == [2]
    assert table.seq(1) is None and table.seq(2) is b.seqs[0]


def test_released_slots_can_be_reused_by_the_real_sampler(tokenizer: Any) -> None:
    sampler = Sampler(64, torch.device("cpu"), max_slots=2, seed=0)
    table = SequenceTable(sampler, tokenizer)
    first = request("a", SamplingParams(n=2, temperature=0.8, seed=1, presence_penalty=0.5, max_tokens=4))
    table.add(first, [0, 1], stop_token_ids=[])
    table.release(first, "error")
    table.pop("a")
    second = request("b", SamplingParams(n=2, seed=2, max_tokens=4))
    table.add(second, [0, 1], stop_token_ids=[])  # the real sampler refuses a slot that is still in use
    assert table.requests_in([0, 1]) == [second]
