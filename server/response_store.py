"""Finished /v1/responses kept for previous_response_id and GET/DELETE
/v1/responses/{id}: in memory, bounded by count, least recently used out first."""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field


class EventLog:
    """A streamed background response's events (SSE strings; event i has
    sequence_number i), kept so that a client can read them again or
    resume (GET /v1/responses/{id}?stream=true&starting_after=N)."""

    def __init__(self):
        self.events: list[str] = []
        self.done = False
        self._changed = asyncio.Event()

    def add(self, chunk: str) -> None:
        """One or more SSE events ("...\n\n" each) from the response's stream."""
        self.events += [e + "\n\n" for e in chunk.split("\n\n") if e]
        self._changed.set()

    def close(self) -> None:
        self.done = True
        self._changed.set()

    async def tail(self, after: int = -1):
        """The events after sequence number `after`, then each new one, until the response ends."""
        i = after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            self._changed.clear()       # (no await since the checks above: nothing was added meanwhile)
            await self._changed.wait()


@dataclass
class StoredResponse:
    body: dict
    messages: list[dict]      # the conversation through this response, as chat messages (no instructions)
    events: EventLog | None = None      # a background response created with stream: its events
    inputs: list[dict] = field(default_factory=list)    # its request's input items (GET .../input_items)


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
