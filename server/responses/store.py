"""Stored responses (`store: true`, the default): what GET /v1/responses/{id} answers
and what previous_response_id continues. Held in this process's memory only, at most
--responses-store-max of them holding at most --responses-store-bytes together (their
body and conversation as JSON), each for --responses-store-ttl seconds: the oldest go
first, and a restart forgets them all (the README says so).

Each belongs to the key that made it (server/auth.py's owner tag): to any other key
it does not exist, for GET, DELETE and previous_response_id alike (404, the same
answer as for an id never made)."""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object as last sent
    messages: list[dict]  # the conversation it ends, as chat messages, its output included
    expires: float
    owner: str  # the owner tag of the key that made it
    size: int  # bytes, as JSON, counted against the store's budget


class ResponseStore:
    def __init__(self, max_entries: int, ttl: float, max_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        """max_bytes: what all entries may hold together (0: no limit)."""
        self.max_entries, self.ttl, self.max_bytes = max_entries, ttl, max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0  # what the entries hold, as JSON

    @classmethod
    def of(cls, config) -> ResponseStore:
        """The store the server's settings (ServerConfig's responses_store_*) ask for."""
        return cls(config.responses_store_max, config.responses_store_ttl,
                   config.responses_store_bytes)

    def put(self, rid: str, body: dict, messages: list[dict], owner: str) -> None:
        """Keeps it (an entry larger than the whole budget is not kept)."""
        if self.max_entries <= 0:
            return
        size = len(json.dumps(body)) + len(json.dumps(messages))
        if self.max_bytes and size > self.max_bytes:
            return
        self._expire()
        self._drop(rid)
        self._entries[rid] = StoredResponse(body, messages, self._clock() + self.ttl, owner,
                                            size)
        self.bytes += size
        while len(self._entries) > self.max_entries or (self.max_bytes
                                                        and self.bytes > self.max_bytes):
            self._pop_oldest()

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        """The response if `owner` made it (else None, as for an unknown id)."""
        self._expire()
        entry = self._entries.get(rid)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, rid: str, owner: str) -> bool:
        if self.get(rid, owner) is None:
            return False
        self._drop(rid)
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        """Entries expire in the order they were put (one TTL for all)."""
        now = self._clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        self.bytes -= self._entries.popitem(last=False)[1].size

    def _drop(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
