"""Which key sent each engine request, for the engine page: a key that is not an
admin's sees the ids of its own requests only (server/auth.py).

Engine request ids are random (engine_request_id), never derived from the ids the
clients are told, so a stored response's public id cannot be learnt from the page.
The map is the process's one (engine ids are unique across every app in it),
bounded: the newest MAX_ENTRIES ids are kept, which covers every running request
and the page's list of those just finished."""
from __future__ import annotations

import secrets
from collections import OrderedDict

from kvserve.server.auth import current_principal

MAX_ENTRIES = 8192
# The response header that tells a client its own request's engine id (the engine
# page's playground finds its requests in the stream by it).
ENGINE_ID_HEADER = "x-kvserve-request-id"

_owners: OrderedDict[str, str] = OrderedDict()


def engine_request_id() -> str:
    """A new engine request id, recorded as the current request's key's. The
    engine runs prompt i of it as `<id>-<i>`."""
    engine_id = f"req-{secrets.token_hex(12)}"
    _owners[engine_id] = current_principal().owner
    while len(_owners) > MAX_ENTRIES:
        _owners.popitem(last=False)
    return engine_id


def owner_of(sequence_id: str) -> str | None:
    """The owner tag of an engine request (`<id>` or `<id>-<i>`); None if unknown."""
    found = _owners.get(sequence_id)
    if found is None and "-" in sequence_id:
        found = _owners.get(sequence_id.rsplit("-", 1)[0])
    return found
