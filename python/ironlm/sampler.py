"""Vectorised batch sampler.

Per-sequence state lives in arrays indexed by a *slot* (a small int the scheduler gives each sequence), so a step
is a handful of gathers and whole-batch tensor ops. Scalar per-slot parameters live on the host in numpy: the
per-batch "which stages does any row need" test is an OR over S small ints with no device sync, and each stage
gets its per-row parameters with one small host-to-device copy.

Randomness is counter based: a row's uniform is a hash of (slot seed, tokens generated so far, attempt), and the
token is drawn by inverse CDF over the filtered distribution laid out in token-id order. A row's draw therefore
depends only on its own logits, parameters, seed and position - not on which rows share the batch nor where it
sits in it - and one uniform per row replaces V Gumbel samples.

Costs are kept to a few vocab-wide passes per step: the inverse CDF is two-level (block sums, then a cumsum
inside one block), top-k and top-N logprobs use a topk over the blocks with the largest maxima, top-p without
top-k uses rejection sampling against the nucleus (accepted with probability >= top_p per attempt, so no
vocab-wide sort), and penalties touch only the tokens a sequence has seen (take/put over its prompt+output token
list), not the whole vocabulary. Slots in one `sample` call must be distinct.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ironlm.exceptions import InvalidArgumentError
from ironlm.sampling_params import SamplingParams

# Per-slot feature bits. A step ORs the bits of its rows and skips every stage nobody needs.
F_RANDOM = 1  # not greedy
F_TOP_K = 2
F_TOP_P = 4
F_MIN_P = 8
F_REP = 16
F_PRES = 32
F_FREQ = 64
F_PENALTY = F_REP | F_PRES | F_FREQ
F_BIAS = 128
F_MIN_TOKENS = 256
F_LOGPROBS = 512  # asks for top-N (N >= 1) logprobs

# Top-p rejection attempts before a row falls back to an exact sort (only tiny top_p on flat rows get there).
MAX_REJECTION_ROUNDS = 16

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROUND = 0xD1B54A32D192ED03
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# Keeps u * total strictly below total after float64 rounding, so the inverse CDF never runs past the last
# token with non-zero mass.
_U_MAX = 1.0 - 2.0**-40


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic, which numpy arrays do silently)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: np.ndarray, steps: np.ndarray, attempt: int = 0) -> np.ndarray:
    """Uniform [0, 1) per row from (mixed seed, step, attempt): counter-based, no generator state."""
    x = seeds + (steps.astype(np.uint64) + np.uint64(1)) * _GOLDEN + np.uint64(attempt * _ROUND & _MASK64)
    u = (_splitmix64(x) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.minimum(u, _U_MAX)


def _mix_seed(seed: int) -> np.uint64:
    # Nearby user seeds (0, 1, 2 ...) would give overlapping splitmix streams; hashing them first decorrelates.
    return _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))[0]


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # [S] int64
    logprobs: np.ndarray  # [S] float32, chosen token under the raw (unprocessed) model distribution
    top_ids: np.ndarray | None = None  # [S, K] int64, K = largest `logprobs` asked for in the batch
    top_logprobs: np.ndarray | None = None  # [S, K] float32, sorted descending


class _SeenTokens:
    """Penalty state: for each penalised sequence, the distinct tokens it has seen and their output counts.

    Rows of a pool (one per penalised slot). Device: `ids[row, :len]` (prompt tokens when a repetition penalty
    needs them, then each new output token) and `counts[row, :len]` (output occurrences). Host: `pos[row, tok]`,
    the position of `tok` in the row (-1 if unseen), which keeps the lists duplicate-free without a device sync.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.pos = np.zeros((0, vocab_size), np.int32)
        self.length = np.zeros(0, np.int64)
        self.ids = torch.zeros(0, 16, dtype=torch.long, device=device)
        self.counts = torch.zeros(0, 16, dtype=torch.int32, device=device)
        self.free: list[int] = []

    def alloc(self) -> int:
        if not self.free:
            old = len(self.length)
            new = max(8, 2 * old)
            self.pos = np.concatenate([self.pos, np.full((new - old, self.vocab_size), -1, np.int32)])
            self.length = np.concatenate([self.length, np.zeros(new - old, np.int64)])
            self.ids = torch.cat([self.ids, self.ids.new_zeros(new - old, self.ids.shape[1])])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.counts.shape[1])])
            self.free.extend(range(new - 1, old - 1, -1))
        return self.free.pop()

    def release(self, row: int) -> None:
        self.pos[row].fill(-1)
        self.length[row] = 0
        self.counts[row].zero_()
        self.free.append(row)

    def copy(self, src: int, dst: int) -> None:
        self.pos[dst] = self.pos[src]
        self.length[dst] = self.length[src]
        self.ids[dst] = self.ids[src]
        self.counts[dst] = self.counts[src]

    def add_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        ids = np.asarray(token_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        ids = ids[self.pos[row, ids] < 0]
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]  # first occurrences, in order
        n, start = len(ids), int(self.length[row])
        if not n:
            return
        self._widen(start + n)
        self.pos[row, ids] = np.arange(start, start + n, dtype=np.int32)
        self.length[row] = start + n
        self.ids[row, start:start + n] = torch.from_numpy(ids).to(self.device)

    def record(self, rows: np.ndarray, toks: np.ndarray) -> None:
        """One output token per row (rows are distinct)."""
        pos = self.pos[rows, toks].astype(np.int64)
        new = pos < 0
        if new.any():
            rn, tn = rows[new], toks[new]
            pn = self.length[rn]
            self._widen(int(pn.max()) + 1)
            self.pos[rn, tn] = pn
            self.length[rn] += 1
            pos[new] = pn
            dev = self.device
            self.ids[torch.from_numpy(rn).to(dev), torch.from_numpy(pn).to(dev)] = torch.from_numpy(tn).to(dev)
        r, p = torch.from_numpy(rows).to(self.device), torch.from_numpy(pos).to(self.device)
        self.counts.index_put_((r, p), torch.ones(len(rows), dtype=torch.int32, device=self.device),
                               accumulate=True)

    def gather(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray] | None:
        """(ids [R, L], counts [R, L], non-empty rows). Past a row's length, entries repeat its position 0, so a
        scatter of per-entry results writes identical values for the duplicates."""
        lens = self.length[rows]
        width = int(lens.max()) if len(lens) else 0
        if width == 0:
            return None
        dev = self.device
        ar = torch.arange(width, device=dev)
        pos = ar * (ar < torch.from_numpy(lens).to(dev)[:, None])
        r = torch.from_numpy(rows).to(dev)[:, None]
        return self.ids[r, pos], self.counts[r, pos], lens > 0

    def _widen(self, need: int) -> None:
        width = self.ids.shape[1]
        if need <= width:
            return
        while width < need:
            width *= 2
        extra = width - self.ids.shape[1]
        self.ids = torch.cat([self.ids, self.ids.new_zeros(self.ids.shape[0], extra)], dim=1)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(self.counts.shape[0], extra)], dim=1)


