"""Type stubs for ``ironlm._core``, the Rust bookkeeping core (see rust/src/py.rs).

Times are seconds as floats. Unless a ``now`` is passed, the core uses its own monotonic
clock (``ironlm._core.monotonic()``), so Python and Rust agree on time.
"""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__version__: str

class CoreError(Exception):
    """Base class of every error raised by the core (also: no free block, misuse of state).

    Bad argument values raise ``ValueError`` naming the argument; wrong types ``TypeError``.
    """

class QueueFullError(CoreError):
    """The waiting queue already holds ``max_queue_len`` requests (the server answers 503)."""

class RequestTooLargeError(CoreError, ValueError):
    """prompt + max_tokens can never fit: beyond ``max_model_len`` or the whole KV cache."""

class DuplicateRequestError(CoreError, ValueError):
    """A request with this id is already in the core."""

def monotonic() -> float:
    """The core's clock, in seconds."""

def paged_decode_attention(
    q: npt.NDArray[np.float32],
    k_cache: npt.NDArray[np.float32],
    v_cache: npt.NDArray[np.float32],
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    scale: float,
    out: npt.NDArray[np.float32],
    threads: int = 1,
) -> None:
    """Decode attention on the CPU, reading the paged cache in place (the ``cpu`` attention backend).

    ``out[i, h] = softmax(q[i, h] . K_i^T * scale) V_i`` over the first ``seq_lens[i]`` positions of sequence
    ``i``, whose pages are ``block_tables[i]``. q/out ``[n, Hq, D]``; caches ``[num_blocks, block_size, Hkv,
    D]``; query head ``h`` reads KV head ``h // (Hq // Hkv)``. All C-contiguous. Runs with the GIL released on
    up to ``threads`` threads (torch's OpenMP pool when torch is loaded). Raises ``ValueError`` naming the
    argument for any shape, dtype, block id or length it cannot follow."""

def parallel_runtime() -> str:
    """Where the CPU kernels run their threads: ``"openmp"`` (the pool of the OpenMP runtime torch links, found
    among the loaded libraries) or ``"threads"`` (their own scoped threads)."""

def quant_isas() -> tuple[str, list[str]]:
    """The SIMD path ``QuantMatrix.matmul`` picks on this CPU, and all paths it can run (``"scalar"``, ``"avx2"``,
    ``"avx_vnni"``, ``"avx512_vnni"``)."""

