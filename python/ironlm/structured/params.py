"""What a request's output must match (vLLM's `StructuredOutputsParams`), and its llguidance grammar text.

The core compiles `grammar()` (llguidance's TopLevelGrammar JSON) once per distinct grammar; this module only
validates the user's input and translates it, so it stays free of the core and cheap to import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ironlm.exceptions import InvalidArgumentError
from ironlm.structured import json_depth

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
PARAM_PREFIX = "structured_outputs."
# Rust's \d, \w and \s are Unicode classes (\d takes Devanagari and fullwidth digits); users of a regex constraint
# mean ASCII, as in most regex dialects they know. Nested classes are valid Rust regex, so `[\d-]` works too.
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def _invalid(field: str, reason: str) -> InvalidArgumentError:
    param = PARAM_PREFIX + field
    return InvalidArgumentError(f"{param} {reason}", param=param)


def regex_to_lark(pattern: str) -> str:
    r"""The body of a Lark `/.../` terminal matching `pattern` (Rust regex syntax).

    An unescaped `/` would end the terminal early, and raw newlines would break the grammar's lines. One outer
    `^`/`$` pair is dropped: users write anchored patterns, the grammar already matches the whole output, and
    llguidance's regex engine has no anchors. `\d`, `\w`, `\s` (and negations) become ASCII classes.
    """
    pattern = pattern.removeprefix("^")
    if pattern.endswith("$") and not _escaped_at(pattern, len(pattern) - 1):
        pattern = pattern[:-1]
    out: list[str] = []
    escaped = False
    for ch in pattern:
        if escaped:
            cls = _ASCII_CLASSES.get(ch.lower())
            if cls is None:
                out.append("\\" + ch)
            else:
                out.append(f"[{'^' if ch.isupper() else ''}{cls}]")
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "/":
            out.append("\\/")
        elif ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        else:
            out.append(ch)
    if escaped:
        out.append("\\\\")  # a trailing lone backslash: let the regex compiler report it, not the Lark lexer
    return "".join(out)


def _escaped_at(text: str, index: int) -> bool:
    backslashes = 0
    while index - 1 - backslashes >= 0 and text[index - 1 - backslashes] == "\\":
        backslashes += 1
    return backslashes % 2 == 1


@dataclass
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice`, `grammar` (Lark / EBNF)
    or `json_object` (any JSON object).

    JSON output is compact by default (`disable_any_whitespace=True`, unlike vLLM): with free whitespace between
    tokens a weak model can spend its whole budget on blanks and never close the object. `whitespace_pattern`
    (a regex) replaces the whitespace allowed between JSON tokens, as in vLLM.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise InvalidArgumentError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {got}", param="structured_outputs")
        if self.json is not None:
            self.json = self._check_schema(self.json)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise _invalid("regex", f"must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            self._check_choice()
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise _invalid("grammar", f"must be a non-empty string, got {self.grammar!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _invalid("json_object", f"must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _invalid("disable_any_whitespace", f"must be a bool, got {self.disable_any_whitespace!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise _invalid("whitespace_pattern", f"must be a string, got {self.whitespace_pattern!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of json, regex, choice, grammar, json_object."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def param(self) -> str:
        """The parameter an error in this constraint (e.g. a schema the compiler rejects) is reported under."""
        return PARAM_PREFIX + self.kind

    @staticmethod
    def _check_schema(schema: object) -> dict[str, Any]:
        param = PARAM_PREFIX + "json"
        if isinstance(schema, str):
            try:
                schema = json_depth.loads(schema, param)
            except json.JSONDecodeError as e:
                raise _invalid("json", f"is not valid JSON: {e}") from None
        else:
            json_depth.check_depth(schema, param)
        if isinstance(schema, bool):
            # JSON Schema allows `true` (anything) and `false` (nothing); as an object they compile the same way.
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise _invalid("json", f"must be a JSON schema object, got {type(schema).__name__}")
        return schema

    def _check_choice(self) -> None:
        if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)) or not self.choice:
            raise _invalid("choice", f"must be a non-empty list of strings, got {self.choice!r}")
        for c in self.choice:
            if not isinstance(c, str):
                raise _invalid("choice", f"must contain only strings, got {c!r}")
        # Order-preserving dedupe: a repeated alternative would only make the grammar ambiguous.
        self.choice = list(dict.fromkeys(self.choice))

    # -- llguidance ----------------------------------------------------------------------------------

    def grammar_text(self) -> str:
        """llguidance's TopLevelGrammar JSON for this constraint (what the core's GrammarCompiler takes)."""
        kind = self.kind
        if kind in ("json", "json_object"):
            schema: dict[str, Any] = dict(self.json) if isinstance(self.json, dict) else {"type": "object"}
            schema["x-guidance"] = self._json_options(schema.get("x-guidance"))
            return json.dumps({"grammars": [{"json_schema": schema}]})
        if kind == "regex":
            assert self.regex is not None
            lark = f"start: /{regex_to_lark(self.regex)}/"
        elif kind == "choice":
            assert self.choice is not None
            # Lark string literals are JSON string literals in llguidance, so json.dumps quotes them exactly.
            lark = "start: " + " | ".join(
                json.dumps(c) if c else '""' for c in self.choice)
        else:
            assert self.grammar is not None
            lark = self.grammar
        return json.dumps({"grammars": [{"lark_grammar": lark}]})

    def _json_options(self, user: object) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.whitespace_pattern is not None:
            opts["whitespace_pattern"] = self.whitespace_pattern
        else:
            opts["whitespace_flexible"] = not self.disable_any_whitespace
        if isinstance(user, dict):
            # A schema that carries its own llguidance options (x-guidance) knows best.
            opts.update(user)
        return opts
