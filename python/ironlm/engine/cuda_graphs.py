"""CUDA graphs for decode steps, as vLLM captures them: one graph per batch size, a step padded to the next one.

A decode-only step (one new token per sequence) of n sequences is padded to the smallest captured size >= n and
replayed from the graph captured at startup for that size: the ~10 kernel launches per layer of a small model
cost more host time than the GPU spends on them, and a replay is one launch. Replay re-runs the recorded kernels
on the recorded addresses, so everything a step changes lives in static buffers that are filled in place before
each replay: token ids, positions, KV slots and the attention metadata (sequence lengths, block tables).

The metadata's host side is frozen at capture, so it is chosen to hold for every step: each sequence is taken to
be `max_model_len` long. The Triton decode kernel sizes its split count (a launch-grid dimension) from that and
reads each sequence's real length on the device, so one graph serves any context; the rotary table is grown to
`max_model_len` rows before capture and never again. The backend's per-step plan (which rows decode) is built by
the warm-up forward into the metadata's plan cache, outside the graph: the graph holds no host-to-device copy.

Padding rows: token 0 at position 0, KV slot -1 (the cache write skips it), length 1 over block 0 (any block id
is a valid address; the row reads one cached token and its logits are dropped), context 0.

Only the Triton attention backend is captured: the torch and CPU backends plan from host arrays of the step
itself, which a replay would not see. Tensor-parallel runners stay eager (collectives are not captured here).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ironlm.attention import AttentionMetadata

if TYPE_CHECKING:
    from ironlm.distributed.plan_codec import StepArrays
    from ironlm.engine.kv_cache import KVCaches

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8. Larger decode batches run eager.
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to the first one that holds max_num_seqs (<= limit)."""
    sizes = [1, 2, 4, *range(8, limit + 1, 8)]
    top = min(max(1, max_num_seqs), limit)
    return [s for s in sizes if s < top] + [next(s for s in sizes if s >= top)]


@dataclass
class _Graph:
    size: int
    meta: AttentionMetadata
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # rows of the shared output buffer the graph writes