class QuantMatrix:
    """A weight matrix ``[rows, cols]`` (``[out_features, in_features]``) kept block-quantized: every 32 weights of
    a row are ``scale * q + min``, ``q`` 8- or 4-bit unsigned. ``matmul`` quantizes ``x`` to int8 per 32-block and runs
    integer dot products (AVX-512 VNNI / AVX-VNNI / AVX2 / scalar); its only error beyond f32 rounding is that
    activation rounding, at most ``amax(x_block) / 254 * sum(|w_block|)`` per block."""

    @staticmethod
    def from_ggml(raw: npt.NDArray[np.uint8], ggml_type: int, rows: int, cols: int) -> QuantMatrix:
        """From a GGUF tensor's raw bytes: Q4_0 (2), Q4_1 (3), Q4_K (12) exactly as 4-bit; Q8_0 (8), Q5_K (13)
        exactly and Q6_K (14) within 1/8 of its step as 8-bit. ``cols`` is ggml's first dimension."""
    @staticmethod
    def from_float(weight: npt.NDArray[np.float32], bits: int = 8, group_size: int = 0) -> QuantMatrix:
        """Round-to-nearest: 8 bits symmetric, 4 bits asymmetric, one scale per ``group_size`` weights of a row (a
        multiple of 32 dividing ``cols``; 0 = per output channel)."""
    @staticmethod
    def concat(parts: Sequence[QuantMatrix]) -> QuantMatrix:
        """The rows of ``parts`` stacked (q, k, v into one qkv matrix; gate and up into one): one matmul then
        quantizes the activations once. q4 parts widen to q8 losslessly when any part is q8 (e.g. Q4_K q/k with a
        Q6_K v)."""
    def matmul(
        self,
        x: npt.NDArray[np.float32],
        out: npt.NDArray[np.float32] | None = None,
        accumulate: bool = False,
        bias: npt.NDArray[np.float32] | None = None,
        threads: int = 1,
        isa: str | None = None,
    ) -> npt.NDArray[np.float32]:
        """``out[m, rows] = x[m, cols] @ W^T (+ bias)``, or ``out += ...`` with ``accumulate`` (the residual add);
        C-contiguous float32 arrays (``tensor.numpy()`` views work in place). Returns ``out`` (a new array when
        ``None``). Runs on torch's OpenMP pool with ``threads`` parts, GIL released."""
    def gather(
        self, ids: npt.NDArray[np.int64] | Sequence[int], out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """Rows ``ids`` dequantized into ``out [len(ids), cols]`` (new when ``None``): the embedding lookup of a
        quantized (e.g. tied) table. Returns ``out``."""
    def dequantize(self, out: npt.NDArray[np.float32 | np.int16] | None = None, threads: int = 1) -> npt.NDArray:
        """The weights ``[rows, cols]``: a new float32 array, or into ``out`` (float32, or int16/uint16 receiving bf16
        bits rounded to nearest even: ``bf16_tensor.view(torch.int16).numpy()``) on ``threads`` parts. Returns the
        array written. The large-batch fallback (a dense bf16 mm beats int8 dot products on AMX CPUs from M ~ 32)."""
    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed weights: 5 bits a weight for q4 and 9 for q8 when every scale and min is
        exactly an f16 (Q4_0, Q4_1, Q8_0 files), else 6 and 10 (f32 scales)."""
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def kind(self) -> str:
        """``"q8"`` or ``"q4"``."""

class BlockAllocator:
    """Fixed pool of KV blocks with reference counts, fork and copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    def allocate(self) -> int:
        """One free block with ref count 1; raises ``CoreError`` when none is free."""
    def incref(self, block: int) -> None: ...
    def decref(self, block: int) -> None:
        """Drop one reference; ``ValueError`` if the block has none."""
    def ref_count(self, block: int) -> int: ...
    def is_cached(self, block: int) -> bool:
        """Held by a radix cache (kept when its ref count drops to 0)."""
    def fork(self, blocks: Sequence[int]) -> list[int]:
        """Share ``blocks`` with a new holder (each ref count + 1); returns the same ids."""
    def free_all(self, blocks: Sequence[int]) -> None:
        """Drop one holder's reference on each of ``blocks`` (in reverse order)."""
    def append_slot(self, blocks: list[int], num_tokens: int) -> tuple[list[int], tuple[int, int] | None]:
        """Make room for token number ``num_tokens`` (0-based) of a sequence owning ``blocks``.

        Returns the updated block list and, when the last block was shared and partly
        filled, the ``(src, dst)`` copy-on-write pair the caller must copy on the KV tensors.
        """

class RadixCache:
    """Block-granular radix tree over token ids with LRU eviction of unlocked leaves."""

    def __init__(self, allocator: BlockAllocator) -> None: ...
    @property
    def allocator(self) -> BlockAllocator: ...
    def match_prefix(self, tokens: Sequence[int], namespace: str | None = None) -> list[int]:
        """Blocks caching the longest block-aligned prefix of ``tokens``, never all of it.

        Counts toward ``queries``/``hits``. Takes no reference: ``incref`` what you keep.
        """
    def insert(self, tokens: Sequence[int], blocks: Sequence[int], namespace: str | None = None) -> int:
        """Cache the full blocks of ``tokens``; returns how many tokens were already cached.

        Already-cached positions keep their cached block (the caller's copy is not taken).
        """
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` least-recently-used unlocked cached blocks; returns how many."""
    def reset(self) -> bool:
        """Drop every cached block; True if the tree is now empty."""
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_evictable_blocks(self) -> int: ...
    @property
    def queries(self) -> int:
        """Prompt tokens looked up so far."""
    @property
    def hits(self) -> int:
        """Prompt tokens found cached so far."""

class RequestQueue:
    """Waiting requests under one policy: ``fcfs``, ``priority`` or ``deadline``.

    ``fcfs``: by arrival. ``priority``: lower value first, then arrival. ``deadline``: requests
    with a deadline first, earliest (arrival + deadline) first; the rest by arrival.
    Push, pop and remove are O(log n); ``expire`` touches only the expired.
    """

    def __init__(self, policy: str = "fcfs", max_len: int | None = None) -> None: ...
    @property
    def policy(self) -> str: ...
    @property
    def max_len(self) -> int | None: ...
    def push(
        self,
        request_id: str,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. ``deadline`` and ``timeout`` are seconds after ``arrival_time``
        (default: now). Raises QueueFullError, DuplicateRequestError or ValueError."""
    def pop(self) -> str | None: ...
    def peek(self) -> str | None: ...
    def remove(self, request_id: str) -> bool: ...
    def expire(self, now: float | None = None) -> list[str]:
        """Remove and return the requests whose timeout has passed (``now > arrival + timeout``)."""
    def to_list(self) -> list[str]:
        """Queued ids in policy order."""
    def __len__(self) -> int: ...
    def __contains__(self, request_id: str) -> bool: ...

class SchedulerPlan:
    """Everything the model runner needs for one step. Arrays are freshly built numpy arrays.

    Rows of the token batch (length T) are grouped by sequence in batch order (length B).
    """

    input_ids: npt.NDArray[np.int64]  # [T]
    positions: npt.NDArray[np.int64]  # [T]
    slot_mapping: npt.NDArray[np.int64]  # [T] block * block_size + offset
    block_tables: npt.NDArray[np.int32]  # [B, max_blocks_in_batch], padded with 0
    query_start_loc: npt.NDArray[np.int64]  # [B + 1] cumulative query lengths
    seq_lens: npt.NDArray[np.int64]  # [B] context length after this step (cached + computed + new)
    context_lens: npt.NDArray[np.int64]  # [B] tokens already in the KV cache before this step
    seq_slots: npt.NDArray[np.int64]  # [B] sequence handle of each batch row
    logits_indices: npt.NDArray[np.int64]  # [S] token rows whose logits are sampled (may repeat for n > 1)
    sample_slots: npt.NDArray[np.int64]  # [S] sequence handle receiving each sampled token
    cow_pairs: npt.NDArray[np.int64]  # [K, 2] (src, dst) block copies to run before the forward
    new_request_ids: list[str]  # admitted for the first time this step
    preempted_request_ids: list[str]  # sent back to the queue this step (recompute)
    finished: list[tuple[str, int, str]]  # (request id, seq slot, reason) e.g. timed out while waiting
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache for requests admitted this step
    max_query_len: int
    max_seq_len: int
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_samples(self) -> int:
        """``len(sample_slots)``."""
    @property
    def is_empty(self) -> bool:
        """No token to compute (``finished`` / ``preempted_request_ids`` may still be set)."""

class Scheduler:
    """Continuous-batching scheduler owning the queue, the allocator and the radix cache.

    Per step: ``plan = schedule()``, run the model on the plan's arrays (copy ``cow_pairs``
    first), ``update(sampled)``. Calling ``schedule()`` again without ``update()`` treats the
    un-updated plan as lost: its sequences are preempted (recompute) and reported in
    ``preempted_request_ids``. Steps with >= 256 running sequences release the GIL.
    Requires ``max_num_batched_tokens >= max_num_seqs`` (each running sequence gets a token
    every step).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 4096,
        policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        max_queue_len: int | None = None,
    ) -> None: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.int64],
        max_tokens: int,
        *,
        min_tokens: int = 0,
        n: int = 1,
        priority: int = 0,
        eos_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        deadline: float | None = None,
        timeout: float | None = None,
        namespace: str | None = None,
        arrival_time: float | None = None,
    ) -> list[int]:
        """Queue a request; returns its ``n`` sequence slots (stable handles until finished).

        ``deadline``: TTFT deadline, seconds after arrival (policy ``deadline``).
        ``timeout``: seconds after arrival after which a still-waiting request finishes
        with reason ``timeout``. Raises QueueFullError, RequestTooLargeError (prompt +
        max_tokens beyond ``max_model_len`` or the whole cache, or ``n > max_num_seqs``),
        DuplicateRequestError or ValueError.
        """
    def schedule(self, now: float | None = None) -> SchedulerPlan:
        """Plan the next step; waiting requests past their timeout finish first (``plan.finished``)."""
    def update(self, sampled_token_ids: npt.NDArray[np.int64] | Sequence[int]) -> list[tuple[str, int, str]]:
        """Append one token per ``plan.sample_slots`` row of the last plan.

        Applies max_tokens, min_tokens (no EOS / stop-token stop before it), EOS (unless
        ignore_eos), stop_token_ids (always) and max_model_len; returns ``(request id, seq
        slot, reason)`` for each sequence that finished (reason ``length`` or ``stop``).
        Finished sequences' blocks go to the radix cache. Rows of sequences finished or
        aborted since the plan are ignored. ValueError if the length is not
        ``plan.num_samples`` or no plan is waiting for an update.
        """
    def finish(self, slot: int, reason: str = "stop") -> bool:
        """Finish one sequence now (e.g. a stop string matched); frees its blocks.

        False if the slot holds no live sequence. Finishing the parent of an ``n > 1``
        request before its first token hands the prefill over to a sibling.
        """
    def abort(self, request_id: str) -> bool:
        """Drop a request (all its sequences) wherever it is; frees its blocks."""
    def output_token_ids(self, slot: int) -> list[int]:
        """Generated tokens of a sequence: live, or finished and its slot not reused yet
        (slots are reused by ``add_request``). ValueError for a slot never handed out."""
    def token_ids(self, slot: int) -> list[int]:
        """Prompt + generated tokens (same validity as ``output_token_ids``)."""
    def request_id(self, slot: int) -> str | None:
        """Request id of a live sequence, else None."""
    def has_unfinished(self) -> bool: ...
    def __contains__(self, request_id: str) -> bool: ...
    def reset_prefix_cache(self) -> bool:
        """Drop every unlocked cached block; False if some are still in use."""
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_slots(self) -> int:
        """Slots handed out so far (highest slot + 1): size per-slot tables with it."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    def stats(self) -> dict[str, int]:
        """Counters without a scan: num_waiting, num_running, num_preemptions, num_timeouts,
        prefix_queries, prefix_hits, blocks_total, blocks_free, blocks_used, blocks_cached,
        num_aborted, num_finished, num_steps, num_requests.

        num_preemptions counts sequences; num_timeouts and num_aborted count requests;
        num_finished counts sequences finished by a stop rule or ``finish``; blocks_used are
        held by sequences, blocks_cached only by the prefix cache (evictable)."""
