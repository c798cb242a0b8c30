"""A bounded memo of parsed documents, safe to share between threads (operator handlers may
parse on several): the least recently used entry leaves first."""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable
from typing import Any

MISSING: Any = object()
"""What `get` answers for a key it does not hold (a parsed value may be anything)."""


class Memo:
    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        with self._lock:
            if key not in self._entries:
                return MISSING
            self._entries.move_to_end(key)
            return self._entries[key]

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
