"""The Responses API's store: finished responses kept in memory so `previous_response_id` can continue them and
GET / DELETE /v1/responses/{id} can find them.

Bounded twice, least recently used first out: by entries (`--response-store-size`, 0 turns the store off) and by
the characters the entries hold (`--response-store-max-chars`), so a few huge conversations cannot hold the
server's memory either. Nothing is written to disk; a restart forgets everything, as the flag's help says.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response object as it was returned
    messages: list[dict[str, Any]]  # the conversation so far as chat messages: input, then this response's output

    def size(self) -> int:
        return len(json.dumps(self.body, ensure_ascii=False)) + len(json.dumps(self.messages, ensure_ascii=False))


class ResponseStore:
    def __init__(self, max_entries: int, max_chars: int) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # handlers run on one loop, but tests and tools may call from threads

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def chars(self) -> int:
        return self._chars

    def put(self, rid: str, entry: StoredResponse) -> bool:
        """Keep `entry`; False (not kept) when the store is off or the entry alone is over the character bound."""
        size = entry.size()
        if not self.enabled or size > self.max_chars:
            return False
        with self._lock:
            self._drop(rid)
            self._items[rid] = (entry, size)
            self._chars += size
            while len(self._items) > self.max_entries or self._chars > self.max_chars:
                _, (_, old) = self._items.popitem(last=False)
                self._chars -= old
        return True

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(rid)
            if item is None:
                return None
            self._items.move_to_end(rid)
            return item[0]

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is None:
            return False
        self._chars -= item[1]
        return True
