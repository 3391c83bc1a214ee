"""Type stubs for ``ironlm._core``, the Rust bookkeeping core (see rust/src/py.rs).

Times are seconds as floats. Unless a ``now`` is passed, the core uses its own monotonic
clock (``ironlm._core.monotonic()``), so Python and Rust agree on time.
"""

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, final

from ironlm.config import SchedulerConfig

__version__: str

class CoreError(Exception):
    """Base class of every error raised by the core (also: no free block, misuse of state).

    Bad argument values raise ``InvalidArgumentError`` (a ``ValueError``, not a ``CoreError``) naming the
    argument in ``param``; wrong types ``TypeError``.
    """

class QueueFullError(CoreError):
    """The waiting queue already holds ``max_queue_len`` requests (the server answers 503)."""

class RequestTooLargeError(CoreError, ValueError):
    """prompt + max_tokens can never fit: beyond ``max_model_len`` or the whole KV cache."""

class DuplicateRequestError(CoreError, ValueError):
    """A request with this id is already in the core."""

class InvalidArgumentError(ValueError):
    """A bad argument value; ``param`` names the argument (e.g. ``max_tokens``) or is None.

    Raised by the core for every bad argument value (messages read ``"{param}: {reason}"``) and by the
    Python-side checks (SamplingParams, EngineConfig, add_request). Not a ``CoreError``.
    """

    param: str | None
    def __init__(self, message: str, param: str | None = None) -> None: ...

class GrammarError(InvalidArgumentError):
    """A structured-output grammar (JSON schema, regex, choice, Lark) that does not compile, or not within its
    size and time limits. ``param`` names the request field, ``structured_outputs`` by default."""

    def __init__(self, message: str, param: str | None = "structured_outputs") -> None: ...

@final
class CompiledGrammar:
    """A grammar compiled for one tokenizer; pass it to ``Scheduler.add_request(grammar=...)``.
    Immutable and shared: any number of requests may use the same one."""

    @property
    def mask_words(self) -> int:
        """32-bit words per row of its token bitmask (``ceil(vocab_size / 32)``)."""
    @property
    def size_bytes(self) -> int:
        """Estimated memory it holds, in bytes (its lexer tables after the first mask)."""

@final
class GrammarCompiler:
    """Compiles structured-output grammars for one tokenizer; build it once per model."""

    def __new__(
        cls,
        token_bytes: list[bytes | None],
        *,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        special_token_ids: Sequence[int] | None = None,
        timeout: float = 10.0,
        max_grammar_size: int | None = None,
        initial_lexer_fuel: int | None = None,
        step_lexer_fuel: int | None = None,
        max_lexer_states: int | None = None,
        max_threads: int | None = None,
        max_grammar_bytes: int | None = None,
        max_schema_depth: int | None = None,
        max_object_properties: int | None = None,
        max_pattern_pairs: int | None = None,
        max_lark_depth: int | None = None,
    ) -> Self:
        """``token_bytes[id]``: the token's bytes (None: no text, never allowed); ids up to ``vocab_size`` (the
        logits width) past the list have none. ``special_token_ids`` are produced only by grammars that name them.
        The limits bound each compilation (None: the defaults): ``max_threads`` compile threads alive at once
        (abandoned ones too), ``max_grammar_bytes`` per compiled grammar, and the input's shape
        (``max_schema_depth``: values on the longest path through nesting and ``$ref`` chains;
        ``max_object_properties``; ``max_pattern_pairs``: ``patternProperties`` regex pairs; ``max_lark_depth``:
        Lark rule reference chain)."""
    def compile(self, text: str, *, param: str = "structured_outputs") -> CompiledGrammar:
        """Compile grammar text (llguidance's TopLevelGrammar JSON, or a Lark grammar) with the GIL released.
        Raises ``GrammarError`` (``.param`` = ``param``) if it does not compile within the limits,
        ``QueueFullError`` if every compile thread stayed busy for the timeout."""
    @property
    def live_threads(self) -> int:
        """Compile threads alive now, counting those whose caller timed out."""
    @property
    def vocab_size(self) -> int:
        """The logits width its masks cover."""

def monotonic() -> float:
    """The core's clock, in seconds."""

# Float arrays of the CPU kernels: float32 values, or the int16 bits of a bfloat16 / float16 tensor
# (``t.view(torch.int16).numpy()``: numpy has no bfloat16), read as ``dtype`` says.
_Floats: TypeAlias = npt.NDArray[np.float32] | npt.NDArray[np.int16]

