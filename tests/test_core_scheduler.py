"""A simulated generation loop through ``ironlm._core.Scheduler``, checked independently.

The test keeps its own copy of every sequence's tokens (from ``add_request`` and the tokens it
"samples"), and a simulated KV cache (and KV tier, when the scheduler has one): each plan's tier copies
(``kv_demote`` then ``kv_promote``) and copy-on-write pairs are applied, then every
token row writes a hash of ``(namespace, tokens[: pos + 1])`` at its slot. Every row's whole context
must then read back exactly its own prefix hashes through ``block_tables``: a wrong prefix hit,
a missing copy-on-write, a block freed too early or a bad slot mapping all show up as a stale
hash. Positions, input ids, sample rows and budgets are recomputed from the test's own state.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from core_utils import make_scheduler
from ironlm import _core
from ironlm.sampler import Sampler
from ironlm.sampling_params import SamplingParams


@dataclass
class Seq:
    request_id: str
    namespace: str | None
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    min_tokens: int
    eos: tuple[int, ...]
    stop: tuple[int, ...]
    ignore_eos: bool
    blocks: list[int] = field(default_factory=list)  # as of the last plan that ran it


def prefix_hashes(ns: str | None, tokens: list[int], n: int) -> list[int]:
    h = zlib.crc32(repr(ns).encode())  # not hash(): str hashes change per process, the data must not
    out = []
    for t in tokens[:n]:
        h = (h * 1_000_003 + t + 1) & 0xFFFFFFFFFFFF
        out.append(h)
    return out


class Harness:
    def __init__(self, rng: random.Random, **cfg):
        self.rng = rng
        self.cfg = cfg
        self.sched = make_scheduler(**cfg)
        self.bs = cfg["block_size"]
        self.kv = np.full(cfg["num_blocks"] * self.bs, -1, dtype=np.int64)
        self.tier = np.full(cfg.get("tier_blocks", 0) * self.bs, -1, dtype=np.int64)
        self.seqs: dict[int, Seq] = {}
        self.requests: dict[str, set[int]] = {}  # live slots
        self.now = 0.0
        self.running: set[int] = set()
        self.seen = {"hits": 0, "chunks": 0, "preempted": 0, "cow": 0, "fork_rows": 0, "timeouts": 0,
                     "aborted": 0, "finished": 0, "recompute_rows": 0, "demoted": 0, "promoted": 0}

    def add(self, rid: str, prompt: list[int], max_tokens: int, **kw) -> bool:
        try:
            slots = self.sched.add_request(rid, prompt, max_tokens, arrival_time=self.now, **kw)
        except (_core.RequestTooLargeError, _core.QueueFullError):
            return False
        assert len(slots) == kw.get("n", 1)
        for s in slots:
            assert s not in self.seqs
            self.seqs[s] = Seq(rid, kw.get("namespace"), list(prompt), len(prompt), max_tokens,
                               kw.get("min_tokens", 0), tuple(kw.get("eos_token_ids", ())),
                               tuple(kw.get("stop_token_ids", ())), kw.get("ignore_eos", False))
        self.requests[rid] = set(slots)
        return True

    def drop(self, rid: str) -> None:
        for s in self.requests.pop(rid, []):
            self.seqs.pop(s, None)
            self.running.discard(s)

    def drop_slot(self, slot: int) -> None:
        rid = self.seqs.pop(slot).request_id
        self.running.discard(slot)
        self.requests[rid].discard(slot)
        if not self.requests[rid]:
            del self.requests[rid]

    def step(self) -> _core.SchedulerPlan:
        self.now += 1.0
        sched, bs = self.sched, self.bs
        assert sched.num_running == len(self.running)
        plan = sched.schedule(now=self.now)
        for rid, slot, reason, stop_token in plan.finished:
            assert reason == "timeout" and stop_token is None
            assert slot in self.requests[rid] and slot not in self.running
            if len(self.requests[rid]) == 1:
                self.seen["timeouts"] += 1
            self.drop_slot(slot)
        self.seen["preempted"] += len(plan.preempted_request_ids)
        in_plan = set(plan.seq_slots.tolist())
        for rid in plan.preempted_request_ids:
            for s in self.requests[rid]:
                self.seqs[s].blocks = []
                if s not in in_plan:
                    self.running.discard(s)
        # No starvation: every running sequence got a row unless it was preempted.
        assert self.running <= in_plan, self.running - in_plan
        self.running |= in_plan

        T, B = plan.num_tokens, plan.num_seqs
        qsl, seq_lens, ctx = plan.query_start_loc, plan.seq_lens, plan.context_lens
        bt = plan.block_tables
        assert plan.input_ids.dtype == np.int64 and bt.dtype == np.int32
        assert qsl.shape == (B + 1,) and qsl[0] == 0 and qsl[-1] == T
        assert T <= self.cfg["max_num_batched_tokens"] and B <= self.cfg["max_num_seqs"]
        assert plan.is_empty == (T == 0)
        assert plan.num_prefill_tokens + plan.num_decode_tokens == T
        if B:
            assert bt.shape == (B, max(-(-int(n) // bs) for n in seq_lens))
            assert plan.max_query_len == int(np.diff(qsl).max())
            assert plan.max_seq_len == int(seq_lens.max())
        # Progress and no starvation: everything running before got a row unless preempted.
        if sched.has_unfinished():
            assert T > 0, "no progress with work left"

        # Tier copies first (device -> tier, then back), then copy-on-write, as the engine does.
        for block, slot in plan.kv_demote.tolist():
            self.tier[slot * bs:(slot + 1) * bs] = self.kv[block * bs:(block + 1) * bs]
            self.seen["demoted"] += 1
        for slot, block in plan.kv_promote.tolist():
            self.kv[block * bs:(block + 1) * bs] = self.tier[slot * bs:(slot + 1) * bs]
            self.seen["promoted"] += 1
        # A copy batch never names a destination twice (one index_copy per batch).
        assert len(set(plan.kv_demote[:, 1].tolist())) == len(plan.kv_demote)
        assert len(set(plan.kv_promote[:, 1].tolist())) == len(plan.kv_promote)
        assert plan.cow_pairs.shape == (len(plan.cow_pairs), 2)
        for src, dst in plan.cow_pairs:
            self.kv[dst * bs:(dst + 1) * bs] = self.kv[src * bs:(src + 1) * bs]
            self.seen["cow"] += 1
        cow: dict[int, set[int]] = {}
        for src, dst in plan.cow_pairs.tolist():
            cow.setdefault(src, set()).add(dst)

        expected_samples = []
        for b in range(B):
            slot = int(plan.seq_slots[b])
            seq = self.seqs[slot]
            c, n = int(ctx[b]), int(seq_lens[b])
            rows = slice(int(qsl[b]), int(qsl[b + 1]))
            assert n - c == rows.stop - rows.start > 0
            assert n <= len(seq.tokens)
            np.testing.assert_array_equal(plan.positions[rows], np.arange(c, n))
            np.testing.assert_array_equal(plan.input_ids[rows], seq.tokens[c:n])
            nblk = -(-n // bs)
            table = [int(x) for x in bt[b, :nblk]]
            assert not bt[b, nblk:].any(), "padding must be 0"
            pos = np.arange(c, n)
            want_slots = np.array(table)[pos // bs] * bs + pos % bs
            np.testing.assert_array_equal(plan.slot_mapping[rows], want_slots)
            # The partly filled block being appended to stays put unless copied on write (full
            # blocks may be swapped for the prefix cache's identical copy: the KV check below
            # covers them).
            if seq.blocks and c % bs:
                old = seq.blocks[c // bs]
                assert table[c // bs] == old or table[c // bs] in cow.get(old, ()), (slot, old, table)
            if c > 0 and not seq.blocks:
                self.seen["hits"] += 1
            if n < len(seq.tokens) and n <= seq.prompt_len:
                self.seen["chunks"] += 1
            if c < seq.prompt_len < n and n - c > 1 and len(seq.tokens) > seq.prompt_len + 1:
                self.seen["recompute_rows"] += 1  # re-creating known generated tokens
            seq.blocks = table
            hashes = prefix_hashes(seq.namespace, seq.tokens, n)
            self.kv[want_slots] = hashes[c:n]
            if n == len(seq.tokens):
                expected_samples.append((rows.stop - 1, slot))
        # Writes never collide and every context reads back its own prefix.
        assert len(set(plan.slot_mapping.tolist())) == T
        for b in range(B):
            seq = self.seqs[int(plan.seq_slots[b])]
            n = int(seq_lens[b])
            pos = np.arange(n)
            kslots = bt[b][pos // bs].astype(np.int64) * bs + pos % bs
            np.testing.assert_array_equal(self.kv[kslots], prefix_hashes(seq.namespace, seq.tokens, n))

        # Sample rows: one per sequence that reached its known tokens, repeated for a fork.
        rows = plan.logits_indices.tolist()
        slots = plan.sample_slots.tolist()
        assert len(rows) == len(slots) == plan.num_samples
        # What the sampler gets: each row's output count and whether its stop tokens are banned yet.
        assert plan.sample_ban_stop.dtype == np.bool_
        for s, n_out, ban in zip(slots, plan.sample_output_lens.tolist(), plan.sample_ban_stop.tolist()):
            seq = self.seqs[s]
            assert n_out == len(seq.tokens) - seq.prompt_len
            assert ban == (n_out < seq.min_tokens)
        got = {}
        for r, s in zip(rows, slots):
            got.setdefault(r, []).append(s)
        assert sorted(got) == sorted(r for r, _ in expected_samples)
        for r, s in expected_samples:
            fam = got[r]
            assert fam[0] == s
            if len(fam) > 1:  # n > 1 first token: the siblings of the same request
                self.seen["fork_rows"] += len(fam) - 1
                assert all(self.seqs[x].request_id == self.seqs[s].request_id for x in fam)
                assert all(len(self.seqs[x].tokens) == len(self.seqs[s].tokens) for x in fam)
        return plan

    def sample_and_update(self, plan: _core.SchedulerPlan) -> None:
        sampled = np.array([self.rng.randrange(0, 30) for _ in range(plan.num_samples)], dtype=np.int64)
        fork_parent_blocks = {}
        for r, s in zip(plan.logits_indices.tolist(), plan.sample_slots.tolist()):
            fork_parent_blocks.setdefault(r, s)
        finished = self.sched.update(sampled)
        expect_finished = {}
        for tok, r, s in zip(sampled.tolist(), plan.logits_indices.tolist(), plan.sample_slots.tolist()):
            seq = self.seqs[s]
            parent = self.seqs[fork_parent_blocks[r]]
            if seq is not parent:
                seq.blocks = list(parent.blocks)
                self.running.add(s)
            n_before = len(seq.tokens) - seq.prompt_len
            seq.tokens.append(tok)
            is_eos = not seq.ignore_eos and tok in seq.eos
            if n_before >= seq.min_tokens and (tok in seq.stop or is_eos):
                # The matched stop_token_ids entry; EOS reports none.
                expect_finished[s] = (seq.request_id, s, "stop", None if is_eos else tok)
            elif n_before + 1 >= seq.max_tokens or len(seq.tokens) >= self.cfg["max_model_len"]:
                expect_finished[s] = (seq.request_id, s, "length", None)
        assert sorted(finished, key=str) == sorted(expect_finished.values(), key=str)
        for _, slot, _, _ in finished:
            assert self.sched.output_token_ids(slot) == self.seqs[slot].tokens[self.seqs[slot].prompt_len:]
            self.drop_slot(slot)
            self.seen["finished"] += 1

    def check_counts(self) -> None:
        st = self.sched.stats()
        assert st["num_running"] == self.sched.num_running
        assert st["num_waiting"] == self.sched.num_waiting
        assert st["blocks_free"] + st["blocks_used"] + st["blocks_cached"] == st["blocks_total"]
        assert st["num_requests"] == len(self.requests)
        assert self.sched.has_unfinished() == bool(self.requests)


CONFIGS = [
    ("fcfs", True), ("fcfs", False), ("priority", True), ("deadline", True),
]


@pytest.mark.parametrize("policy,caching", CONFIGS)
def test_simulated_generation_loop(policy: str, caching: bool) -> None:
    _simulate(random.Random(f"{policy}-{caching}"), policy=policy, enable_prefix_caching=caching)


@pytest.mark.parametrize("policy,swap,tier_blocks", [("fcfs", False, 12), ("priority", True, 40), ("fcfs", True, 3)])
def test_simulated_generation_loop_with_a_kv_tier(policy: str, swap: bool, tier_blocks: int) -> None:
    """Evictions demote to the tier, hits promote back, preemptions swap out: every context must still read
    its own prefix through the copies the plans carry."""
    h = _simulate(random.Random(f"tier-{policy}-{swap}-{tier_blocks}"), policy=policy, enable_prefix_caching=True,
                  tier_blocks=tier_blocks, swap=swap)
    st = h.sched.stats()
    assert h.seen["demoted"] == st["kv_demotions"] > 0 and h.seen["promoted"] == st["kv_promotions"] > 0, h.seen
    assert st["prefix_hits_tier"] > 0
    if swap:
        assert st["swap_out_blocks"] > 0 and st["swap_in_blocks"] > 0, st


def _simulate(rng: random.Random, **cfg) -> Harness:
    caching = cfg["enable_prefix_caching"]
    h = Harness(rng, num_blocks=28, block_size=4, max_num_seqs=6, max_num_batched_tokens=20,
                max_model_len=64, **cfg)
    system = [rng.randrange(30, 60) for _ in range(20)]
    next_id = 0
    for _ in range(500):
        op = rng.random()
        if op < 0.30:
            prompt = system[: rng.randrange(0, 20)] + [rng.randrange(30, 60) for _ in range(rng.randrange(1, 24))]
            kw = {"n": rng.choice([1, 1, 1, 2, 3]), "priority": rng.randrange(3),
                  "eos_token_ids": [0], "min_tokens": rng.choice([0, 0, 2]),
                  "stop_token_ids": rng.choice([[], [1]]), "ignore_eos": rng.random() < 0.2,
                  "namespace": rng.choice([None, None, "tenant-b"])}
            if rng.random() < 0.2:
                kw["queue_timeout"] = float(rng.randrange(0, 6))
            if rng.random() < 0.5:
                kw["deadline"] = float(rng.randrange(0, 10))
            max_tokens = rng.randrange(1, 24)
            kw["min_tokens"] = min(kw["min_tokens"], max_tokens)
            h.add(f"r{next_id}", prompt, max_tokens, **kw)
            next_id += 1
        elif op < 0.35 and h.requests:
            rid = rng.choice(sorted(h.requests))
            assert h.sched.abort(rid)
            assert rid not in h.sched
            h.drop(rid)
            h.seen["aborted"] += 1
        elif op < 0.38 and h.seqs:
            slot = rng.choice(sorted(h.seqs))
            assert h.sched.finish(slot)
            h.drop_slot(slot)
        else:
            plan = h.step()
            if not plan.is_empty:
                h.sample_and_update(plan)
        h.check_counts()
    # Drain, then the cache must empty completely.
    for _ in range(2000):
        if not h.sched.has_unfinished():
            break
        plan = h.step()
        h.sample_and_update(plan)
        h.check_counts()
    assert not h.sched.has_unfinished() and not h.requests
    st = h.sched.stats()
    assert st["blocks_used"] == 0
    assert h.sched.reset_prefix_cache()
    assert h.sched.stats()["blocks_free"] == 28
    seen = h.seen
    assert seen["preempted"] > 0 and seen["chunks"] > 0 and seen["fork_rows"] > 0, seen
    assert seen["timeouts"] > 0 and seen["aborted"] > 0 and seen["finished"] > 50, seen
    assert seen["recompute_rows"] > 0 and seen["cow"] > 0, seen
    if caching:
        assert seen["hits"] > 0 and st["prefix_hits"] > 0, seen
    else:
        assert st["prefix_hits"] == 0
    return h


def test_priority_request_preempts_lower_priority() -> None:
    s = make_scheduler(8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, policy="priority")
    s.add_request("low", list(range(20)), 8, priority=5)
    s.update(np.zeros(s.schedule().num_samples, dtype=np.int64))
    s.add_request("high", list(range(100, 112)), 8, priority=0)
    plan = s.schedule()
    assert plan.preempted_request_ids == ["low"]
    assert plan.new_request_ids == ["high"]
    assert s.stats()["num_preemptions"] == 1


def test_deadline_order_and_timeout() -> None:
    s = make_scheduler(64, block_size=4, max_num_seqs=1, max_num_batched_tokens=8, policy="deadline")
    s.add_request("none", [1, 2], 1, arrival_time=0.0)
    s.add_request("late", [1, 2], 1, deadline=9.0, arrival_time=0.0)
    s.add_request("soon", [1, 2], 1, deadline=1.0, arrival_time=0.0)
    s.add_request("expires", [1, 2], 1, queue_timeout=1.5, arrival_time=0.0)
    order, finished = [], []
    now = 0.0
    while s.has_unfinished():
        now += 1.0
        plan = s.schedule(now=now)
        order += plan.new_request_ids
        finished += plan.finished
        finished += s.update(np.full(plan.num_samples, 3))
    assert order == ["soon", "late", "none"]
    assert ("expires", 3, "timeout", None) in finished
    assert s.stats()["num_timeouts"] == 1


def test_n_greater_than_one_and_chunked_prefill_arrays() -> None:
    s = make_scheduler(64, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    slots = s.add_request("r", list(range(10)), 3, n=3)
    assert slots == [0, 1, 2]
    p1 = s.schedule()
    assert p1.input_ids.tolist() == list(range(8)) and p1.num_samples == 0 and p1.new_request_ids == ["r"]
    s.update(np.zeros(0, dtype=np.int64))
    p2 = s.schedule()
    assert p2.positions.tolist() == [8, 9] and p2.context_lens.tolist() == [8] and p2.seq_lens.tolist() == [10]
    assert p2.logits_indices.tolist() == [1, 1, 1] and p2.sample_slots.tolist() == [0, 1, 2]
    assert s.update(np.array([7, 8, 9])) == []
    assert s.num_running == 3
    p3 = s.schedule()
    assert p3.seq_slots.tolist() == [0, 1, 2] and p3.input_ids.tolist() == [7, 8, 9]
    assert p3.positions.tolist() == [10, 10, 10]
    assert p3.cow_pairs.shape == (2, 2)  # the shared half-full block, copied for two writers
    assert len({int(x) for x in p3.block_tables[:, 2]}) == 3
    np.testing.assert_array_equal(p3.block_tables[:, :2], np.repeat(p3.block_tables[:1, :2], 3, axis=0))
    done = s.update([1, 2, 3])
    assert done == []
    s.schedule()
    done = s.update([4, 5, 6])
    assert sorted(done) == [("r", 0, "length", None), ("r", 1, "length", None), ("r", 2, "length", None)]
    assert s.output_token_ids(1) == [8, 2, 5]


def test_preempted_sequence_recomputes_without_resampling() -> None:
    s = make_scheduler(6, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False)
    s.add_request("a", list(range(9)), 8)
    s.add_request("b", list(range(100, 109)), 8)
    preempted = []
    for t in range(1, 6):
        plan = s.schedule()
        preempted += plan.preempted_request_ids
        s.update(np.full(plan.num_samples, t))
    assert preempted == ["b"]
    while "a" in s:
        plan = s.schedule()
        s.update(np.full(plan.num_samples, 9))
    plan = s.schedule()
    # b recomputes its 9 prompt + 4 known generated tokens, sampling only after the last.
    assert plan.input_ids.tolist() == list(range(100, 109)) + [1, 2, 3, 4]
    assert plan.logits_indices.tolist() == [12] and plan.new_request_ids == []


def test_schedule_without_update_preempts_the_lost_step() -> None:
    s = make_scheduler(64, block_size=4)
    s.add_request("a", list(range(10)), 5)
    s.update(np.full(s.schedule().num_samples, 1))
    s.schedule()  # never run
    plan = s.schedule()
    assert plan.preempted_request_ids == ["a"]
    assert plan.num_cached_tokens == 8 and plan.num_tokens == 3
    s.update([2])
    assert s.output_token_ids(0) == [1, 2]


def test_step_accepts_other_int_dtypes_and_ignores_stale_rows() -> None:
    s = make_scheduler(64, block_size=4)
    s.add_request("a", np.arange(5, dtype=np.int32), 3)
    s.add_request("b", np.arange(5, dtype=np.int64), 3)
    plan = s.schedule()
    assert plan.num_samples == 2
    assert s.abort("a")  # between schedule and update: its row is ignored
    assert s.update(np.array([1, 2], dtype=np.int32)) == []
    assert s.output_token_ids(1) == [2]


def test_core_and_sampler_stop_once_with_min_tokens_ignore_eos_and_stop_tokens() -> None:
    """The engine's loop without a model: the core decides every stop and tells the sampler which rows must not
    sample their stop tokens yet; the sampler masks exactly the ids the core stops on."""
    eos, V = 2, 16
    logits_row = torch.full((V,), -5.0)
    logits_row[eos], logits_row[7], logits_row[11] = 10.0, 9.0, 8.0  # greedy: EOS, else 7, else 11
    cases = {
        "eos": SamplingParams(temperature=0, max_tokens=8),
        "min3": SamplingParams(temperature=0, max_tokens=8, min_tokens=3),
        "min2-stop7": SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=[7]),
        "ignore": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        "ignore-stop-eos": SamplingParams(temperature=0, max_tokens=8, min_tokens=1, ignore_eos=True,
                                          stop_token_ids=[eos]),
        "stop7": SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[7], logit_bias={eos: -100.0}),
        "n2-min2": SamplingParams(temperature=0, max_tokens=8, min_tokens=2, n=2),
    }
    sched = make_scheduler(64, block_size=4)
    sampler = Sampler(V, "cpu", max_slots=8, seed=0)
    prompt = [1, 3, 4]
    for rid, p in cases.items():
        slots = sched.add_request(rid, prompt, p.max_tokens, min_tokens=p.min_tokens, n=p.n, eos_token_ids=[eos],
                                  stop_token_ids=list(p.stop_token_ids or ()), ignore_eos=p.ignore_eos)
        for slot in slots:
            sampler.add(slot, p, prompt, 0, stop_token_ids=sched.stop_token_ids(slot))
    done: dict[str, list[tuple[str, int | None, list[int]]]] = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        logits = logits_row.expand(plan.num_samples, -1).contiguous()
        out = sampler.sample(logits, plan.sample_slots, plan.sample_output_lens, plan.sample_ban_stop)
        for rid, slot, reason, stop_token in sched.update(out.token_ids):
            done.setdefault(rid, []).append((reason, stop_token, sched.output_token_ids(slot)))
            sampler.remove(slot)
    assert done == {
        "eos": [("stop", None, [eos])],  # EOS reports no stop token
        "min3": [("stop", None, [7, 7, 7, eos])],  # EOS masked for exactly min_tokens tokens
        "min2-stop7": [("stop", None, [11, 11, eos])],  # both stop ids masked
        "ignore": [("length", None, [eos] * 4)],  # EOS neither stops nor is masked
        "ignore-stop-eos": [("stop", eos, [7, eos])],  # asked for as a stop token id: reported as one
        "stop7": [("stop", 7, [7])],
        "n2-min2": [("stop", None, [7, 7, eos])] * 2,
    }
