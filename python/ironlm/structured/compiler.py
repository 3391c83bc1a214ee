"""One grammar compiler per engine, with an LRU of compiled grammars keyed by grammar text.

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


class GrammarCache:
    """Thread-safe. Failures are cached too: a grammar that timed out once would only time out again."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int, timeout: float) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._timeout = timeout
        self._cache_size = cache_size
        self._compiler: _core.GrammarCompiler | None = None
        self._cache: OrderedDict[str, _core.CompiledGrammar | str] = OrderedDict()
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
                    timeout=self._timeout)
            return self._compiler

    def compile(self, text: str, param: str = "structured_outputs") -> _core.CompiledGrammar:
        """Raises GrammarError naming `param`."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                self.hits += 1
        if hit is None:
            self.misses += 1
            try:
                hit = self.compiler.compile(text, param=param)
            except GrammarError as e:
                hit = str(e)
            with self._lock:
                self._cache[text] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise GrammarError(hit, param)
        return hit

    def compile_params(self, params: StructuredOutputsParams) -> _core.CompiledGrammar:
        return self.compile(params.grammar_text(), param=params.param)