def paged_decode_attention(
    q: _Floats,
    k_cache: _Floats,
    v_cache: _Floats,
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    scale: float,
    out: _Floats,
    threads: int = 1,
    *,
    dtype: str = "float32",
    k: _Floats | None = None,
    v: _Floats | None = None,
    slot_mapping: npt.NDArray[np.int64] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: npt.NDArray[np.float32] | None = None,
    cache_dtype: str | None = None,
) -> None:
    """Decode attention on the CPU, reading the paged cache in place (the ``cpu`` attention backend).

    ``out[i, h] = softmax(q[i, h] . K_i^T * scale) V_i`` over the first ``seq_lens[i]`` positions of sequence
    ``i``, whose pages are ``block_tables[i]``. q/out ``[n, Hq, D]`` (q's rows may be strided, as views into a
    fused q|k|v row); caches ``[num_blocks, block_size, Hkv, D]``; query head ``h`` reads KV head
    ``h // (Hq // Hkv)``. ``dtype`` is float32, bfloat16 or float16 for every float array but the caches, whose
    type is ``cache_dtype`` (None: ``dtype``; bfloat16 or float16 under float32; float8_e4m3fn or float8_e5m2,
    as uint8 views of their codes, under float32 or bfloat16); the math is f32.
    With ``k``/``v`` (``[n, Hkv, D]``, rows may be strided) and ``slot_mapping`` (-1 = skip) those rows are first
    written into the caches. With ``window`` (sliding-window attention) sequence ``i`` attends only its last
    ``window`` positions. With ``softcap`` each logit ``x`` becomes ``softcap * tanh(x / softcap)`` before the
    softmax (Gemma 2). With ``sinks`` (``[Hq]`` float32, gpt-oss's attention sinks) head ``h``'s softmax
    denominator gains ``exp(sinks[h])``, a term with no value row. Runs with the GIL released on up to ``threads`` threads (torch's OpenMP pool when
    torch is loaded). Raises ``InvalidArgumentError`` naming the argument for any shape, dtype, block id or
    length it cannot follow."""

def prefill_attention(
    q: _Floats,
    k: _Floats,
    v: _Floats,
    context_len: int,
    scale: float,
    out: _Floats,
    threads: int = 1,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
) -> None:
    """Causal attention of one sequence's prefill chunk in bfloat16 numerics (the ``cpu`` backend's prefill).

    ``out[i, h] = softmax(q[i, h] . K^T * scale) V`` over keys ``0..context_len + i``: q ``[n, Hq, D]``, k
    ``[S, Hkv, D]``, v ``[S, Hkv, Dv]`` with ``S = context_len + n`` keys in position order (rows may be
    strided, as views into a fused q|k|v row), out ``[n, Hq, Dv]`` C-contiguous. q and out are ``dtype``, k
    and v ``kv_dtype`` (default ``dtype``), each ``"float32"`` or ``"bfloat16"`` (the int16 bits of a
    bfloat16 tensor); float32 inputs are rounded to bf16 as they are read and a float32 output holds the
    bf16-rounded result. Scores and softmax in f32, the probabilities rounded to bf16 for the weighted
    sum (f32 accumulation), as SDPA's bf16 path. Runs with the GIL released on up to ``threads`` threads;
    fast only where ``prefill_attention_serves(D, Dv)``. Raises ``InvalidArgumentError`` naming the argument
    for a shape or stride it cannot follow."""

def prefill_attention_serves(head_dim: int, v_dim: int) -> bool:
    """Whether ``prefill_attention`` runs these head dims on its AVX-512 BF16 tiles on this CPU."""

def decode_attention_qkv(
    qkv: _Floats,
    k_cache: _Floats,
    v_cache: _Floats,
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    slot_mapping: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    rope_table: _Floats | None,
    scale: float,
    out: _Floats,
    num_q_heads: int,
    dtype: str = "float32",
    threads: int = 1,
    window: int | None = None,
    *,
    q_norm: _Floats | None = None,
    k_norm: _Floats | None = None,
    eps: float = 1e-6,
    softcap: float | None = None,
    cache_dtype: str | None = None,
) -> None:
    """One layer's decode attention from its fused projection output ``qkv`` ``[n, (Hq + 2 Hkv) * D]``: with
    ``q_norm`` and ``k_norm`` the qk-norm of ``qk_norm_inplace``, then RoPE on q and k (neox style, cos|sin rows of
    ``rope_table`` ``[P, D]`` at ``positions``; None = no positional encoding), k and v written at
    ``slot_mapping`` (-1 = skip; rounded to ``cache_dtype`` as in ``paged_decode_attention``), then ``out``
    ``[n, Hq * D]`` = paged attention as in ``paged_decode_attention`` (``window``, ``softcap`` likewise). Nothing is written when an argument is bad (``InvalidArgumentError`` naming
    it)."""

def rms_norm(x: _Floats, weight: _Floats | None, eps: float, out: _Floats, dtype: str = "float32",
             threads: int = 1) -> None:
    """``out = x / sqrt(mean(x^2, -1) + eps) * weight`` over the last axis (``weight`` None = ones), statistics
    in f32. ``x``/``out`` C-contiguous, same shape."""

def residual_add(x: _Floats, h: _Floats, norm: bool = False, weight: _Floats | None = None, eps: float = 1e-6,
                 scale: float | None = None, dtype: str = "float32", threads: int = 1) -> None:
    """``h += [scale *] [rms_norm(] x [, weight, eps)]`` in place over the last axis (``norm`` False: no norm;
    ``weight`` None = ones), each step rounded to ``dtype`` as the separate ops are. ``x``/``h`` C-contiguous, same
    size; ``weight`` only with ``norm``."""

