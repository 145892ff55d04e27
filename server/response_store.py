"""Finished /v1/responses kept for previous_response_id and GET/DELETE
/v1/responses/{id}: in memory, bounded by count, least recently used out first."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    body: dict
    messages: list[dict]      # the conversation through this response, as chat messages (no instructions)


class ResponseStore:
    """Finished responses by id, at most `size` (least recently used out first)."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, stored: StoredResponse) -> None:
        if self.size <= 0:
            return
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def peek(self, rid: str) -> StoredResponse | None:
        """As get, without counting as a use."""
        return self._items.get(rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def get(self, rid: str) -> StoredResponse | None:
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None
