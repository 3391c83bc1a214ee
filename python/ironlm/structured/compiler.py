"""One grammar compiler per engine: an LRU of compiled grammars bounded by their memory, and a pool of its own.

The core builds the tokenizer's token trie once (on first use: most engines never see a constrained request)
and compiles with the GIL released. `compile` may be called from any thread; the async engine uses
`compile_async`, which answers cache hits on the loop and runs misses on this cache's own bounded pool, so slow
grammars never hold the threads that tokenize and render chat templates for everyone else. In-flight compiles
are capped per tenant and in all (GrammarBusyError, a 429); the core bounds its compile threads too, counting
the ones whose caller timed out, and stops those between steps.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ironlm import _core
from ironlm.exceptions import GrammarBusyError, GrammarError, QueueFullError
from ironlm.structured.vocab import token_vocab

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm.structured.params import StructuredOutputsParams

# The compiled grammars kept, by their estimated memory (CompiledGrammar.size_bytes): a 100k-alternative regex
# costs ~30 MB by that estimate, a usual JSON schema well under 1 MB.
DEFAULT_CACHE_BYTES = 512 << 20
# What an entry costs beside its grammar: the dict slot, the key's str object, the failure message.
_ENTRY_OVERHEAD = 256


@dataclass(frozen=True)
class CompileLimits:
    """How many compiles may be in flight. `workers` threads run them (default: half the cores, at least one,
    so neighbours' tokenizing keeps the rest); the core keeps at most `2 * workers` compile threads alive,
    abandoned ones included. A tenant may have `per_tenant` compiles queued or running, everyone together
    `max_inflight`; past either a request gets GrammarBusyError."""

    workers: int = max(1, (os.cpu_count() or 2) // 2)
    per_tenant: int = 4
    max_inflight: int = 16

    def __post_init__(self) -> None:
        for name in ("workers", "per_tenant", "max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"CompileLimits.{name} must be >= 1, got {getattr(self, name)}")


class GrammarCache:
    """Thread-safe. Failures are cached too: a grammar that timed out once would only time out again (a busy
    compiler is not a failure of the grammar, and is not cached)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int, timeout: float, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 limits: CompileLimits | None = None, max_grammar_bytes: int | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._timeout = timeout
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._max_grammar_bytes = max_grammar_bytes
        self.limits = limits or CompileLimits()
        self._compiler: _core.GrammarCompiler | None = None
        self._cache: OrderedDict[str, tuple[_core.CompiledGrammar | str, int]] = OrderedDict()
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str | None, int] = {}
        self.hits = 0
        self.misses = 0
        self.refused = 0

    @property
    def compiler(self) -> _core.GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                tv = token_vocab(self._tokenizer)
                self._compiler = _core.GrammarCompiler(
                    tv.token_bytes[: self._vocab_size], eos_token_ids=self._eos, vocab_size=self._vocab_size,
                    special_token_ids=[t for t in tv.special_token_ids if t < self._vocab_size],
                    timeout=self._timeout, max_threads=2 * self.limits.workers,
                    max_grammar_bytes=self._max_grammar_bytes)
            return self._compiler

    def _lookup(self, text: str) -> _core.CompiledGrammar | str | None:
        with self._lock:
            entry = self._cache.get(text)
            if entry is None:
                return None
            self._cache.move_to_end(text)
            self.hits += 1
            return entry[0]

    def _store(self, text: str, value: _core.CompiledGrammar | str) -> None:
        size = len(text) + _ENTRY_OVERHEAD + (len(value) if isinstance(value, str) else value.size_bytes)
        with self._lock:
            old = self._cache.pop(text, None)
            if old is not None:
                self.cached_bytes -= old[1]
            if size > self._cache_bytes or self._cache_size == 0:
                return
            self._cache[text] = (value, size)
            self.cached_bytes += size
            while len(self._cache) > self._cache_size or self.cached_bytes > self._cache_bytes:
                _, (_, evicted) = self._cache.popitem(last=False)
                self.cached_bytes -= evicted

    def compile(self, text: str, param: str = "structured_outputs") -> _core.CompiledGrammar:
        """Raises GrammarError naming `param`, or QueueFullError when every compile thread stayed busy."""
        hit = self._lookup(text)
        if hit is None:
            self.misses += 1
            try:
                hit = self.compiler.compile(text, param=param)
            except GrammarError as e:
                hit = str(e)
            self._store(text, hit)
        if isinstance(hit, str):
            raise GrammarError(hit, param)
        return hit

    def compile_params(self, params: StructuredOutputsParams) -> _core.CompiledGrammar:
        return self.compile(params.grammar_text(), param=params.param)

    async def compile_async(self, params: StructuredOutputsParams, tenant: str | None = None) -> _core.CompiledGrammar:
        """`compile_params` for an event loop: a hit is answered here; a miss waits for this cache's pool.
        Raises GrammarBusyError when `tenant` (or everyone) already has the most compiles in flight."""
        text, param = params.grammar_text(), params.param
        hit = self._lookup(text)
        if hit is not None:
            if isinstance(hit, str):
                raise GrammarError(hit, param)
            return hit
        self._admit(tenant)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor(), self.compile, text, param)
        except QueueFullError as exc:
            if isinstance(exc, GrammarBusyError):
                raise
            self.refused += 1
            raise GrammarBusyError(f"{param}: {exc}; retry later") from None
        finally:
            # A caller that gave up (disconnected) leaves: its queued compile is dropped by the cancellation,
            # a running one is stopped by the core's timeout.
            with self._lock:
                left = self._inflight[tenant] - 1
                if left:
                    self._inflight[tenant] = left
                else:
                    del self._inflight[tenant]

    def _admit(self, tenant: str | None) -> None:
        with self._lock:
            mine, total = self._inflight.get(tenant, 0), sum(self._inflight.values())
            if mine >= self.limits.per_tenant or total >= self.limits.max_inflight:
                self.refused += 1
                who = "this tenant" if mine >= self.limits.per_tenant else "the server"
                limit = self.limits.per_tenant if mine >= self.limits.per_tenant else self.limits.max_inflight
                raise GrammarBusyError(f"too many grammar compilations in flight for {who} (limit {limit}); "
                                       "retry later or reuse a grammar already compiled")
            self._inflight[tenant] = mine + 1

    def _executor(self) -> ThreadPoolExecutor:
        with self._build_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="ironlm-grammar-pool")
            return self._pool

    def close(self) -> None:
        """Stop the pool's threads (queued compiles are dropped)."""
        with self._build_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