def rope_inplace(x: _Floats, positions: npt.NDArray[np.int64], table: _Floats, heads: int, head_dim: int,
                 dtype: str = "float32", threads: int = 1) -> None:
    """Rotate (neox rotate-half) the first ``heads`` heads of ``head_dim`` of every row of ``x`` ``[rows, width]``
    in place, by the cos|sin row of ``table`` ``[P, head_dim]`` at that row's position."""

def silu_and_mul(gate_up: _Floats, out: _Floats, dtype: str = "float32", threads: int = 1) -> None:
    """``out = silu(gate) * up`` for ``gate_up = [gate | up]`` along the last axis (``out`` has half its width)."""

def gelu_tanh_and_mul(gate_up: _Floats, out: _Floats, dtype: str = "float32", threads: int = 1) -> None:
    """``out = gelu_tanh(gate) * up`` (GeGLU; torch's ``gelu(approximate="tanh")``) for ``gate_up = [gate | up]``
    along the last axis (``out`` has half its width)."""

def qk_norm_inplace(x: _Floats, q_weight: _Floats, k_weight: _Floats, eps: float, q_width: int, k_width: int,
                    dtype: str = "float32") -> None:
    """RMSNorm in place of the q part (first ``q_width`` elements) and the k part (next ``k_width``) of every row
    of ``x`` ``[rows, width]``, in groups of the weights' lengths (a head, or the whole part), each group as
    ``rms_norm`` computes a row."""

def cpu_features() -> list[str]:
    """SIMD features of this CPU that the OS enables, in ``/proc/cpuinfo`` spelling (e.g. ``avx512_bf16``,
    ``amx_bf16``); the kernels dispatch on them and ``dtype="auto"`` reads them."""

def parallel_runtime() -> str:
    """Where the CPU kernels run their threads: ``"openmp"`` (the pool of the OpenMP runtime torch links, found
    among the loaded libraries) or ``"threads"`` (their own scoped threads)."""

def quant_isas() -> tuple[str, list[str]]:
    """The SIMD path ``QuantMatrix.matmul`` picks on this CPU, and all paths it can run (``"scalar"``, ``"avx2"``,
    ``"avx_vnni"``, ``"avx512_vnni"``)."""

def quant_prefetch(near: int | None = None, far: int | None = None) -> tuple[int, int]:
    """How far ahead (bytes) the quantized x86 tiles prefetch their weights into L2: ``near`` for tiles of 1-2
    activation rows, ``far`` for 3 or more; 0 turns one off. Sets each one given first (process-wide; benches flip
    them to compare both ways under one memory load). Returns the ``(near, far)`` in force."""

def dense_matmul(x: _Floats, weight: _Floats, out: _Floats, accumulate: bool = False,
                 bias: npt.NDArray[np.float32] | None = None, dtype: str = "float32", threads: int = 1,
                 isa: str | None = None) -> None:
    """``out = x @ weight (+ bias)`` (``+=`` with ``accumulate``) for ``x [m, k]``, ``weight [k, n]`` either
    C-contiguous or the transpose of a C-contiguous ``[n, k]``, ``out [m, n]``; f32 accumulation, one rounding to
    ``dtype``. Each row's result is independent of ``m`` and ``threads``. Streams the weights once: for small m."""

def dense_isas() -> tuple[str, list[str]]:
    """The SIMD path ``dense_matmul`` picks on this CPU, and all paths it can run (``"scalar"``, ``"avx2"``,
    ``"avx512"``, ``"avx512_bf16"``)."""