class _Scratch:
    """Reused vocab-wide temporaries. On CPU a fresh 10+ MB tensor is fresh mmap'd memory, and the page faults
    of its first write cost several times the arithmetic (measured: 6-19 ms vs 1 ms for `x - m` at 64 x 49152).
    Devices with a caching allocator (CUDA) just allocate."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, width: int) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.empty(rows, width, device=self.device)
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != width:
            grown = max(rows, 2 * buf.shape[0]) if buf is not None and buf.shape[1] == width else rows
            buf = self._bufs[name] = torch.empty(grown, width, device=self.device)
        return buf[:rows]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str, *, max_slots: int = 256, seed: int = 0) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._rng = np.random.default_rng(seed)
        # Inverse-CDF block: a divisor of V near sqrt(V) avoids padding; otherwise pad the row to a multiple.
        self._block = next((b for b in (256, 512, 128, 1024, 64) if vocab_size % b == 0), 256)
        self._pad = -vocab_size % self._block
        self._cap = 0
        self._flags = np.zeros(0, np.int64)
        self._active = np.zeros(0, bool)
        self._inv_temp = np.zeros(0, np.float32)
        self._top_k = np.zeros(0, np.int64)  # 0 = off
        self._top_p = np.zeros(0, np.float64)
        self._min_p = np.zeros(0, np.float32)
        self._rep = np.zeros(0, np.float32)
        self._pres = np.zeros(0, np.float32)
        self._freq = np.zeros(0, np.float32)
        self._seed = np.zeros(0, np.uint64)
        self._step = np.zeros(0, np.int64)  # output tokens so far: the random-stream position
        self._min_tokens = np.zeros(0, np.int64)
        self._nlogprobs = np.zeros(0, np.int64)
        self._pen_row = np.zeros(0, np.int64)  # row in the penalty pool, -1 = none
        # Device tables indexed by slot; widths grow to the widest request seen.
        self._ban_ids = torch.zeros(0, 1, dtype=torch.long, device=self.device)  # masked while < min_tokens
        self._bias_ids = torch.zeros(0, 1, dtype=torch.long, device=self.device)
        self._bias_vals = torch.zeros(0, 1, dtype=torch.float32, device=self.device)
        self._seen = _SeenTokens(vocab_size, self.device)
        self._scratch = _Scratch(self.device)
        self._grow(max(1, max_slots))

    # -- slot lifecycle (Python loops are fine here: once per sequence) ----------------------------------

    def add(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int],
            eos_token_ids: Sequence[int], seed: int | None = None, *,
            output_token_ids: Sequence[int] = ()) -> None:
        """Start tracking a sequence. `output_token_ids` restores a sequence re-added after preemption, so its
        penalties and random stream continue where they were."""
        if slot < 0:
            raise ValueError(f"slot must be >= 0, got {slot}")
        if slot >= self._cap:
            self._grow(max(slot + 1, 2 * self._cap))
        if self._active[slot]:
            raise ValueError(f"slot {slot} is already in use")
        V = self.vocab_size
        if params.logit_bias and max(params.logit_bias) >= V:
            raise InvalidArgumentError(
                f"logit_bias token ids must be < vocab size {V}, got {max(params.logit_bias)}", param="logit_bias")
        if seed is None:
            seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        flags = 0
        if not params.greedy:
            flags |= F_RANDOM
            flags |= F_TOP_K if 0 < params.top_k < V else 0
            flags |= F_TOP_P if params.top_p < 1.0 else 0
            flags |= F_MIN_P if params.min_p > 0.0 else 0
        flags |= F_REP if params.repetition_penalty != 1.0 else 0
        flags |= F_PRES if params.presence_penalty != 0.0 else 0
        flags |= F_FREQ if params.frequency_penalty != 0.0 else 0
        flags |= F_LOGPROBS if params.logprobs else 0
        self._inv_temp[slot] = 1.0 / params.temperature if flags & F_RANDOM else 1.0
        self._top_k[slot] = params.top_k if flags & F_TOP_K else 0
        self._top_p[slot] = params.top_p
        self._min_p[slot] = params.min_p
        self._rep[slot] = params.repetition_penalty
        self._pres[slot] = params.presence_penalty
        self._freq[slot] = params.frequency_penalty
        self._seed[slot] = _mix_seed(seed)
        self._step[slot] = len(output_token_ids)
        self._min_tokens[slot] = params.min_tokens
        self._nlogprobs[slot] = params.logprobs or 0
        if params.logit_bias:
            ids = list(params.logit_bias)
            self._set_row(slot, "_bias_ids", ids)
            vals = [params.logit_bias[t] for t in ids]
            self._bias_vals[slot] = torch.tensor(vals + [0.0] * (self._bias_vals.shape[1] - len(vals)),
                                                 device=self.device)
            flags |= F_BIAS
        if params.min_tokens > 0:
            banned = {*(params.stop_token_ids or ()), *(() if params.ignore_eos else eos_token_ids)}
            banned_list = sorted(t for t in banned if 0 <= t < V)
            if banned_list:
                self._set_row(slot, "_ban_ids", banned_list)
                flags |= F_MIN_TOKENS
        self._pen_row[slot] = -1
        if flags & F_PENALTY:
            row = self._seen.alloc()
            self._pen_row[slot] = row
            if flags & F_REP:  # only repetition looks at the prompt
                self._seen.add_prompt(row, prompt_token_ids)
            for tok in output_token_ids:
                if 0 <= tok < V:
                    self._seen.record(np.array([row]), np.array([tok]))
        self._flags[slot] = flags
        self._active[slot] = True

    def fork(self, parent_slot: int, child_slot: int, child_seed: int) -> None:
        """A child of an n > 1 request: same parameters and prompt/output statistics, its own random stream."""
        if not self._active[parent_slot]:
            raise ValueError(f"parent slot {parent_slot} is not in use")
        if child_slot >= self._cap:
            self._grow(max(child_slot + 1, 2 * self._cap))
        if self._active[child_slot]:
            raise ValueError(f"slot {child_slot} is already in use")
        p, c = parent_slot, child_slot
        for name in ("_flags", "_inv_temp", "_top_k", "_top_p", "_min_p", "_rep", "_pres", "_freq", "_step",
                     "_min_tokens", "_nlogprobs"):
            arr = getattr(self, name)
            arr[c] = arr[p]
        for name in ("_ban_ids", "_bias_ids", "_bias_vals"):
            tab = getattr(self, name)
            tab[c] = tab[p]
        self._seed[c] = _mix_seed(child_seed)
        self._pen_row[c] = -1
        if self._pen_row[p] >= 0:
            row = self._seen.alloc()
            self._seen.copy(int(self._pen_row[p]), row)
            self._pen_row[c] = row
        self._active[c] = True

    def remove(self, slot: int) -> None:
        if slot >= self._cap or not self._active[slot]:
            return
        if self._pen_row[slot] >= 0:
            self._seen.release(int(self._pen_row[slot]))
        self._pen_row[slot] = -1
        self._flags[slot] = 0
        self._active[slot] = False

    def output_len(self, slot: int) -> int:
        return int(self._step[slot])

    # -- the hot path -------------------------------------------------------------------------------

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, slots: np.ndarray) -> SamplerOutput:
        slots = np.asarray(slots, dtype=np.int64)
        S, V = logits.shape
        if S != len(slots):
            raise ValueError(f"logits has {S} rows but {len(slots)} slots were given")
        if V != self.vocab_size:
            raise ValueError(f"logits has {V} columns, sampler vocab_size is {self.vocab_size}")
        if S == 0:
            return SamplerOutput(np.zeros(0, np.int64), np.zeros(0, np.float32))
        if logits.dtype != torch.float32:
            logits = logits.float()
        flags = self._flags[slots]
        batch = int(np.bitwise_or.reduce(flags))
        dev = self.device

        top_ids = top_lp = None
        if not batch & (F_RANDOM | F_PENALTY | F_BIAS | F_MIN_TOKENS):
            # Plain greedy: one max gives the token and the normaliser's shift; the argmax's logit is the max.
            raw_max, tokens = logits.max(dim=-1)
            lse = self._logsumexp(logits, raw_max[:, None])
            chosen = raw_max - lse
        else:
            raw_max = logits.amax(dim=-1, keepdim=True)
            lse = self._logsumexp(logits, raw_max)
            proc = self._process(logits, slots, flags, batch)
            tokens = torch.empty(S, dtype=torch.long, device=dev)
            rnd = (flags & F_RANDOM) != 0
            if not batch & F_RANDOM:
                tokens = proc.max(dim=-1).indices
            else:
                greedy = np.flatnonzero(~rnd)
                if len(greedy):
                    g = torch.from_numpy(greedy).to(dev)
                    tokens[g] = proc[g].max(dim=-1).indices
                # Without processing, the rows' max is the raw max already computed.
                self._draw_random(proc, tokens, np.flatnonzero(rnd), slots, raw_max if proc is logits else None)
            chosen = logits.gather(1, tokens[:, None]).squeeze(1) - lse
        if batch & F_LOGPROBS:
            k = min(int(self._nlogprobs[slots].max()), V)
            vals, top = self._topk(logits, k)
            top_ids, top_lp = top.cpu().numpy(), (vals - lse[:, None]).cpu().numpy()
        token_ids = tokens.cpu().numpy()
        if batch & F_PENALTY:
            pen = np.flatnonzero(flags & F_PENALTY)
            self._seen.record(self._pen_row[slots[pen]], token_ids[pen])
        self._step[slots] += 1
        return SamplerOutput(token_ids, chosen.cpu().numpy(), top_ids, top_lp)

    # -- logits processing ------------------------------------------------------------------------

    def _process(self, logits: torch.Tensor, slots: np.ndarray, flags: np.ndarray, batch: int) -> torch.Tensor:
        """logit_bias, min_tokens and penalties, on a copy (the raw logits are still needed for logprobs)."""
        if not batch & (F_BIAS | F_MIN_TOKENS | F_PENALTY):
            return logits
        proc = self._scratch.get("proc", *logits.shape).copy_(logits)
        dev = self.device
        if batch & F_BIAS:
            rows = np.flatnonzero(flags & F_BIAS)
            r = torch.from_numpy(rows).to(dev)
            s = torch.from_numpy(slots[rows]).to(dev)
            ids = self._bias_ids[s]
            # accumulate: padding repeats a real id with bias 0, so duplicates must add rather than overwrite.
            proc.index_put_((r[:, None].expand_as(ids), ids), self._bias_vals[s], accumulate=True)
        if batch & F_MIN_TOKENS:
            rows = np.flatnonzero(((flags & F_MIN_TOKENS) != 0) & (self._step[slots] < self._min_tokens[slots]))
            if len(rows):
                r = torch.from_numpy(rows).to(dev)
                ids = self._ban_ids[torch.from_numpy(slots[rows]).to(dev)]
                proc[r[:, None].expand_as(ids), ids] = float("-inf")
        if batch & F_PENALTY:
            self._penalize(proc, slots, flags)
        return proc

    def _penalize(self, proc: torch.Tensor, slots: np.ndarray, flags: np.ndarray) -> None:
        """vLLM's penalties, on the seen tokens only: repetition divides positive / multiplies negative logits
        of prompt+output tokens; frequency and presence subtract count * f and [count > 0] * p (outputs)."""
        rows = np.flatnonzero(flags & F_PENALTY)
        sl = slots[rows]
        seen = self._seen.gather(self._pen_row[sl])
        if seen is None:
            return
        ids, counts, nonempty = seen
        dev = self.device
        # Flat indices into the contiguous [S, V] buffer: a 1-D take/put is several times cheaper on CPU than
        # 2-D advanced indexing with a broadcast row index.
        flat = (torch.from_numpy(rows * proc.shape[1]).to(dev)[:, None] + ids).view(-1)
        g = proc.view(-1).take(flat).view(ids.shape)
        pflags = int(np.bitwise_or.reduce(flags[rows]))
        if pflags & F_REP:
            # A row with no seen tokens gathers a placeholder id: give it a neutral penalty.
            rep = torch.from_numpy(np.where(nonempty, self._rep[sl], np.float32(1.0))).to(dev)[:, None]
            g = torch.where(g > 0, g / rep, g * rep)
        if pflags & F_FREQ:
            g = g - torch.from_numpy(self._freq[sl]).to(dev)[:, None] * counts
        if pflags & F_PRES:
            g = g - torch.from_numpy(self._pres[sl]).to(dev)[:, None] * (counts > 0)
        proc.view(-1).put_(flat, g.view(-1))  # duplicates (row padding) carry identical values

    # -- drawing ------------------------------------------------------------------------------------

    def _draw_random(self, proc: torch.Tensor, tokens: torch.Tensor, rows: np.ndarray, slots: np.ndarray,
                     row_max: torch.Tensor | None) -> None:
        dev = self.device
        sl_all = slots[rows]
        flags = self._flags[sl_all]
        has_k = (flags & F_TOP_K) != 0
        nucleus = ((flags & F_TOP_P) != 0) & ~has_k
        for part, kind in ((has_k, "top_k"), (nucleus, "top_p"), (~(has_k | nucleus), "full")):
            idx = np.flatnonzero(part)
            if not len(idx):
                continue
            r = torch.from_numpy(rows[idx]).to(dev)
            if len(idx) == proc.shape[0]:
                sub, m = proc, row_max
            else:
                sub = torch.index_select(proc, 0, r, out=self._scratch.get("rows", len(idx), proc.shape[1]))
                m = None if row_max is None else row_max[r]
            sl = sl_all[idx]
            inv_t = torch.from_numpy(self._inv_temp[sl]).to(dev)[:, None]
            min_p = None
            if (flags[idx] & F_MIN_P).any():
                min_p = torch.from_numpy(self._min_p[sl]).to(dev)[:, None]
            if kind == "top_k":
                tokens[r] = self._draw_top_k(sub, inv_t, min_p, sl)
                continue
            # e = exp((l - max) / T): the unnormalised filtered distribution; its max is 1, so min-p is e >= p.
            # Computed into a buffer padded to whole inverse-CDF blocks (zero mass in the padding).
            V = sub.shape[1]
            padded = self._scratch.get("e", len(idx), V + self._pad)
            if self._pad:
                padded[:, V:].zero_()
            m = sub.amax(dim=-1, keepdim=True) if m is None else m
            e = torch.sub(sub, m, out=padded[:, :V]).mul_(inv_t).exp_()
            mass = total = None
            if kind == "top_p":  # the nucleus is defined before min-p; block sums give the total for free
                mass = padded.view(len(idx), -1, self._block).sum(-1)
                total = mass.sum(-1)
            if min_p is not None:
                e.masked_fill_(e < min_p, 0.0)
                mass = None
            if kind == "full":
                u = torch.from_numpy(uniforms(self._seed[sl], self._step[sl])).to(dev)
                tokens[r] = self._inverse_cdf(padded, u)
            else:
                tokens[r] = self._draw_top_p(padded, total, sl, mass)

    def _inverse_cdf(self, e: torch.Tensor, u: torch.Tensor, mass: torch.Tensor | None = None) -> torch.Tensor:
        """Token t with P(t) proportional to e[t] (token-id order), u uniform [0, 1): pick a block of the vocab
        by the cumsum of block masses, then a token by the cumsum inside that block (float64 both times), so
        the cost is one pass for the block sums instead of a vocab-wide float64 cumsum. `e` may already be
        padded to whole blocks."""
        R = e.shape[0]
        B = self._block
        if e.shape[1] == self.vocab_size and self._pad:
            e = F.pad(e, (0, self._pad))
        blocks = e.contiguous().view(R, -1, B)
        mass = blocks.sum(-1) if mass is None else mass
        cdf = mass.cumsum(-1, dtype=torch.float64)
        target = u[:, None] * cdf[:, -1:]
        b = torch.searchsorted(cdf, target, right=True).clamp_(max=mass.shape[1] - 1)
        before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
        frac = ((target - before) / mass.gather(1, b).double()).clamp_(0.0, _U_MAX)
        inner = blocks.gather(1, b[:, :, None].expand(-1, 1, B)).squeeze(1).cumsum(-1, dtype=torch.float64)
        pos = torch.searchsorted(inner, frac * inner[:, -1:], right=True).clamp_(max=B - 1)
        # The clamp only matters for a row with no mass at all (e.g. NaN logits): never return a padding id.
        return (b * B + pos).squeeze(1).clamp_(max=self.vocab_size - 1)

    def _draw_top_p(self, e: torch.Tensor, total: torch.Tensor, slots: np.ndarray,
                    mass: torch.Tensor | None) -> torch.Tensor:
        """Top-p by rejection: draw from e, accept if the mass strictly above the draw is < p * total (i.e. the
        token is in the nucleus; equal values are all kept). On rejection, every token not above the draw is
        outside the nucleus too, so it is removed before the next attempt. Accepted draws follow e restricted
        to the nucleus exactly; each attempt succeeds with probability >= top_p."""
        dev = self.device
        out = torch.empty(e.shape[0], dtype=torch.long, device=dev)
        pending = np.arange(e.shape[0])
        limit = torch.from_numpy(self._top_p[slots]).to(dev) * total
        for attempt in range(MAX_REJECTION_ROUNDS):
            sl = slots[pending]
            u = torch.from_numpy(uniforms(self._seed[sl], self._step[sl], attempt)).to(dev)
            tok = self._inverse_cdf(e, u, mass)
            mass = None  # rejected rows get masked below
            ex = e.gather(1, tok[:, None])
            # sum(e * [e > ex]) with the comparison written as float into a reused buffer: 2 passes on CPU,
            # where a bool mask, torch.where or an einsum each cost several times more.
            above = torch.gt(e, ex, out=self._scratch.get("tmp", *e.shape)).mul_(e).sum(-1)
            ok = (above < limit).cpu().numpy()
            out[torch.from_numpy(pending[ok]).to(dev)] = tok[torch.from_numpy(ok).to(dev)]
            if ok.all():
                return out
            keep = torch.from_numpy(~ok).to(dev)
            e, ex, limit = e[keep], ex[keep], limit[keep]
            e.masked_fill_(e <= ex, 0.0)
            pending = pending[~ok]
        # Exact fallback: sort the (few) remaining rows.
        sl = slots[pending]
        vals = e.sort(dim=-1, descending=True).values
        cum = vals.cumsum(-1, dtype=torch.float64)
        n_keep = (cum < limit[:, None]).sum(-1, keepdim=True) + 1
        thresh = vals.gather(1, n_keep.clamp(max=vals.shape[1]) - 1)
        e = e.masked_fill(e < thresh, 0.0)
        u = torch.from_numpy(uniforms(self._seed[sl], self._step[sl], MAX_REJECTION_ROUNDS)).to(dev)
        out[torch.from_numpy(pending).to(dev)] = self._inverse_cdf(e, u)
        return out

    def _draw_top_k(self, sub: torch.Tensor, inv_t: torch.Tensor, min_p: torch.Tensor | None,
                    slots: np.ndarray) -> torch.Tensor:
        """Top-k (then top-p renormalised over the top-k set, then min-p) on the `topk(k + 1)` candidates.

        The kept set is {e >= threshold}, so equal values at the boundary are all kept and the result does not
        depend on how topk orders ties; it is trusted once the last candidate is below the threshold (or has no
        mass), which proves nothing outside the candidates would be kept; otherwise more candidates are taken.
        """
        dev, V = self.device, sub.shape[1]
        k = torch.from_numpy(self._top_k[slots]).to(dev)[:, None]
        has_p = (self._flags[slots] & F_TOP_P) != 0
        top_p = torch.from_numpy(np.where(has_p, self._top_p[slots], 2.0)).to(dev)[:, None]
        u_all = torch.from_numpy(uniforms(self._seed[slots], self._step[slots])).to(dev)
        out = torch.empty(sub.shape[0], dtype=torch.long, device=dev)
        pending = torch.arange(sub.shape[0], device=dev)
        K = min(V, int(self._top_k[slots].max()) + 1)
        while True:
            rows = sub if len(pending) == sub.shape[0] else sub[pending]
            vals, idx = self._topk(rows, K)  # sorted descending
            e = (vals - vals[:, :1]).mul_(inv_t[pending]).exp_()
            kk = k[pending]
            thresh = e.gather(1, kk.clamp(max=K) - 1)
            if has_p.any():
                in_k = e * (e >= thresh)
                cum = in_k.cumsum(-1, dtype=torch.float64)
                pp = top_p[pending]
                n_keep = (cum < pp * cum[:, -1:]).sum(-1, keepdim=True) + 1
                p_thresh = e.gather(1, n_keep.clamp(max=K) - 1)
                thresh = torch.where(pp <= 1.0, torch.maximum(thresh, p_thresh), thresh)
            if min_p is not None:
                thresh = torch.maximum(thresh, min_p[pending])
            last = e[:, -1:]
            ok = ((last < thresh) | (last == 0)).squeeze(1) if K < V else torch.ones_like(pending, dtype=torch.bool)
            if bool(ok.any()):
                i, w = idx[ok], e[ok]
                w = w * (w >= thresh[ok])
                # Token-id order, so the draw does not depend on how topk ordered equal values.
                order = i.argsort(dim=-1)
                i = i.gather(1, order)
                cdf = w.gather(1, order).cumsum(-1, dtype=torch.float64)
                target = u_all[pending[ok]][:, None] * cdf[:, -1:]
                pos = torch.searchsorted(cdf, target, right=True).clamp_(max=K - 1)
                out[pending[ok]] = i.gather(1, pos).squeeze(1)
            pending = pending[~ok]
            if not len(pending):
                return out
            K = min(V, K * 8)

    def _topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row top-k (values sorted descending) through block maxima: the top k values all lie in the k blocks
        with the largest maxima (a block holding one of them has a max at least as large), so a topk over those
        k blocks replaces one over the whole vocabulary. Equal values may come back with other ids than
        torch.topk would pick; the values are the same."""
        R, V = x.shape
        nb = V // self._block
        if self._pad or 2 * k > nb:
            return x.topk(k, dim=-1)
        blocks = x.contiguous().view(R, nb, self._block)
        top_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices
        cand = blocks.gather(1, top_blocks[:, :, None].expand(-1, -1, self._block)).view(R, -1)
        vals, pos = cand.topk(k, dim=-1)
        return vals, top_blocks.gather(1, pos // self._block) * self._block + pos % self._block

    def _logsumexp(self, x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        """Row log-sum-exp given the row max (reused from the greedy max on the fast path)."""
        shifted = torch.sub(x, row_max, out=self._scratch.get("lse", *x.shape))
        return row_max.squeeze(1) + shifted.exp_().sum(-1).log_()

    # -- storage ------------------------------------------------------------------------------------

    def _grow(self, cap: int) -> None:
        extra = cap - self._cap
        if extra <= 0:
            return
        for name in ("_flags", "_active", "_inv_temp", "_top_k", "_top_p", "_min_p", "_rep", "_pres", "_freq",
                     "_seed", "_step", "_min_tokens", "_nlogprobs"):
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.zeros(extra, arr.dtype)]))
        self._pen_row = np.concatenate([self._pen_row, np.full(extra, -1, np.int64)])
        for name in ("_ban_ids", "_bias_ids", "_bias_vals"):
            tab = getattr(self, name)
            setattr(self, name, torch.cat([tab, tab.new_zeros(extra, tab.shape[1])]))
        self._cap = cap

    def _set_row(self, slot: int, name: str, ids: list[int]) -> None:
        """Store a padded id list; padding repeats the row's first id (a no-op when masked / biased by 0)."""
        tab = getattr(self, name)
        extra = len(ids) - tab.shape[1]
        if extra > 0:
            tab = torch.cat([tab, tab[:, :1].expand(-1, extra)], dim=1)
            setattr(self, name, tab)
            if name == "_bias_ids":  # the values table stays as wide as the ids; new columns bias by 0
                self._bias_vals = torch.cat([self._bias_vals, self._bias_vals.new_zeros(tab.shape[0], extra)], dim=1)
        if name == "_bias_ids":
            self._bias_vals[slot] = 0.0
        tab[slot] = torch.tensor(ids + [ids[0]] * (tab.shape[1] - len(ids)), dtype=torch.long, device=self.device)

