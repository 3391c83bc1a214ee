"""Incremental detokenization with stop strings.

Text is produced with the prefix-offset / read-offset technique (as vLLM and `tokenizers.DecodeStream` do): each
step decodes only a short window of recent ids, `ids[prefix:]`, and emits what it adds beyond the window's
already-emitted head `ids[prefix:read]`. Decoding a window rather than single tokens keeps context-dependent
rendering right (a SentencePiece "▁word" only shows its space after another token), and a window whose text ends in
U+FFFD is an incomplete multi-byte character, so nothing is emitted until a later token completes it.

Stop strings: the output is cut before the first stop string (or after it with `include_stop_str_in_output`),
and while streaming, the longest tail that could still grow into a stop string is held back, so a delta never
contains characters that a later stop would retract.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Prompt tokens kept as decoding context for the first output tokens (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@dataclass
class DetokenizerDelta:
    text: str  # new text safe to stream (never retracted later)
    stopped: bool = False  # a stop string matched: the sequence is finished
    stop_str: str | None = None


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool,
                   spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text. Fast tokenizers go straight to the Rust `tokenizers.Tokenizer` (what transformers'
    decode calls anyway, minus its per-call Python overhead and the optional clean-up pass, which incremental
    decoding cannot apply consistently)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decode_batch") and hasattr(tokenizer, "id_to_token"):
        backend = tokenizer  # a bare tokenizers.Tokenizer
    if backend is not None:
        # Rust tokenizers have no spaces_between_special_tokens option (vLLM ignores it for them too).
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(tokenizer.decode).parameters
    except (TypeError, ValueError):
        params = {}
    if "spaces_between_special_tokens" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
    if "clean_up_tokenization_spaces" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["clean_up_tokenization_spaces"] = False
    return lambda ids: tokenizer.decode(ids, **kwargs)


class IncrementalDetokenizer:
    """Turns a sequence's generated ids into streamed text, one call per step.

    The engine passes the ids to render: when a sequence ends on EOS or a stop token id, it should leave that
    token out unless the user wants it in the text. Call `finish()` when the sequence ends for any reason other
    than a stop string, to release the held-back tail.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._decode = make_decode_fn(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        # Window invariant: self._ids == all_ids[prefix:], so the prefix offset is always 0 here and `_read`
        # counts the window's ids whose text (`_prefix_text`) has already been turned into output.
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""
        self._text = ""  # everything decoded so far (cut at the stop string once one matches)
        self._emitted = 0  # how much of _text has been handed out
        self._stop_str: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """The text streamed so far (the final text once stopped or finished)."""
        return self._text[: self._emitted]

    @property
    def stopped(self) -> bool:
        return self._stop_str is not None

    @property
    def stop_str(self) -> str | None:
        return self._stop_str

    def add(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        if self._finished:
            return DetokenizerDelta("", self.stopped, self._stop_str)
        self._ids.extend(token_ids)
        window_text = self._decode(self._ids)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            # Nothing new, or the last character is still incomplete: wait for more tokens.
            return DetokenizerDelta("")
        chunk = window_text[len(self._prefix_text):]
        # The new window starts where this step's output began: keeps enough context, and stays short.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._append(chunk, final=False)

    def finish(self) -> DetokenizerDelta:
        """The sequence ended (length, EOS, stop token, abort): release whatever was held back."""
        if self._finished:
            return DetokenizerDelta("", self.stopped, self._stop_str)
        rest = self._ids[self._read:]
        chunk = ""
        if rest:
            # Ids that never completed a character: emit their text as decode() would, U+FFFD included.
            window_text = self._decode(self._ids)
            chunk = window_text[len(self._prefix_text):]
            self._ids, self._read, self._prefix_text = [], 0, ""
        delta = self._append(chunk, final=True)
        self._finished = True
        return delta

    def _append(self, chunk: str, final: bool) -> DetokenizerDelta:
        before = len(self._text)
        self._text += chunk
        if self._stop:
            # Only a match that overlaps the new chunk can be new.
            start = max(0, before - self._max_stop + 1)
            best: tuple[int, int, str] | None = None
            for order, s in enumerate(self._stop):
                pos = self._text.find(s, start)
                if pos >= 0 and (best is None or (pos, order) < best[:2]):
                    best = (pos, order, s)
            if best is not None:
                pos, _, s = best
                end = pos + len(s) if self._include_stop else pos
                # Holding back guarantees end >= _emitted; max() keeps output_text consistent regardless.
                self._text = self._text[: max(end, self._emitted)]
                self._stop_str = s
                self._finished = True
                return self._emit(len(self._text), stopped=True)
        hold = 0 if final or self._include_stop else self._held_back()
        return self._emit(len(self._text) - hold, stopped=False)

    def _emit(self, upto: int, stopped: bool) -> DetokenizerDelta:
        upto = max(upto, self._emitted)
        text = self._text[self._emitted: upto]
        self._emitted = upto
        return DetokenizerDelta(text, stopped, self._stop_str if stopped else None)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text = self._text
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold
