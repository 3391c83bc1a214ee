"""One grammar compiler per engine, with an LRU of compiled grammars bounded by their memory.

The core builds the tokenizer's token trie once (on first use: most engines never see a constrained request)
and compiles with the GIL released, so any thread may call `compile`: the async engine compiles in the caller's
thread before a request is queued, and a slow grammar delays only its own request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ironlm import _core
from ironlm.exceptions import GrammarError
from ironlm.structured.vocab import token_vocab

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ironlm.structured.params import StructuredOutputsParams

# The compiled grammars kept, by their estimated memory (CompiledGrammar.size_bytes): a 100k-alternative regex
# costs ~30 MB by that estimate, a usual JSON schema well under 1 MB.
DEFAULT_CACHE_BYTES = 512 << 20
# What an entry costs beside its grammar: the dict slot, the key's str object, the failure message.
_ENTRY_OVERHEAD = 256


class GrammarCache:
    """Thread-safe. Failures are cached too: a grammar that timed out once would only time out again."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int, timeout: float, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 max_grammar_bytes: int | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._timeout = timeout
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._max_grammar_bytes = max_grammar_bytes
        self._compiler: _core.GrammarCompiler | None = None
        self._cache: OrderedDict[str, tuple[_core.CompiledGrammar | str, int]] = OrderedDict()
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def compiler(self) -> _core.GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                tv = token_vocab(self._tokenizer)
                self._compiler = _core.GrammarCompiler(
                    tv.token_bytes[: self._vocab_size], eos_token_ids=self._eos, vocab_size=self._vocab_size,
                    special_token_ids=[t for t in tv.special_token_ids if t < self._vocab_size],
                    timeout=self._timeout, max_grammar_bytes=self._max_grammar_bytes)
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
        """Raises GrammarError naming `param`."""
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