@final
class PackedBf16:
    """A bf16 weight ``[k, n]`` repacked once in ``vdpbf16ps`` pair order, for decode batches of a few to a few dozen
    rows; ``matmul`` gives ``dense_matmul``'s ``avx512_bf16`` bits, independent of ``m`` and ``threads``."""

    def __new__(cls, weight: npt.NDArray[np.int16]) -> Self:
        """Packs ``weight``, the int16 bits of a C-contiguous bf16 ``[k, n]`` (``tensor.view(torch.int16)``)."""
    @staticmethod
    def available() -> bool:
        """Whether this CPU runs ``matmul`` (AVX-512 BF16)."""
    @property
    def k(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy."""
    def matmul(self, x: npt.NDArray[np.int16], out: npt.NDArray[np.int16], accumulate: bool = False,
               bias: npt.NDArray[np.float32] | None = None, threads: int = 1) -> None:
        """``out [m, n] = x [m, k] @ weight (+ bias)``, ``+=`` with ``accumulate`` (the residual add), f32 sums
        rounded once; ``x`` and ``out`` the int16 bits of C-contiguous bf16 arrays. GIL released."""

@final
class PackedF32:
    """An f32 weight ``[k, n]`` repacked once in 16-column groups, for one- and two-row decode calls (AVX2 + FMA);
    ``matmul`` gives ``dense_matmul``'s f32 bits on the same vector width, independent of ``m`` and ``threads``."""

    def __new__(cls, weight: npt.NDArray[np.float32]) -> Self:
        """Packs ``weight``, a C-contiguous f32 ``[k, n]``."""
    @staticmethod
    def available() -> bool:
        """Whether this CPU runs ``matmul`` (AVX2 and FMA)."""
    @property
    def k(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy."""
    def matmul(self, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], accumulate: bool = False,
               bias: npt.NDArray[np.float32] | None = None, threads: int = 1) -> None:
        """``out [m, n] = x [m, k] @ weight (+ bias)``, ``+=`` with ``accumulate`` (the residual add); C-contiguous
        f32 arrays. GIL released."""

@final
class QuantMatrix:
    """A weight matrix ``[rows, cols]`` (``[out_features, in_features]``) kept block-quantized: every 32 weights of
    a row are ``scale * q + min``, ``q`` 8- or 4-bit unsigned. ``matmul`` quantizes ``x`` to int8 per 32-block and runs
    integer dot products (AVX-512 VNNI / AVX-VNNI / AVX2 / scalar); its only error beyond f32 rounding is that
    activation rounding, at most ``amax(x_block) / 254 * sum(|w_block|)`` per block."""

    @staticmethod
    def from_ggml(raw: npt.NDArray[np.uint8], ggml_type: int, rows: int, cols: int) -> QuantMatrix:
        """From a GGUF tensor's raw bytes: Q4_0 (2), Q4_1 (3), Q4_K (12) exactly as 4-bit; Q8_0 (8), Q5_K (13)
        exactly as 8-bit; Q6_K (14) exactly as its own blocks (``"q6k"``, 6.5625 bits a weight); MXFP4 (39) exactly
        as kind ``"mxfp4"`` (E2M1 codes read through a table, E8M0 scales: 4.25 bits a weight). ``cols`` is ggml's
        first dimension."""
    @staticmethod
    def from_float(weight: npt.NDArray[np.float32], bits: int = 8, group_size: int = 0) -> QuantMatrix:
        """Round-to-nearest: 8 bits symmetric, 4 bits asymmetric, one scale per ``group_size`` weights of a row (a
        multiple of 32 dividing ``cols``; 0 = per output channel)."""
    @staticmethod
    def from_parts(
        q: npt.NDArray[np.uint8], scales: npt.NDArray[np.float32], mins: npt.NDArray[np.float32], bits: int
    ) -> QuantMatrix:
        """From already-quantized parts (pre-quantized checkpoints, unpacked): ``q`` ``[rows, cols]`` (``<= 15`` for
        ``bits`` 4, any uint8 for 8), ``scales`` and ``mins`` ``[rows, cols / 32]``: ``w = scale * q + min`` per
        32-block, stored exactly (f16 scales and mins when all are f16s, else f32)."""
    @staticmethod
    def concat(parts: Sequence[QuantMatrix]) -> QuantMatrix:
        """The rows of ``parts`` stacked (q, k, v into one qkv matrix; gate and up into one): one matmul then
        quantizes the activations once. q4 parts widen to q8 losslessly when any part is q8; q6k parts stay q6k among
        themselves and are re-rounded into q8 (within 1/8 of their step) beside other kinds (e.g. Q4_K q/k with a
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
        exactly an f16 (Q4_0, Q4_1, Q8_0 files), else 6 and 10 (f32 scales); 4.5 and 8.5 when the mins are implied
        (Q4_0, Q8_0); 6.5625 for q6k (Q6_K files); 4.25 for mxfp4."""
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def kind(self) -> str:
        """``"q8"``, ``"q4"``, ``"q6k"`` or ``"mxfp4"``."""

@final
class LeanLayer:
    """One Llama-shaped layer of a ``LeanStack``: its pre-norms ``input_norm`` and ``post_norm`` (float32
    ``[hidden]`` views, or the bf16 bits of a bf16 stack's, read at each step), the ``qkv`` and ``o`` weights
    (handles, not copies: every one a ``QuantMatrix`` or ``PackedF32``, float32 rows, or every one a
    ``PackedBf16``, bf16 rows), the MLP's ``gate_up`` and ``down`` or its ``moe`` (float32 rows only) = (experts, router ``[hidden, experts]``, router bias or None,
    (scoring, top_k, renormalize, renorm_eps, scaling)) with scoring ``"softmax"``, ``"sigmoid"`` or
    ``"topk_softmax"`` (every expert held: no expert parallelism), optional float32 biases of qkv, o, gate_up and
    down, optional q and k norm weights, the index of its rotary table in ``LeanStack.run``'s ``tables`` (None:
    NoPE), its sliding ``window``, logit ``softcap``, attention ``scale``, query heads, the norms' ``eps`` and a dense
    MLP's activation (``"silu"`` or ``"gelu_tanh"``)."""

    def __new__(
        cls,
        *,
        input_norm: _Floats,
        post_norm: _Floats,
        qkv: QuantMatrix | PackedBf16 | PackedF32,
        o: QuantMatrix | PackedBf16 | PackedF32,
        gate_up: QuantMatrix | PackedBf16 | PackedF32 | None = None,
        down: QuantMatrix | PackedBf16 | PackedF32 | None = None,
        moe: tuple[
            MoeExperts,
            npt.NDArray[np.float32],
            npt.NDArray[np.float32] | None,
            tuple[str, int, bool, float, float],
        ]
        | None = None,
        biases: tuple[
            npt.NDArray[np.float32] | None,
            npt.NDArray[np.float32] | None,
            npt.NDArray[np.float32] | None,
            npt.NDArray[np.float32] | None,
        ]
        | None = None,
        qk_norm: tuple[_Floats, _Floats] | None = None,
        rotary: int | None = None,
        window: int | None = None,
        softcap: float | None = None,
        scale: float,
        num_heads: int,
        eps: float,
        activation: str = "silu",
    ) -> Self: ...

@final
class LeanStack:
    """A model's layers as one decode step per call (float32 rows over block-quantized or packed f32 weights, or
    bf16 rows over packed bf16 weights): per layer the
    pre-norm, q|k|v, ``decode_attention_qkv``'s qk-norm, RoPE, cache write and paged attention, o with the residual
    add, the MLP's norm, then gate_up, the gated activation and down with the residual add (the kernels the
    per-layer lean step calls, in its order and with its bits), or the router, the top-k choice and
    ``MoeExperts``' kernel added to the residual; the GIL released once."""

    def __new__(cls, layers: Sequence[LeanLayer], hidden: int) -> Self: ...
    def __len__(self) -> int: ...
    @property
    def dtype(self) -> str:
        """The rows every layer takes: ``"float32"`` or ``"bfloat16"`` (over ``PackedBf16`` weights)."""
    def run(
        self,
        h: _Floats,
        caches: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
        block_tables: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
        slots: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        tables: Sequence[_Floats],
        threads: int = 1,
        cache_dtype: str = "float32",
    ) -> list[int]:
        """Every layer over the residual stream ``h`` ``[t, hidden]`` in place; layer ``i`` writes the step's K/V
        rows into ``caches[i] = (k, v)`` (``[blocks, block_size, Hkv, D]`` of ``cache_dtype``, 16-bit ones as int16
        views of their bits, 8-bit ones as uint8) and attends them. ``block_tables`` ``[t, max_blocks]`` and
        ``seq_lens`` int32, ``slots`` and ``positions`` int64, one row per token; ``tables`` the rotary tables the
        layers name. Returns the expert weight bytes each layer streamed (0 for a dense MLP)."""

def moe_route(
    x: npt.NDArray[np.float32],
    router: npt.NDArray[np.float32],
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    renorm_eps: float = 0.0,
    scaling: float = 1.0,
    bias: npt.NDArray[np.float32] | None = None,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """A MoE router on the core: the logits of rows ``x`` ``[t, hidden]`` against ``router`` ``[hidden, experts]``
    (``+ bias``), then each row's choice: ``(weights, ids)``, ``[t, top_k]`` each, best first (ties to the lower
    id); ``scoring`` ``"softmax"``, ``"sigmoid"`` or ``"topk_softmax"``. ``model/moe/route.py`` is the reference."""

@final
class MoeExperts:
    """A MoE layer's routed experts over the ``QuantMatrix`` objects its linears hold (handles, not copies): experts
    ``first .. first + len(gate_up)`` of ``num_experts``, ``gate_up[i]`` ``[2I, hidden]`` (gate rows, then up rows)
    and ``down[i]`` ``[hidden, I]``. ``activation`` ``"silu"`` or ``"gelu_tanh"``; ``clamp = (alpha, limit)`` makes
    it gpt-oss's clamped SwiGLU, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate,
    limit)``. Optional float32 biases ``[experts, 2I]`` and ``[experts, hidden]``."""

    def __new__(
        cls,
        gate_up: Sequence[QuantMatrix],
        down: Sequence[QuantMatrix],
        activation: str = "silu",
        clamp: tuple[float, float] | None = None,
        gate_up_bias: npt.NDArray[np.float32] | None = None,
        down_bias: npt.NDArray[np.float32] | None = None,
        first: int = 0,
        num_experts: int | None = None,
    ) -> Self: ...
    def run(
        self,
        x: npt.NDArray[np.float32],
        ids: npt.NDArray[np.int64],
        weights: npt.NDArray[np.float32],
        out: npt.NDArray[np.float32],
        threads: int = 1,
        isa: str | None = None,
    ) -> int:
        """``out[t] += sum_j weights[t, j] * expert[ids[t, j]](x[t])`` (``x``, ``out`` ``[T, hidden]``; ``ids``
        int64 and ``weights`` ``[T, top_k]``; C-contiguous), skipping ids of experts not held: the step's pairs
        sorted by expert, each routed expert's rows through gate_up, the activation and down on
        ``QuantMatrix.matmul``'s kernels (the same bits as those calls one expert at a time), GIL released,
        ``threads`` parts splitting the experts' columns. Returns the weight bytes streamed (the routed experts')."""
    @property
    def num_local(self) -> int:
        """Experts held (a rank's share under expert parallelism)."""
    @property
    def first(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Packed bytes of all the experts held."""

@final
class BlockAllocator:
    """Test-only: present when built with the cargo feature ``test-bindings`` (``make develop``).

    Fixed pool of KV blocks with reference counts, fork and copy-on-write."""

    def __new__(cls, num_blocks: int, block_size: int = 16) -> Self: ...
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
        """Drop one reference; ``InvalidArgumentError`` if the block has none."""
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

@final
class RadixCache:
    """Test-only: present when built with the cargo feature ``test-bindings`` (``make develop``).

    Block-granular radix tree over token ids with LRU eviction of unlocked leaves."""

    def __new__(cls, allocator: BlockAllocator) -> Self: ...
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

@final
class RequestQueue:
    """Test-only: present when built with the cargo feature ``test-bindings`` (``make develop``).

    Waiting requests under one policy: ``fcfs``, ``priority`` or ``deadline``.

    ``fcfs``: by arrival. ``priority``: lower value first, then arrival. ``deadline``: requests
    with a deadline first, earliest (arrival + deadline) first; the rest by arrival.
    Push, pop and remove are O(log n); ``expire`` touches only the expired.
    """

    def __new__(cls, policy: str = "fcfs", max_len: int | None = None) -> Self: ...
    @property
    def policy(self) -> str: ...
    @property
    def max_len(self) -> int | None: ...
    def push(
        self,
        request_id: str,
        priority: int = 0,
        deadline: float | None = None,
        queue_timeout: float | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. ``deadline`` and ``queue_timeout`` are seconds after ``arrival_time``
        (default: now). Raises QueueFullError, DuplicateRequestError or InvalidArgumentError."""
    def pop(self) -> str | None: ...
    def peek(self) -> str | None: ...
    def remove(self, request_id: str) -> bool: ...
    def expire(self, now: float | None = None) -> list[str]:
        """Remove and return the requests whose timeout has passed (``now > arrival + queue_timeout``)."""
    def to_list(self) -> list[str]:
        """Queued ids in policy order."""
    def __len__(self) -> int: ...
    def __contains__(self, request_id: str, /) -> bool: ...

# (request id, seq slot, reason "stop" | "length" | "timeout", matched stop_token_ids entry or None)
_FinishedSeq: TypeAlias = tuple[str, int, str, int | None]

@final
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
    sample_output_lens: npt.NDArray[np.int64]  # [S] tokens each row's sequence generated so far
    sample_ban_stop: npt.NDArray[np.bool_]  # [S] stop token ids must not be sampled yet (min_tokens)
    # [S] the proposed token this row's sampled token must equal for the sequence's next row to count, or -1
    sample_draft: npt.NDArray[np.int64]
    # [R] sample rows of grammar-constrained sequences (ascending); row i of take_bitmask()'s bits is mask_rows[i]
    mask_rows: npt.NDArray[np.int64]
    cow_pairs: npt.NDArray[np.int64]  # [K, 2] (src, dst) block copies to run before the forward
    kv_demote: npt.NDArray[np.int64]  # [K, 2] (device block, tier slot) copies to run first
    kv_promote: npt.NDArray[np.int64]  # [K, 2] (tier slot, device block) copies after kv_demote, before cow_pairs
    new_request_ids: list[str]  # admitted for the first time this step
    # [len(new_request_ids)] prompt tokens each one's first admission found in the prefix cache (full blocks)
    new_request_cached_tokens: npt.NDArray[np.int64]
    preempted_request_ids: list[str]  # sent back to the queue this step (recompute)
    finished: list[_FinishedSeq]  # sequences of requests that timed out while waiting
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int  # prefix-cache hits of all admissions this step (re-admissions too)
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

@final
class Scheduler:
    """Continuous-batching scheduler owning the queue, the allocator and the radix cache.

    Per step: ``plan = schedule()``, run the model on the plan's arrays (copy ``cow_pairs``
    first), ``update(sampled)``. Calling ``schedule()`` again without ``update()`` treats the
    un-updated plan as lost: its sequences are preempted (recompute) and reported in
    ``preempted_request_ids``. Steps with >= 256 running sequences release the GIL.
    Requires ``max_num_batched_tokens >= max_num_seqs`` (each running sequence gets a token
    every step).
    """

    def __new__(cls, config: SchedulerConfig) -> Self:
        """Built from one ``ironlm.config.SchedulerConfig`` (read by attribute; every field required), which
        ``EngineConfig.scheduler_config`` fills: the defaults live in ``EngineConfig`` alone.

        Policy ``fair`` charges each tenant's prefill tokens × ``input_token_weight`` plus sampled
        tokens × ``output_token_weight``, divided by its share in ``tenant_weights`` (1 if absent), and
        admits from the least charged tenant within the best priority. ``scheduler_delay_factor`` > 0
        holds admissions, while sequences run, until that × the last step's duration has passed since
        the last admission. ``tier_blocks`` > 0 adds a lower KV tier of that many blocks (needs prefix
        caching): evicted cached blocks are demoted there (``plan.kv_demote``) and hits on them promoted
        back (``plan.kv_promote``); with ``swap`` a preempted sequence's cached blocks are demoted at
        once. ``sliding_window``: every layer attends only inside it, so blocks wholly before it are
        released. ``reserve_decode`` (``EngineConfig.preemption == "conservative"``): a waiting request is
        admitted only while free and evictable blocks cover what it and every running sequence still need to
        reach their max length, so running sequences are rarely preempted for blocks."""
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.int64],
        max_tokens: int,
        *,
        min_tokens: int = 0,
        n: int = 1,
        priority: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        deadline: float | None = None,
        queue_timeout: float | None = None,
        namespace: str | None = None,
        arrival_time: float | None = None,
        grammar: CompiledGrammar | None = None,
        tenant: str | None = None,
        speculate: bool = True,
    ) -> list[int]:
        """Queue a request; returns its ``n`` sequence slots (stable handles until finished).

        ``grammar``: constrain each sequence's output to it (each gets its own matcher); it finishes
        with ``stop`` when the grammar is complete, or at EOS (allowed once the grammar accepts),
        stop tokens or max_tokens as usual; ``min_tokens`` does not hold it back.

        ``deadline``: TTFT deadline, seconds after arrival (policy ``deadline``).
        ``tenant``: who it is served for (policy ``fair``); None is the tenant ``""``.
        ``queue_timeout``: seconds after arrival after which a still-waiting request
        finishes with reason ``timeout`` (waiting only: a running request never times out
        here). Raises QueueFullError, RequestTooLargeError (prompt + max_tokens beyond
        ``max_model_len`` or the whole cache, or ``n > max_num_seqs``),
        DuplicateRequestError or InvalidArgumentError.
        """
    def schedule(self, now: float | None = None) -> SchedulerPlan:
        """Plan the next step; waiting requests past their timeout finish first (``plan.finished``)."""
    def update(self, sampled_token_ids: npt.NDArray[np.int64] | Sequence[int]) -> list[_FinishedSeq]:
        """Append one token per ``plan.sample_slots`` row of the last plan.

        The core's stop decision, the only one: a stop token (EOS unless ignore_eos, or
        stop_token_ids) stops a sequence once it has generated ``min_tokens`` tokens before it
        (the rows where it may not are ``plan.sample_ban_stop``); then max_tokens and
        max_model_len (reason ``length``). Returns ``(request id, seq slot, reason, stop
        token)`` for each sequence that finished; the stop token is the matched
        stop_token_ids entry, None for EOS and ``length``. Finished sequences' blocks go to
        the radix cache. Rows of sequences finished or aborted since the plan are ignored.
        InvalidArgumentError if the length is not ``plan.num_samples`` or no plan is waiting for an
        update.
        """
    def take_bitmask(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]] | None:
        """The last plan's token bitmask ``(rows, bits)``: ``bits`` is int32 ``[len(rows), ceil(vocab_size / 32)]``
        (bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed) for the sample rows ``rows``
        (= ``plan.mask_rows``); None when the plan has no constrained row or they were taken. Computed on a
        worker thread since ``schedule()``: call it after the forward so the two overlap; waits with the GIL
        released."""
    def mask_stats(self) -> dict[str, float]:
        """Mask computation so far: ``steps``, ``rows``, ``compute_s`` (worker time) and ``wait_s`` (time
        ``take_bitmask`` waited, i.e. what did not overlap the forward)."""
    @property
    def mask_threads(self) -> int:
        """Threads one step's mask computation may use (default: the machine's CPUs)."""
    @mask_threads.setter
    def mask_threads(self, n: int) -> None: ...
    def finish(self, slot: int) -> bool:
        """Finish one sequence now (a stop string matched); frees its blocks.

        False if the slot holds no live sequence. Finishing the parent of an ``n > 1``
        request before its first token hands the prefill over to a sibling.
        """
    def abort(self, request_id: str) -> bool:
        """Drop a request (all its sequences) wherever it is; frees its blocks."""
    def output_token_ids(self, slot: int) -> list[int]:
        """Generated tokens of a sequence: live, or finished and its slot not reused yet
        (slots are reused by ``add_request``). InvalidArgumentError for a slot never handed out."""
    def token_ids(self, slot: int) -> list[int]:
        """Prompt + generated tokens (same validity as ``output_token_ids``)."""
    def stop_token_ids(self, slot: int) -> list[int]:
        """Token ids that stop a live sequence: its stop_token_ids, plus the EOS ids unless
        ignore_eos (sorted). The sampler masks them on the rows of ``plan.sample_ban_stop``.
        InvalidArgumentError if the slot holds no live sequence."""
    def request_id(self, slot: int) -> str | None:
        """Request id of a live sequence, else None."""
    def has_unfinished(self) -> bool: ...
    def __contains__(self, request_id: str, /) -> bool: ...
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
    def emitted(self) -> npt.NDArray[np.bool_]:
        """Per ``plan.sample_slots`` row of the last ``update``: whether its token was appended."""
    def set_speculation(self, num_speculative_tokens: int | None, prompt_lookup_max: int = 4,
                        prompt_lookup_min: int = 1, max_batch_tokens: int | None = None,
                        external: bool = False) -> None:
        """Speculative decoding for requests added from now (None: off): n-gram proposals, or with `external`
        rows reserved for proposals handed in by `set_proposals`. `max_batch_tokens`: no proposals once the
        decode batch reaches it (None: no cap)."""
    def set_spec_budget(self, budget: int | None) -> None:
        """The most proposal tokens the next steps' plans may carry in all (0: speculation paused); None lifts
        the limit. Kept until changed (the engine's cost model sets it every step)."""
    def set_proposals(self, plan: SchedulerPlan, tokens: npt.ArrayLike) -> None:
        """One token per sample row of `plan` (the last one scheduled) with `sample_draft >= 0`, in row order:
        written into the core's plan and `plan.input_ids` / `plan.sample_draft`. Constrained sequences' masks
        for these rows start now (and their matchers are rolled back from `draft_masks`' walk)."""
    def draft_masks(self, rows: npt.ArrayLike,
                    prev: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]] | None:
        """Grammar masks for a draft model's next proposals: ``rows`` are sample rows of the last plan that
        verify a proposal (the ``j``-th of their sequence's run), ``prev[i]`` the draft's proposal before
        ``rows[i]`` (-1 for the first of a run), which the row's matcher takes first. ``(idx, bits)``:
        ``bits[i]`` is the mask of ``rows[idx[i]]``; None when no row is constrained."""
    def spec_stats(self) -> dict[str, Any]:
        """``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_pos``,
        ``grammar_cut_tokens`` (proposed tokens a grammar rejected)."""
    def stats(self) -> dict[str, int]:
        """Counters without a scan: num_waiting, num_running, num_preemptions, num_timeouts,
        prefix_queries, prefix_hits, blocks_total, blocks_free, blocks_used, blocks_cached,
        num_aborted, num_finished, num_steps, num_requests; the KV tier's tier_blocks_total,
        tier_blocks_used, kv_promotions, kv_demotions (blocks), prefix_hits_tier (tokens, also in
        prefix_hits), swap_out_blocks, swap_in_blocks, blocks_pinned; kv_slots_allocated and
        kv_slots_used (token slots of running sequences' blocks, and tokens in them);
        window_freed_blocks.

        num_preemptions counts sequences; num_timeouts and num_aborted count requests;
        num_finished counts sequences finished by a stop rule or ``finish``; blocks_used are
        held by sequences, blocks_cached only by the prefix cache (evictable)."""
    def tenant_stats(self) -> dict[str, dict[str, float]]:
        """Per tenant seen so far: weight, counter (virtual tokens), input_tokens, output_tokens (served,
        under every policy) and live (requests waiting or running)."""
    @property
    def scheduler_delay_factor(self) -> float: ...
    def set_promote_cost(self, copy_s_per_block: float, prefill_s_per_token: float) -> None:
        """Promote tier hits only if copying a block back costs less than recomputing its tokens."""
    @property
    def promotes(self) -> bool: ...
    def pin_prefix(self, token_ids: Sequence[int] | npt.NDArray[np.int64], namespace: str | None = None) -> int:
        """Lock the device-cached full blocks of ``token_ids`` for good; the tokens pinned (0: not cached)."""
    def tier_flush(self) -> npt.NDArray[np.int64]:
        """Demote every unpinned unused cached block the tier can take (pins are released); the
        ``(device_block, tier_slot)`` copies ``[K, 2]`` to run now."""
    def tier_entries(self) -> list[tuple[int, int, str | None, list[int]]]:
        """``(slot, parent_slot or -1, namespace, block token ids)`` of tier blocks whose whole path is in the
        tier, parents first."""
    def tier_restore(self, entries: Sequence[tuple[int, int, str | None, Sequence[int]]]) -> int:
        """Rebuild tier nodes from an earlier run's ``tier_entries`` (idle scheduler, empty cache); the number
        restored (an entry whose parent is missing is skipped)."""
    @property
    def tier_blocks(self) -> int: ...

def apply_token_bitmask(
    logits: npt.NDArray[np.float32], rows: npt.NDArray[np.int64], bits: npt.NDArray[np.int32]
) -> None:
    """On each row ``rows[i]`` of ``logits`` (float32 ``[S, V]``, C-contiguous, e.g. a CPU tensor's ``.numpy()``),
    in place: tokens not set in ``bits[i]`` (``Scheduler.take_bitmask``) become -inf."""
