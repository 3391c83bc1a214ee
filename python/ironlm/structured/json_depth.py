"""How deep a JSON value may nest: one check for every place user JSON reaches recursive code.

Python's `json` and the chat templates' `tojson` recurse once per level (about 1,000 levels end in a
RecursionError), and the core's grammar parser stops at 128. Bounding the depth up front turns both into a 400
naming the field, never a 500.
"""

from __future__ import annotations

import json
from typing import Any

from ironlm.exceptions import InvalidArgumentError

# Below the core's serde limit (128) with room for the 3 levels of llguidance's grammar wrapper.
MAX_JSON_DEPTH = 100


def too_deep(param: str, limit: int = MAX_JSON_DEPTH) -> InvalidArgumentError:
    return InvalidArgumentError(f"{param} is nested more than {limit} levels deep", param=param)


def json_depth(value: object, limit: int = MAX_JSON_DEPTH) -> int:
    """Levels of dicts and lists in `value` (a scalar is 0), counted without recursion; stops counting once past
    `limit` (the result is then `limit + 1`)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        depth += 1
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((c, depth) for c in children)
    return deepest


def check_depth(value: object, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """InvalidArgumentError naming `param` when `value` nests deeper than `limit`."""
    if json_depth(value, limit) > limit:
        raise too_deep(param, limit)


def loads(text: str | bytes, param: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` with the depth bounded; json.JSONDecodeError still propagates (callers differ on it)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep(param, limit) from None
    check_depth(value, param, limit)
    return value