class DecodeGraphs:
    """The static buffers and one graph per size. `capture=False` keeps the buffers and runs the very forward a
    graph would record eagerly on them: the same inputs, padding and frozen metadata, without the capture
    (what a CPU dry run of the GPU check exercises, through the Triton interpreter)."""

    def __init__(self, model: Any, kv_caches: KVCaches, *, sizes: list[int], max_model_len: int, block_size: int,
                 device: torch.device, capture: bool = True) -> None:
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self.capture = capture
        n = self.sizes[-1]
        self.width = -(-max_model_len // block_size)  # block-table columns a sequence of max_model_len needs
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(n, dtype=i32, device=device)
        self.context_lens = torch.zeros(n, dtype=i32, device=device)
        self.block_tables = torch.zeros(n, self.width, dtype=i32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)  # one token per sequence: fixed
        self.logits_indices = torch.arange(n, dtype=i64, device=device)
        pin = device.type == "cuda"
        # Host staging: pinned, so the copies are asynchronous; one flat block-table buffer viewed [size, width
        # of this step] keeps the copy as small as the step's own table.
        self._host = {name: torch.zeros(n, dtype=dtype, pin_memory=pin) for name, dtype in
                      (("input_ids", i64), ("positions", i64), ("slot_mapping", i64), ("seq_lens", i32),
                       ("context_lens", i32))}
        self._host_bt = torch.zeros(n * self.width, dtype=i32, pin_memory=pin)
        # Set after the copies of a step: its host buffers are not rewritten before the copies have read them.
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: dict[int, _Graph] = {}
        # Every graph copies its logits into the first rows of this one buffer, so that the forward's own output
        # is scratch memory of the shared pool (as its other intermediates are) and is not kept once per size.
        self.logits_out: torch.Tensor | None = None
        self.replays = 0
        # The graphs read the rotary table at its capture-time address: keep that memory alive even if an eager
        # step ever grew the model's table (none longer than max_model_len does).
        self._captured_tables: list[torch.Tensor] = []

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size], max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=np.arange(size + 1, dtype=np.int32),
            seq_lens_cpu=np.full(size, self.max_model_len, dtype=np.int32))

    def _forward(self, g: _Graph) -> torch.Tensor:
        b = g.size
        with torch.inference_mode():
            out: torch.Tensor = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, g.meta,
                                           self.logits_indices[:b])
        return out

    def capture_all(self) -> None:
        """Warm up and capture every size, largest first (the smaller graphs reuse the largest one's pool)."""
        # Every buffer holds padding now: the warm-ups and captures write nothing into the KV cache.
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for size in reversed(self.sizes):
            g = _Graph(size, self._meta(size))
            if not self.capture:
                g.logits = self._forward(g)  # builds the backend's plan into g.meta, as the warm-up below does
                self.graphs[size] = g
                continue
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                warm = self._forward(g)  # compiles the kernels and fills g.meta.plan_cache outside the graph
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self.logits_out is None:  # the largest size comes first
                self.logits_out = torch.empty(size, warm.shape[1], dtype=warm.dtype, device=self.device)
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                self.logits_out[:size].copy_(self._forward(g))
            g.logits = self.logits_out[:size]
            g.graph = graph
            self.graphs[size] = g
        rotary = getattr(self.model, "rotary", None)
        if rotary is not None:
            self._captured_tables.append(rotary.table)
        if self.capture:
            torch.cuda.synchronize(self.device)

    def size_for(self, arrays: StepArrays) -> int | None:
        """The captured size this step replays at, or None: not decode-only, too many sequences, logits asked of
        other rows than one per sequence, or a context / block table beyond what the buffers hold."""
        n = len(arrays.seq_lens)
        if n == 0 or n > self.max_size or arrays.max_query_len != 1 or len(arrays.input_ids) != n:
            return None
        width = np.asarray(arrays.block_tables).reshape(n, -1).shape[1]
        if arrays.max_seq_len > self.max_model_len or width > self.width:
            return None
        if len(arrays.logits_indices) != n or not np.array_equal(arrays.logits_indices, np.arange(n)):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def stage(self, arrays: StepArrays, size: int) -> None:
        """Copy a step's arrays into the static buffers, padding rows n..size (asynchronous on CUDA)."""
        n = len(arrays.seq_lens)
        if self._copied is not None:
            self._copied.synchronize()
        h = {name: t.numpy() for name, t in self._host.items()}
        for name, src, pad in (("input_ids", arrays.input_ids, 0), ("positions", arrays.positions, 0),
                               ("slot_mapping", arrays.slot_mapping, -1), ("seq_lens", arrays.seq_lens, 1),
                               ("context_lens", arrays.context_lens, 0)):
            h[name][:n] = src
            h[name][n:size] = pad
        bt = np.asarray(arrays.block_tables).reshape(n, -1)
        m = max(1, bt.shape[1])
        host_bt = self._host_bt[: size * m].view(size, m)
        table = host_bt.numpy()
        table[:n, : bt.shape[1]] = bt
        table[:n, bt.shape[1]:] = 0
        table[n:] = 0
        nb = self._copied is not None
        for name, t in self._host.items():
            getattr(self, name)[:size].copy_(t[:size], non_blocking=nb)
        # Columns past m keep older ids: a sequence reads only the blocks its length covers (all within m).
        self.block_tables[:size, :m].copy_(host_bt, non_blocking=nb)
        if self._copied is not None:
            self._copied.record()

    def replay(self, size: int, n: int) -> torch.Tensor:
        """Run the staged step; logits [n, vocab] (float32), a copy: the next replay rewrites the graph's output."""
        g = self.graphs[size]
        if g.graph is not None:
            g.graph.replay()
            assert g.logits is not None
            out = g.logits
        else:
            out = self._forward(g)
        self.replays += 1
        with torch.inference_mode():
            return out[:n].clone()

    def run(self, arrays: StepArrays) -> torch.Tensor | None:
        """Logits of a decode step through its graph, or None when the step does not fit one (run it eager)."""
        size = self.size_for(arrays)
        if size is None:
            return None
        self.stage(arrays, size)
        return self.replay(size, len(arrays.seq_lens))
