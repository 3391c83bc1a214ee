"""Scheduler step cost: the Rust core (`ironlm._core.Scheduler`, through PyO3, numpy arrays included)
against a plain-Python scheduler of the same policy written the way nano-vllm writes its own.

Workload: ``num_seqs`` requests with ``prompt_len``-token prompts are prefilled (not timed), then
``steps`` decode steps are timed. One step = build the plan (input ids, positions, slot mapping, padded
block tables, query start offsets, sequence/context lengths, logits rows, sample slots: the arrays a model
runner needs) + apply one sampled token per sequence (append, block bookkeeping, stop checks). No model.

The Python reference is honest and reasonably efficient: a deque of running sequences, a block manager
with a free deque, per-sequence block tables, reference counts and nano-vllm's hash-based prefix caching
(a block's hash is computed when it fills), one pass over the batch to build Python lists, converted to
numpy at the end, as nano-vllm's ``prepare_decode`` does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq

import numpy as np

from ironlm.config import EngineConfig, SchedulerConfig

BLOCK_SIZE = 16


# ---- the Python reference (nano-vllm style) -------------------------------------------------------------

class PySequence:
    __slots__ = (
        "block_table",
        "finished",
        "ignore_eos",
        "last_token",
        "max_tokens",
        "num_cached_tokens",
        "num_prompt_tokens",
        "num_tokens",
        "seq_id",
        "token_ids",
    )

    def __init__(self, seq_id: int, token_ids: list[int], max_tokens: int, ignore_eos: bool = True):
        self.seq_id = seq_id
        self.token_ids = list(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.finished = False

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


class PyBlock:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


class PyBlockManager:
    def __init__(self, num_blocks: int):
        self.blocks = [PyBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        return hash((prefix, tuple(token_ids)))

    def _allocate_block(self, block_id: int) -> PyBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.ref_count = 1
        block.hash = -1
        block.token_ids = []
        self.free_block_ids.remove(block_id)  # the head in the common case: O(1)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: PySequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: PySequence) -> None:
        h = -1
        cache_miss = False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h) if len(token_ids) == BLOCK_SIZE else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                cache_miss = True
            if cache_miss:
                block = self._allocate_block(self.free_block_ids[0])
            else:
                seq.num_cached_tokens += BLOCK_SIZE
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.hash = h
                block.token_ids = token_ids
                self.hash_to_block_id[h] = block.block_id
            seq.block_table.append(block.block_id)

    def deallocate(self, seq: PySequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: PySequence) -> bool:
        return len(self.free_block_ids) >= (seq.num_tokens % BLOCK_SIZE == 1)

    def may_append(self, seq: PySequence) -> None:
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        n = seq.num_tokens % BLOCK_SIZE
        if n == 1:
            block = self._allocate_block(self.free_block_ids[0])
            block_table.append(block.block_id)
        elif n == 0:
            token_ids = seq.block(seq.num_blocks - 1)
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            h = self.compute_hash(token_ids, prefix)
            last_block.hash = h
            last_block.token_ids = token_ids
            self.hash_to_block_id[h] = last_block.block_id


class PyPlan:
    __slots__ = (
        "block_tables",
        "context_lens",
        "input_ids",
        "is_prefill",
        "logits_indices",
        "positions",
        "query_start_loc",
        "sample_slots",
        "seq_lens",
        "seq_slots",
        "seqs",
        "slot_mapping",
    )
    seqs: list[PySequence]
    is_prefill: bool
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    context_lens: np.ndarray
    seq_slots: np.ndarray
    logits_indices: np.ndarray
    sample_slots: np.ndarray


class PyScheduler:
    """FCFS continuous batching: decode the running sequences (preempting the newest when blocks run
    out), else prefill waiting ones; builds the same arrays as the Rust core's plan."""

    def __init__(self, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, eos: int = -1):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = eos
        self.block_manager = PyBlockManager(num_blocks)
        self.waiting: deque[PySequence] = deque()
        self.running: deque[PySequence] = deque()

    def add(self, seq: PySequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> PyPlan:
        scheduled: list[PySequence] = []
        num_seqs = 0
        num_batched_tokens = 0
        while self.waiting and num_seqs < self.max_num_seqs:
            seq = self.waiting[0]
            if (num_batched_tokens + len(seq.token_ids) > self.max_num_batched_tokens
                    or not self.block_manager.can_allocate(seq)):
                break
            num_seqs += 1
            self.block_manager.allocate(seq)
            num_batched_tokens += seq.num_tokens - seq.num_cached_tokens
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return self._prepare_prefill(scheduled)
        while self.running and num_seqs < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                num_seqs += 1
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return self._prepare_decode(scheduled)

    def preempt(self, seq: PySequence) -> None:
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def _prepare_prefill(self, seqs: list[PySequence]) -> PyPlan:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu, seq_lens, ctx = [0], [], []
        for seq in seqs:
            start = seq.num_cached_tokens
            input_ids.extend(seq.token_ids[start:])
            positions.extend(range(start, seq.num_tokens))
            cu.append(cu[-1] + seq.num_tokens - start)
            seq_lens.append(seq.num_tokens)
            ctx.append(start)
            for pos in range(start, seq.num_tokens):
                slot_mapping.append(seq.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        return self._finish_plan(seqs, True, input_ids, positions, slot_mapping, cu, seq_lens, ctx)

    def _prepare_decode(self, seqs: list[PySequence]) -> PyPlan:
        input_ids, positions, slot_mapping, seq_lens = [], [], [], []
        for seq in seqs:
            n = seq.num_tokens
            input_ids.append(seq.last_token)
            positions.append(n - 1)
            seq_lens.append(n)
            slot_mapping.append(seq.block_table[-1] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
        cu = list(range(len(seqs) + 1))
        ctx = [n - 1 for n in seq_lens]
        return self._finish_plan(seqs, False, input_ids, positions, slot_mapping, cu, seq_lens, ctx)

    def _finish_plan(self, seqs, is_prefill, input_ids, positions, slot_mapping, cu, seq_lens, ctx) -> PyPlan:
        p = PyPlan()
        p.seqs = seqs
        p.is_prefill = is_prefill
        p.input_ids = np.array(input_ids, dtype=np.int64)
        p.positions = np.array(positions, dtype=np.int64)
        p.slot_mapping = np.array(slot_mapping, dtype=np.int64)
        width = max((len(s.block_table) for s in seqs), default=0)
        p.block_tables = np.array([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                  dtype=np.int32).reshape(len(seqs), width)
        p.query_start_loc = np.array(cu, dtype=np.int64)
        p.seq_lens = np.array(seq_lens, dtype=np.int64)
        p.context_lens = np.array(ctx, dtype=np.int64)
        p.seq_slots = np.array([s.seq_id for s in seqs], dtype=np.int64)
        p.logits_indices = p.query_start_loc[1:] - 1
        p.sample_slots = p.seq_slots
        return p

    def update(self, plan: PyPlan, token_ids: Seq[int]) -> list[int]:
        finished = []
        for seq, token_id in zip(plan.seqs, token_ids):
            seq.append_token(token_id)
            if (not seq.ignore_eos and token_id == self.eos) or seq.num_completion_tokens == seq.max_tokens:
                seq.finished = True
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq.seq_id)
        return finished


# ---- the benchmark --------------------------------------------------------------------------------------

def _prompts(num_seqs: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, 32000, size=(num_seqs, prompt_len)).tolist()


def _sizes(num_seqs: int, prompt_len: int, steps: int) -> tuple[int, int, int]:
    """(num_blocks, token budget, max_tokens): nobody finishes or runs out of blocks while timed (the first
    sequences already decode while the last ones still prefill)."""
    budget = max(8192, num_seqs)
    max_tokens = steps + -(-num_seqs * prompt_len // budget) + 16
    per_seq = -(-(prompt_len + max_tokens + BLOCK_SIZE) // BLOCK_SIZE)
    return num_seqs * per_seq + 64, budget, max_tokens


def _time_steps(schedule, update, steps: int) -> dict[str, float]:
    """Time ``steps`` steps as a whole (wall clock and this thread's CPU time: the CPU figure is what the
    step costs when other processes compete for the cores), then ``steps`` more with schedule and update
    timed apart."""
    perf, cpu = time.perf_counter_ns, time.thread_time_ns
    w0, c0 = perf(), cpu()
    for i in range(steps):
        update(schedule(), i)
    wall, cpu_ns = perf() - w0, cpu() - c0
    t_sched = t_upd = 0
    for i in range(steps):
        t0 = perf()
        plan = schedule()
        t1 = perf()
        update(plan, i)
        t2 = perf()
        t_sched += t1 - t0
        t_upd += t2 - t1
    return {"step_us": wall / steps / 1e3, "cpu_us": cpu_ns / steps / 1e3,
            "schedule_us": t_sched / steps / 1e3, "update_us": t_upd / steps / 1e3}


def _config(num_blocks: int, num_seqs: int, budget: int, max_model_len: int, caching: bool) -> SchedulerConfig:
    engine = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=num_seqs, max_num_batched_tokens=budget,
                          scheduling_policy="fcfs", enable_prefix_caching=caching)
    return engine.scheduler_config(num_blocks=num_blocks, max_num_batched_tokens=budget, max_model_len=max_model_len,
                                   tier_blocks=0, sliding_window=None)


def bench_rust(num_seqs: int, prompt_len: int, steps: int, seed: int = 0) -> dict[str, float]:
    from ironlm import _core

    num_blocks, budget, max_tokens = _sizes(num_seqs, prompt_len, 2 * steps)
    s = _core.Scheduler(_config(num_blocks, num_seqs, budget, prompt_len + max_tokens, caching=True))
    for i, p in enumerate(_prompts(num_seqs, prompt_len, seed)):
        s.add_request(f"req-{i}", p, max_tokens, ignore_eos=True)
    rng = np.random.default_rng(seed + 1)
    while True:  # prefill, untimed
        plan = s.schedule()
        s.update(rng.integers(100, 32000, plan.num_samples))
        if plan.num_prefill_tokens == 0 and not s.num_waiting:
            break
    tokens = [rng.integers(100, 32000, num_seqs) for _ in range(8)]

    def update(plan, i):
        s.update(tokens[i & 7])

    out = _time_steps(s.schedule, update, steps)
    plan = s.schedule()
    assert plan.num_decode_tokens == num_seqs and plan.num_seqs == num_seqs
    return out


def bench_python(num_seqs: int, prompt_len: int, steps: int, seed: int = 0) -> dict[str, float]:
    num_blocks, budget, max_tokens = _sizes(num_seqs, prompt_len, 2 * steps)
    s = PyScheduler(num_blocks, max_num_seqs=num_seqs, max_num_batched_tokens=budget)
    for i, p in enumerate(_prompts(num_seqs, prompt_len, seed)):
        s.add(PySequence(i, p, max_tokens))
    rng = np.random.default_rng(seed + 1)
    while s.waiting:  # prefill, untimed
        plan = s.schedule()
        s.update(plan, rng.integers(100, 32000, len(plan.seqs)).tolist())
    tokens = [rng.integers(100, 32000, num_seqs) for _ in range(8)]

    def update(plan, i):
        s.update(plan, tokens[i & 7].tolist())

    out = _time_steps(s.schedule, update, steps)
    plan = s.schedule()
    assert not plan.is_prefill and len(plan.seqs) == num_seqs
    return out


def check_same_plan(num_seqs: int = 8, prompt_len: int = 40, steps: int = 20) -> None:
    """Both schedulers build the same decode arrays for the same workload (block ids may differ)."""
    from ironlm import _core

    num_blocks, budget, max_tokens = _sizes(num_seqs, prompt_len, steps)
    rs = _core.Scheduler(_config(num_blocks, num_seqs, budget, prompt_len + max_tokens, caching=False))
    ps = PyScheduler(num_blocks, max_num_seqs=num_seqs, max_num_batched_tokens=budget)
    for i, p in enumerate(_prompts(num_seqs, prompt_len, 7)):
        rs.add_request(f"req-{i}", p, max_tokens, ignore_eos=True)
        ps.add(PySequence(i, p, max_tokens))
    for step in range(steps):
        rp, pp = rs.schedule(), ps.schedule()
        for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "context_lens", "seq_slots",
                     "logits_indices", "sample_slots"):
            np.testing.assert_array_equal(getattr(rp, name), getattr(pp, name), err_msg=f"step {step}: {name}")
        assert rp.block_tables.shape == pp.block_tables.shape
        bs = BLOCK_SIZE
        for plan in (rp, pp):
            rows = np.repeat(np.arange(len(plan.seq_lens)), np.diff(plan.query_start_loc))
            want = plan.block_tables[rows, plan.positions // bs].astype(np.int64) * bs + plan.positions % bs
            np.testing.assert_array_equal(plan.slot_mapping, want)
        toks = [(7 * step + i) % 1000 + 100 for i in range(len(pp.seqs))]
        rs.update(np.array(toks, dtype=np.int64))
        ps.update(pp, toks)


def run(num_seqs_list: Seq[int] = (64, 256, 1024), steps: int = 200, quick: bool = False,
        prompt_len: int = 128, repeats: int = 3, verbose: bool = True) -> dict:
    """Time both schedulers at each size; best of ``repeats`` runs each (alternating). Returns
    ``{"results": [{num_seqs, rust_us, python_us, speedup, ...}], ...}``: ``*_us`` wall clock per step,
    ``*_cpu_us`` this thread's CPU time per step (robust to other processes on the machine), schedule and
    update apart."""
    if quick:
        steps, repeats, prompt_len = min(steps, 30), 1, min(prompt_len, 64)
    check_same_plan()
    results = []
    for n in num_seqs_list:
        best_r: dict[str, float] | None = None
        best_p: dict[str, float] | None = None
        for _ in range(repeats):
            r = bench_rust(n, prompt_len, steps)
            p = bench_python(n, prompt_len, steps)
            if best_r is None or r["step_us"] < best_r["step_us"]:
                best_r = r
            if best_p is None or p["step_us"] < best_p["step_us"]:
                best_p = p
        assert best_r is not None and best_p is not None
        row = {
            "num_seqs": n,
            "rust_us": round(best_r["step_us"], 2),
            "rust_cpu_us": round(best_r["cpu_us"], 2),
            "rust_schedule_us": round(best_r["schedule_us"], 2),
            "rust_update_us": round(best_r["update_us"], 2),
            "python_us": round(best_p["step_us"], 2),
            "python_cpu_us": round(best_p["cpu_us"], 2),
            "python_schedule_us": round(best_p["schedule_us"], 2),
            "python_update_us": round(best_p["update_us"], 2),
            "speedup": round(best_p["step_us"] / best_r["step_us"], 1),
            "speedup_cpu": round(best_p["cpu_us"] / best_r["cpu_us"], 1),
        }
        results.append(row)
        if verbose:
            print(f"{n:5d} seqs: rust {row['rust_us']:8.1f} us/step (cpu {row['rust_cpu_us']:.1f}; schedule "
                  f"{row['rust_schedule_us']:.1f} + update {row['rust_update_us']:.1f})   python "
                  f"{row['python_us']:8.1f} us/step (cpu {row['python_cpu_us']:.1f})   {row['speedup']:.1f}x",
                  flush=True)
    return {"results": results, "steps": steps, "prompt_len": prompt_len, "block_size": BLOCK_SIZE,
            "repeats": repeats}
